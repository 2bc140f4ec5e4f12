import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402  (does not import triton)
import yaml  # noqa: E402

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
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    from transformers import pipeline

    model, tokenizer = smollm2
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def smoke_sweep(tmp_path_factory):
    """
    ``(preset file, results folder, completed process)``: the evaluation tests' smoke preset (``helpers.SMOKE_PRESET``)
    run once per session with the local launcher; test_evaluation_smoke checks its results, test_cluster_launchers
    compares the Ray and SLURM launchers with them.
    """
    from helpers import SMOKE_PRESET, evaluate

    folder = tmp_path_factory.mktemp("smoke")
    preset = folder / "tiny.yaml"
    preset.write_text(yaml.safe_dump(SMOKE_PRESET))
    output = folder / "results"
    result = evaluate("--preset", str(preset), "--output-dir", str(output), "--workers", "2", "--threads", "1")
    return preset, output, result
