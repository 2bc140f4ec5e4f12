"""Shared test utilities: tiny config-built models, observing what a press keeps, running the evaluation driver."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from kvpress_critical.capabilities import capabilities
from kvpress_critical.modeling import attention_modules


@torch.no_grad()
def prefill_keys(model, input_ids, press=None):
    """Run the prefill (with ``press`` if given) and return the cache keys of every layer."""
    cache = DynamicCache()
    if press is None:
        model.model(input_ids=input_ids, past_key_values=cache)
    else:
        with press(model):
            model.model(input_ids=input_ids, past_key_values=cache)
    return [layer.keys for layer in cache.layers]


def _match_rows(kept: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Boolean (B, H, T) mask of the rows of ``original`` that appear in ``kept`` (verified exact copies)."""
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[original.element_size()]
    coeffs = torch.randint(1, 2**31, (original.shape[-1],), generator=torch.Generator().manual_seed(0))

    def fingerprint(x):  # exact integer hash of each row's bits
        return (x.contiguous().view(int_type).long() * coeffs).sum(-1)

    fp_orig, fp_kept = fingerprint(original), fingerprint(kept)  # (B, H, T) / (B, H, n)
    sorted_fp, order = fp_orig.sort(-1)
    pos = torch.searchsorted(sorted_fp, fp_kept).clamp_(max=original.shape[2] - 1)
    idx = order.gather(-1, pos)  # (B, H, n) candidate positions
    copies = original.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, original.shape[-1]))
    assert torch.equal(copies, kept), "a kept key is not a copy of an original key"
    mask = torch.zeros(original.shape[:3], dtype=torch.bool).scatter_(-1, idx, True)
    assert bool((mask.sum(-1) == kept.shape[2]).all()), "the same entry was kept twice"
    return mask


@torch.no_grad()
def kept_masks(model, input_ids, press, original=None):
    """
    Per layer, a boolean (B, H_kv, T) mask of the entries ``press`` keeps after prefilling ``input_ids``.

    Pruning presses are observed through the cache they leave; head-wise presses (AdaKV family)
    through the ``masked_key_indices`` they set. ``original`` (the keys of a full-cache prefill of the
    same input) can be passed to save a forward pass.
    """
    original = prefill_keys(model, input_ids) if original is None else original
    compressed = prefill_keys(model, input_ids, press)
    masks = []
    for layer, (orig, comp) in enumerate(zip(original, compressed)):
        module = attention_modules(model)[layer]
        idx = getattr(module, "masked_key_indices", None)
        head_wise = capabilities(press).selection == "head-wise"
        if head_wise or (idx is not None and comp.shape == orig.shape):  # masking (also inside wrappers)
            mask = torch.ones(orig.shape[:3], dtype=torch.bool)
            if idx is not None:
                b, h, s = (i.cpu() for i in idx)
                mask[b, h, s] = False
            masks.append(mask)
        else:
            masks.append(_match_rows(comp, orig))
    return masks


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
_MODEL_CACHE: dict = {}


def tiny_config(**overrides) -> dict:
    """The keyword arguments of a tiny config (any family's: 256 tokens, hidden 64, 2 layers, 4 query and 2 KV
    heads, sdpa), ``overrides`` replacing or adding fields (a sliding window, a head_dim, ...)."""
    return {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "attn_implementation": "sdpa",
        **overrides,
    }


def tiny_model(
    family: str,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    num_layers: int = 2,
):
    """A tiny randomly initialised model of ``family`` built from its config (no download), cached."""
    import transformers as tf

    key = (family, num_kv_heads, num_heads, dtype, attn_implementation, num_layers)
    if key in _MODEL_CACHE:
        return _MODEL_CACHE[key]
    common = tiny_config(
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        attn_implementation=attn_implementation,
    )
    config_cls, model_cls, extra = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),  # config has no head_dim
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),  # q/k norm
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {"pad_token_id": 0}),  # fused qkv, no head_dim
        # head_dim (32) != hidden_size / num_heads (16)
        "gemma3": (
            tf.Gemma3TextConfig,
            tf.Gemma3ForCausalLM,
            {"head_dim": 32, "layer_types": ["full_attention"] * num_layers, "sliding_window": 4096},
        ),
    }[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common, **extra))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # trained norms are not constant: constant q/k norms would tie every key norm
                param.add_(0.3 * torch.randn_like(param))
            elif any(p in name for p in ("q_proj", "k_proj", "qkv_proj")):  # peaky attention, as in trained models
                param.mul_(4.0)
    model = model.to(dtype).eval()
    _MODEL_CACHE[key] = model
    return model


