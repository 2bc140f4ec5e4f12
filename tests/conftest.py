import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402  (does not import triton)

# Triton reads TRITON_INTERPRET when it is imported (its standard library, tl.sum included, is decorated then), so
# without a GPU the interpreter is switched on here, before transformers/kvpress import triton: the Triton backend
# is then tested on CPU tensors through the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded default model, float32, sdpa."""
    from kvpress_critical.default_model import load_default_model

    return load_default_model()


@pytest.fixture(scope="session")
def smollm2_pipeline(smollm2):
    from transformers import pipeline

    model, tokenizer = smollm2
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
