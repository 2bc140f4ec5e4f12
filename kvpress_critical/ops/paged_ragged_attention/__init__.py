"""``paged_ragged_attention``: attention over head-wise budgets kept inside a paged KV cache, and its dispatch.

The layout (:mod:`.layout`): the entries each KV head of a row kept (any number per head) are packed head after head
into the row's *region*, whole cache blocks read as ``R = block_size * H_kv`` key rows and ``R`` value rows of ``d``
elements each (``region_keys``, ``region_values``: ``(blocks, R, d)`` views of the cache); the row's *tail* (the
tokens from the end of the region on, which every head holds) stays in the serving engine's own format, read
through its block table and the element offsets of a key / value inside a block. The op computes, for the ``q``
new tokens (the last ``q`` of each row's tail), softmax attention over their head's region entries plus the tail up
to themselves (causal), with GQA inside (query heads ``h * G .. (h + 1) * G - 1`` read KV head ``h``), softmax in
float32. It is :func:`kvpress_critical.ops.ragged_attention` with block tables: the math of the compact cache over
the blocks a paged engine (vLLM, :mod:`kvpress_critical_vllm`) already holds.

A logits soft cap (Gemma 2: ``soft_cap * tanh(s / soft_cap)`` of each score before the softmax) and attention sinks
(gpt-oss: one learned logit per query head in the softmax's denominator, with no value) are applied by every backend
(``cpp`` in its micro-kernels and its merge, ``triton`` in its kernel and its merge, ``torch`` as one more part).

The cache may hold fp8 codes (``region_*`` and ``tail_*`` in one of :data:`FP8_DTYPES`, vLLM's fp8 KV caches): an
entry is then its code times the per-tensor ``k_scale`` (keys) or ``v_scale`` (values; e4m3's NaN code, which
vLLM's saturating quantizer never writes, reads as NaN in ``torch`` and as 480 times the scale in ``cpp`` and
``triton``), read in place by every backend (``cpp`` and ``triton`` convert them in registers, reading a quarter of
float32's bytes).

Backends (:data:`PAGED_RAGGED_ATTENTION`; ``auto``: CPU ``cpp`` > ``torch``, CUDA ``triton`` > ``torch``;
``$KVPRESS_CRITICAL_PAGED_RAGGED_ATTENTION_BACKEND`` replaces ``auto``): ``torch`` (portable: one segment gathered at
a time), ``cpp`` (the C++ extension's kernel of ``ragged_attention``, reading the region in place run by run and the
tail through its offsets), ``triton`` (CUDA; the interpreter on CPU tensors for tests).
"""

from __future__ import annotations

import torch

from kvpress_critical.ops.extension import cpp_availability
from kvpress_critical.ops.paged_ragged_attention.layout import packed_segments, random_paged_layout, split_offsets
from kvpress_critical.ops.paged_ragged_attention.naive import paged_ragged_attention_ref
from kvpress_critical.ops.paged_ragged_attention.torch_backend import paged_ragged_attention_torch
from kvpress_critical.ops.registry import Backend, OpRegistry
from kvpress_critical.ops.triton_utils import triton_availability, triton_devices

AUTO_ORDER: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch"), "cpu": ("cpp", "torch")}

PAGED_RAGGED_ATTENTION = OpRegistry("paged_ragged_attention", AUTO_ORDER)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # codes the op reads with per-tensor scales