def head_scores(model, slope: float = 0.0) -> dict:
    """HeadKV head scores (its ``{'layer-head': [score]}`` format) for ``model``: ``1 + slope * head`` in every layer
    (``slope=0``: uniform scores, every head the same budget)."""
    cfg = model.config
    return {
        f"{layer}-{h}": [1.0 + slope * h]
        for layer in range(cfg.num_hidden_layers)
        for h in range(cfg.num_attention_heads)
    }


REPO = Path(__file__).resolve().parents[1]


def evaluate_command(*args: str, env: dict | None = None) -> tuple[list[str], dict, Path]:
    """``(command, environment, folder)`` of ``bash evaluation/evaluate.sh ARGS`` from the repository, offline, with
    this interpreter."""
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHON=sys.executable, **(env or {}))
    return ["bash", str(REPO / "evaluation" / "evaluate.sh"), *args], full_env, REPO


def evaluate(*args: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """``bash evaluation/evaluate.sh ARGS`` from the repository, offline, with this interpreter."""
    command, full_env, cwd = evaluate_command(*args, env=env)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


# The evaluation tests' smoke preset (conftest's smoke_sweep runs it once per session with the local launcher).
SMOKE_MODEL = "SmolLM2-135M-Instruct"
SMOKE_PRESET = {
    "models": ["embedded"],
    "datasets": [
        {
            "dataset": "ruler_offline",
            "data_dir": "384",
            "generate": {
                "context_length": 384,
                "n_samples": 1,
                "tasks": ["niah_single_2", "niah_multikey_1"],
                "seed": 0,
                "max_new_tokens": {"niah": 16},
            },
        },
    ],
    # DuoAttention publishes no head pattern for the embedded model: a configuration that fails
    "presses": ["no_press", "duo_attention", "critical_snapkv", "critical_adakv_snapkv"],
    "compression_ratios": [0.5],
    "device": "cpu",
    "model_kwargs": {"attn_implementation": "sdpa", "dtype": "float32"},
}
SMOKE_GOOD = [
    f"ruler_offline__384__{SMOKE_MODEL}__no_press__0.00",
    f"ruler_offline__384__{SMOKE_MODEL}__critical_snapkv__0.50",
    f"ruler_offline__384__{SMOKE_MODEL}__critical_adakv_snapkv__0.50",
]
SMOKE_FAILING = f"ruler_offline__384__{SMOKE_MODEL}__duo_attention__0.50"


# SCBench's multi-turn tasks in the public dataset's format, small enough for the embedded model
UUIDS = [f"{i:08x}-7e1a-4c2b-9f3d-{i * 7919:012x}" for i in range(1, 17)]


def scbench_sample(folder, n_examples: int = 2, n_pairs: int = 8) -> None:
    """Three tasks in the public dataset's format (data/<task>.jsonl), small enough to run on the embedded model."""
    data = folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    kv, mf, qa = [], [], []
    for i in range(n_examples):
        pairs = {UUIDS[(i + j) % 16]: UUIDS[(i + 2 * j + 5) % 16] for j in range(n_pairs)}
        keys = list(pairs)
        turns = [
            {"input": f'Key: "{k}"\nThe value associated with the specified key is:', "answer": pairs[k]}
            for k in keys[:2]
        ]
        kv.append({"id": i, "context": json.dumps(pairs), "multi_turns": turns})
        numbers = [int(x) for x in np.random.default_rng(i).integers(0, 1000, 40)]
        mf.append(
            {
                "id": i,
                "context": numbers,
                "multi_turns": [
                    {"input": "The largest number of the list is", "answer": max(numbers)},
                    {"input": "The smallest number of the list is", "answer": min(numbers)},
                ],
            }
        )
        qa.append(
            {
                "id": i,
                "context": f"Chapter one. The keeper of the light was called Mara {i}. She kept a logbook.",
                "multi_turns": [
                    {"input": "Who kept the light?", "answer": f"Mara {i}"},
                    {"input": "What did she keep?", "answer": "a logbook"},
                ],
            }
        )
    for task, rows in (("scbench_kv", kv), ("scbench_mf", mf), ("scbench_qa_eng", qa)):
        (data / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
