"""``ragged_attention``: attention over the compact per-head KV layout, and the single place its backend is chosen.

The layout (:mod:`kvpress_critical.cache`): the entries a head-wise press kept for each (batch row, KV head) are
packed segment after segment (``keys``, ``values``: ``(N, d)``; segment ``s = b * H_kv + h`` at rows
``cu_seqlens[s]:cu_seqlens[s + 1]``, flash-attn's varlen convention), and the tokens added afterwards (the question,
the generated tokens) are a dense tail shared by every head, ``(B, H_kv, C, d)`` with ``tail_len`` valid of ``C``
reserved. The op computes, for the ``q`` new tokens (the last ``q`` of the tail), softmax attention over their
segment's context entries plus the tail up to themselves (causal), with GQA inside (query heads ``h * G ..
(h + 1) * G - 1`` read KV head ``h``; nothing is repeated), softmax in float32.

Backends (:data:`RAGGED_ATTENTION`; ``auto`` order CPU ``cpp`` > ``torch``, CUDA ``flash`` > ``triton`` > ``torch``;
``$KVPRESS_CRITICAL_RAGGED_ATTENTION_BACKEND`` replaces ``auto``): ``torch`` (portable), ``cpp`` (the C++ extension,
parallel over segments and chunks of them), ``triton`` (CUDA; the interpreter on CPU tensors for tests) and
``flash`` (flash-attn's ``flash_attn_varlen_func`` on the packed context and ``flash_attn_func`` on the tail, merged
by log-sum-exp; fp16 / bf16, when the package ``flash-attn`` is installed).

The folder holds the op whole: :mod:`.naive` (the float64 reference and the tolerances), one module per backend
(:mod:`.torch_backend`, :mod:`.cpp_backend`, :mod:`.triton_backend` with :mod:`.triton_kernel`, :mod:`.flash_backend`),
:mod:`.layout` (offsets, random layouts) and this dispatch.
"""

from __future__ import annotations

import torch

from kvpress_critical.ops.extension import cpp_availability
from kvpress_critical.ops.ragged_attention.codes import FORMATS, QuantizedEntries
from kvpress_critical.ops.ragged_attention.cpp_backend import ragged_attention_cpp
from kvpress_critical.ops.ragged_attention.flash_backend import (
    flash_availability,
    flash_supports,
    ragged_attention_flash,
)
from kvpress_critical.ops.ragged_attention.layout import cu_seqlens_from_lengths, offsets_on, random_layout
from kvpress_critical.ops.ragged_attention.naive import ATTENTION_TOLERANCE, ragged_attention_ref
from kvpress_critical.ops.ragged_attention.torch_backend import SDPA_MIN_QUERIES, ragged_attention_torch
from kvpress_critical.ops.registry import Backend, OpRegistry
from kvpress_critical.ops.triton_utils import triton_availability, triton_devices

AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("flash", "triton", "torch"), "cpu": ("cpp", "torch")}
# On CPU the cpp kernel is the fast path for decoding (a few queries); from this many queries on (a prefill chunk
# over a compact cache) the torch backend's per-segment sdpa is faster: at 3.5K entries per head, SmolLM2's shape,
# 64 queries take 34 ms in cpp and 11 ms in torch, 1024 queries 410 and 108 ms. The threshold is the one at which
# the torch backend switches to that path (below it, its per-segment loop is not faster than cpp).
CPU_MULTI_QUERY = SDPA_MIN_QUERIES


def _input_order(device_type: str, query=None, *_) -> tuple[str, ...] | None:
    if device_type == "cpu" and query is not None and query.shape[2] >= CPU_MULTI_QUERY:
        return ("torch", "cpp")
    return None


RAGGED_ATTENTION = OpRegistry(
    "ragged_attention", AUTO_ORDER, input_order=_input_order, legacy_env_var="KVPRESS_CRITICAL_ATTENTION_BACKEND"
)