def _check_inputs(
    query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
    tail_len, key_offsets, value_offsets,
) -> None:  # fmt: skip
    if query.dim() != 4:
        raise ValueError(f"query must be (batch, heads, q_len, head_dim), got shape {tuple(query.shape)}")
    bsz, heads, q_len, head_dim = query.shape
    if region_keys.dim() != 3 or region_keys.shape != region_values.shape or region_keys.shape[2] != head_dim:
        raise ValueError(
            f"region keys / values must be (blocks, rows, {head_dim}) views of the same shape, got "
            f"{tuple(region_keys.shape)} and {tuple(region_values.shape)}"
        )
    if key_offsets.dim() != 3 or key_offsets.shape != value_offsets.shape or key_offsets.shape[2] != head_dim:
        raise ValueError(
            f"key / value offsets must be (kv_heads, block_size, {head_dim}), got {tuple(key_offsets.shape)}"
        )
    num_kv_heads = key_offsets.shape[0]
    if heads % num_kv_heads:
        raise ValueError(f"the query's {heads} heads are not a multiple of the cache's {num_kv_heads} KV heads")
    for name, table in (("region_table", region_table), ("tail_table", tail_table)):
        if table.dim() != 2 or table.shape[0] != bsz or table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer (batch, blocks) table, got {tuple(table.shape)}")
    for name, vector, size in (("seg_start", seg_start, bsz * num_kv_heads), ("seg_len", seg_len, bsz * num_kv_heads),
                               ("tail_len", tail_len, bsz)):  # fmt: skip
        if vector.dim() != 1 or vector.numel() != size:
            raise ValueError(f"{name} must have {size} entries, got {tuple(vector.shape)}")
    if tail_keys.dim() != 2 or tail_values.dim() != 2:
        raise ValueError("tail keys / values must be (blocks, elements) views of the cache, one row per block")
    dtypes = {t.dtype for t in (region_keys, region_values, tail_keys, tail_values)}
    if len(dtypes) != 1:
        raise ValueError(f"the region and tail views must share one dtype, got {sorted(map(str, dtypes))}")
    (dtype,) = dtypes
    if not dtype.is_floating_point:
        raise ValueError(
            f"the cache views hold {dtype}: pass float entries, or fp8 codes viewed as one of {FP8_DTYPES} (an fp8 "
            "cache's bytes, e.g. vLLM's uint8 cache, .view(torch.float8_e4m3fn))"
        )
    if tail_len.device.type == "cpu" and bool((tail_len < q_len).any()):
        raise ValueError(f"every row's tail must hold its {q_len} queries' own entries (tail_len >= q_len)")
    devices = {t.device for t in (query, region_keys, region_values, tail_keys, tail_values)}
    if len(devices) != 1:
        raise ValueError(f"the query and the cache are on different devices: {sorted(map(str, devices))}")


def paged_ragged_attention(
    query: torch.Tensor,
    region_keys: torch.Tensor,
    region_values: torch.Tensor,
    region_table: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_table: torch.Tensor,
    tail_len: torch.Tensor,
    key_offsets: torch.Tensor,
    value_offsets: torch.Tensor,
    scale: float,
    backend: str = "auto",
    max_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """
    Attention of ``q`` new tokens over head-wise entries kept in a paged cache (module docstring).

    Parameters
    ----------
    query : torch.Tensor
        ``(B, H, q, d)`` post-RoPE queries.
    region_keys, region_values : torch.Tensor
        ``(blocks, R, d)``: the ``R`` key / value rows every cache block offers to a region (views of the cache;
        ``R`` is ``block_size * H_kv`` when the region fills the blocks' cells).
    region_table : torch.Tensor
        ``(B, M)`` int32 / int64: the region blocks of each row (unused columns are never read).
    seg_start, seg_len : torch.Tensor
        ``(B * H_kv,)`` int64: segment ``s = b * H_kv + h`` is region entries ``seg_start[s] .. + seg_len[s]`` of row
        ``b`` (entry ``e``: row ``e % R`` of block ``region_table[b, e // R]``).
    tail_keys, tail_values : torch.Tensor
        ``(blocks, W)``: each cache block as flat elements (one view for keys, one for values; they may be the same).
    tail_table : torch.Tensor
        ``(B, T)`` int32 / int64: the blocks of each row's tail, from its first position.
    tail_len : torch.Tensor
        ``(B,)`` int64: tail entries of each row; the queries are its last ``q`` (``tail_len >= q``).
    key_offsets, value_offsets : torch.Tensor
        ``(H_kv, block_size, d)`` int64: where dimension ``k`` of the key (value) of slot ``j``, KV head ``h`` sits in
        a block's elements.
    scale : float
        Softmax scale.
    backend : str
        ``"auto"`` or a name from ``PAGED_RAGGED_ATTENTION.available()``.
    max_len : int, optional
        The longest ``seg_len + tail_len`` of a segment, where the caller knows it on the host (a serving engine
        does, once per step): it sizes the ``triton`` backend's grid without reading ``seg_len`` and ``tail_len``
        back from the device, a host synchronisation per call. Checked against them where that costs no
        synchronisation (CPU tensors); ``None``: read from them.
    k_scale, v_scale : float
        Per-tensor scales of an fp8 cache (a key is its code times ``k_scale``); 1.0 for a float cache.
    soft_cap : float
        A logits soft cap (Gemma 2): each score ``s`` becomes ``soft_cap * tanh(s / soft_cap)`` before the softmax;
        0.0 for none.
    sinks : torch.Tensor, optional
        ``(H,)`` attention sinks (gpt-oss): one learned logit per query head, one more term of its softmax's
        denominator that carries no value.
    validate : bool
        Check the inputs' shapes, dtypes, scales and ``max_len`` here (default). ``False`` skips these checks, for a
        caller that passes inputs of the same shapes many times (a serving engine, every layer of a step: it checks
        the first); the ``cpp`` kernel still checks every block a row reads against the cache.

    Returns
    -------
    torch.Tensor
        ``(B, q, H, d)`` in the query's dtype.
    """
    args = (query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
            tail_len, key_offsets, value_offsets)  # fmt: skip
    if validate:
        _check_values(args, k_scale, v_scale, max_len)
        _check_softmax_terms(query, soft_cap, sinks)
    name = PAGED_RAGGED_ATTENTION.resolve(backend, query.device, query, region_keys)
    extras = {}
    if region_keys.dtype in FP8_DTYPES:
        extras.update(k_scale=k_scale, v_scale=v_scale)
    if soft_cap:
        extras["soft_cap"] = float(soft_cap)
    if sinks is not None:
        extras["sinks"] = sinks
    return PAGED_RAGGED_ATTENTION[name].fn(*args, float(scale), max_len, **extras)


def _check_softmax_terms(query: torch.Tensor, soft_cap: float, sinks: torch.Tensor | None) -> None:
    """A soft cap is a finite number >= 0; sinks are one float per query head, on the query's device."""
    if not (soft_cap >= 0.0 and soft_cap < float("inf")):
        raise ValueError(f"soft_cap must be a finite number >= 0 (0: no cap), got {soft_cap}")
    if sinks is not None:
        heads = query.shape[1]
        if sinks.dim() != 1 or sinks.numel() != heads or not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must be ({heads},) floats, one logit per query head, got {sinks.dtype} "
                             f"{tuple(sinks.shape)}")  # fmt: skip
        if sinks.device != query.device:
            raise ValueError(f"sinks are on {sinks.device}, the query on {query.device}")


