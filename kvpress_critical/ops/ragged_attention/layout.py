"""The ragged layout's offsets: built from segment lengths, copied to the device once, and random layouts for tests.

Segment ``s = b * H_kv + h`` (batch row ``b``, KV head ``h``) of a packed ``(N, d)`` tensor is rows
``cu_seqlens[s]:cu_seqlens[s + 1]`` (flash-attn's varlen convention). The compact layer keeps ``cu_seqlens`` on the
host (validating it costs no synchronisation); the CUDA backends need it on the device. Copying it at every call
would add a small synchronous host-to-device copy per layer and per decoding step, so the copy is cached for as
long as the host tensor lives (layouts are rebuilt, never edited).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def offsets_on(cu_seqlens: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``cu_seqlens`` on ``device`` as ``dtype`` (the tensor itself when it already is)."""
    if cu_seqlens.device == device and cu_seqlens.dtype == dtype:
        return cu_seqlens
    copies = _COPIES.setdefault(cu_seqlens, {})
    key = (str(device), dtype)
    if key not in copies:
        copies[key] = cu_seqlens.to(device=device, dtype=dtype)
    return copies[key]


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``(S + 1,)`` int64 offsets on the host from ``S`` segment lengths (any shape, read in row-major order)."""
    lengths = lengths.reshape(-1).to(device="cpu", dtype=torch.int64)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    return cu


def random_layout(
    bsz: int,
    num_kv_heads: int,
    group: int,
    q_len: int,
    head_dim: int,
    lengths,
    tail_len: int,
    capacity: int | None = None,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
):
    """
    Random inputs of :func:`ragged_attention`: ``lengths`` gives the context entries of each of the
    ``bsz * num_kv_heads`` segments. Returns ``(query, keys, values, cu_seqlens, tail_keys, tail_values)``.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
    if lengths.numel() != bsz * num_kv_heads:
        raise ValueError(f"{lengths.numel()} lengths for {bsz * num_kv_heads} segments")
    cu = cu_seqlens_from_lengths(lengths)
    n = int(cu[-1])
    capacity = tail_len if capacity is None else capacity

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    return (
        rand(bsz, num_kv_heads * group, q_len, head_dim),
        rand(n, head_dim),
        rand(n, head_dim),
        cu.to(device),
        rand(bsz, num_kv_heads, capacity, head_dim),
        rand(bsz, num_kv_heads, capacity, head_dim),
    )