def _check_inputs(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len) -> None:
    if query.dim() != 4:
        raise ValueError(f"query must be (batch, heads, q_len, head_dim), got shape {tuple(query.shape)}")
    quantized = isinstance(keys, QuantizedEntries)
    if quantized != isinstance(values, QuantizedEntries):
        raise TypeError("keys and values must both be tensors or both QuantizedEntries")
    if quantized and keys.bits != values.bits:
        raise ValueError(f"keys are {keys.bits}-bit codes but values {values.bits}-bit ones")
    if len(keys.shape) != 2 or keys.shape != values.shape:
        raise ValueError(
            f"keys and values must be packed (entries, head_dim), got {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    if tail_keys.dim() != 4 or tail_keys.shape != tail_values.shape:
        raise ValueError(
            f"tail keys/values must be (batch, kv_heads, capacity, head_dim), got {tuple(tail_keys.shape)}"
        )
    bsz, heads, _, head_dim = query.shape
    num_kv_heads = tail_keys.shape[1]
    if keys.shape[1] != head_dim or tail_keys.shape[3] != head_dim or tail_keys.shape[0] != bsz:
        raise ValueError("query, keys and tail keys disagree on batch size or head_dim")
    if num_kv_heads == 0 or heads % num_kv_heads:
        raise ValueError(f"the query's {heads} heads are not a multiple of the cache's {num_kv_heads} KV heads")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != bsz * num_kv_heads + 1:
        raise ValueError(
            f"cu_seqlens must have batch * kv_heads + 1 = {bsz * num_kv_heads + 1} entries, got "
            f"{tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device.type == "cpu":  # (the compact layer keeps it on the host: checking costs no sync)
        steps = cu_seqlens[1:] - cu_seqlens[:-1]
        if int(cu_seqlens[0]) != 0 or bool((steps < 0).any()) or int(cu_seqlens[-1]) != keys.shape[0]:
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at the {keys.shape[0]} packed entries; got "
                f"{cu_seqlens[0].item()}..{cu_seqlens[-1].item()}"
                + (" (decreasing)" if bool((steps < 0).any()) else "")
            )
    if not 0 <= tail_len <= tail_keys.shape[2]:
        raise ValueError(f"tail_len {tail_len} outside the tail's capacity {tail_keys.shape[2]}")
    devices = {t.device for t in (query, keys, values, tail_keys, tail_values)}
    if len(devices) != 1:
        raise ValueError(f"the query and the cache are on different devices: {sorted(map(str, devices))}")


def ragged_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_len: int,
    scale: float,
    max_seqlen: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """
    Attention of ``q`` new tokens over the compact per-head layout (module docstring).

    Parameters
    ----------
    query : torch.Tensor
        ``(B, H, q, d)`` post-RoPE queries, any float dtype.
    keys, values : torch.Tensor or QuantizedEntries
        ``(N, d)`` packed context entries, segment ``b * H_kv + h`` at ``cu_seqlens[s]:cu_seqlens[s + 1]``: float
        tensors, or int8 / int4 codes with one scale per entry (:class:`.codes.QuantizedEntries`), which every
        backend but ``flash`` reads as they are.
    cu_seqlens : torch.Tensor
        ``(B * H_kv + 1,)`` int offsets (on CPU or on the cache's device).
    tail_keys, tail_values : torch.Tensor
        ``(B, H_kv, C, d)`` appended tokens, the first ``tail_len`` valid; the queries are the last ``q`` of them.
    tail_len : int
    scale : float
        Softmax scale.
    max_seqlen : int, optional
        The longest segment (flash-attn needs it on the host; computed when not given).
    backend : str
        ``"auto"`` or a name from ``RAGGED_ATTENTION.available()``.

    Returns
    -------
    torch.Tensor
        ``(B, q, H, d)`` in the query's dtype; a query that sees no entry gets zeros.
    """
    _check_inputs(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len)
    name = RAGGED_ATTENTION.resolve(backend, query.device, query, keys)
    return RAGGED_ATTENTION[name].fn(
        query, keys, values, cu_seqlens, tail_keys, tail_values, int(tail_len), float(scale), max_seqlen
    )


def ragged_attention_triton(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale, max_seqlen=None):
    """The Triton backend (imports triton on first use: :mod:`.triton_backend`)."""
    from kvpress_critical.ops.ragged_attention.triton_backend import ragged_attention_triton as triton_fn

    return triton_fn(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale, max_seqlen)


RAGGED_ATTENTION.register(Backend("torch", ragged_attention_torch, ("cpu", "cuda"), lambda: None))
RAGGED_ATTENTION.register(Backend("cpp", ragged_attention_cpp, ("cpu",), cpp_availability))
RAGGED_ATTENTION.register(Backend("triton", ragged_attention_triton, triton_devices, triton_availability))
RAGGED_ATTENTION.register(
    Backend("flash", ragged_attention_flash, ("cuda",), flash_availability, supports=flash_supports)
)


__all__ = [
    "ATTENTION_TOLERANCE",
    "AUTO_ORDER",
    "FORMATS",
    "QuantizedEntries",
    "CPU_MULTI_QUERY",
    "RAGGED_ATTENTION",
    "cu_seqlens_from_lengths",
    "offsets_on",
    "ragged_attention",
    "ragged_attention_ref",
    "random_layout",
]