def _check_values(args, k_scale, v_scale, max_len) -> None:
    """:func:`_check_inputs`, then the scales against the cache's dtype and ``max_len`` against the lengths."""
    _check_inputs(*args)
    region_keys, seg_len, tail_len, key_offsets = args[1], args[5], args[9], args[10]
    if region_keys.dtype not in FP8_DTYPES and (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError(
            f"k_scale / v_scale ({k_scale}, {v_scale}) scale fp8 codes; this cache holds {region_keys.dtype} entries "
            "as they are: pass 1.0"
        )
    if max_len is not None and seg_len.device.type == "cpu" and tail_len.device.type == "cpu":
        longest = (
            int((seg_len.view(-1, key_offsets.shape[0]).max(dim=1).values + tail_len).max()) if seg_len.numel() else 0
        )
        if max_len < longest:
            raise ValueError(f"max_len={max_len} is shorter than the longest segment and tail ({longest})")


def paged_ragged_attention_cpp(*args, **scales):
    """The C++ extension's CPU kernel (``kvpress_critical::paged_ragged_attention``)."""
    from kvpress_critical.ops.paged_ragged_attention.cpp_backend import paged_ragged_attention_cpp as cpp_fn

    return cpp_fn(*args, **scales)


def paged_ragged_attention_triton(*args, **scales):
    """The Triton backend (imports triton on first use: :mod:`.triton_backend`)."""
    from kvpress_critical.ops.paged_ragged_attention.triton_backend import paged_ragged_attention_triton as triton_fn

    return triton_fn(*args, **scales)


PAGED_RAGGED_ATTENTION.register(Backend("torch", paged_ragged_attention_torch, ("cpu", "cuda"), lambda: None))
PAGED_RAGGED_ATTENTION.register(Backend("cpp", paged_ragged_attention_cpp, ("cpu",), cpp_availability))
PAGED_RAGGED_ATTENTION.register(Backend("triton", paged_ragged_attention_triton, triton_devices, triton_availability))

__all__ = [
    "AUTO_ORDER",
    "FP8_DTYPES",
    "PAGED_RAGGED_ATTENTION",
    "packed_segments",
    "paged_ragged_attention",
    "paged_ragged_attention_ref",
    "random_paged_layout",
    "split_offsets",
]
