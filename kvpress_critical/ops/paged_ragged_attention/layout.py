"""The paged ragged layout: how a head-wise compressed request's entries sit in a paged KV cache, and random layouts.

A row's *region* is a list of whole cache blocks (``region_table[b]``) that hold the entries its KV heads kept,
packed head after head: each block offers ``R = block_size * H_kv`` key rows and ``R`` value rows of ``d`` elements
(the block's cells, reinterpreted), and region entry ``e`` of the row is row ``e % R`` of block
``region_table[b, e // R]``; segment ``(b, h)`` is entries ``seg_start[s] .. seg_start[s] + seg_len[s] - 1``
(``s = b * H_kv + h``). The row's *tail*, the tokens from the region's end on, stays in the serving engine's own
format, read element by element through ``key_offsets`` / ``value_offsets`` (``(H_kv, block_size, d)``: where the
engine stores dimension ``k`` of the key of slot ``j``, KV head ``h``, inside a block) and its own block table.
"""

from __future__ import annotations

import torch


def packed_segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seg_start, seg_len)``, ``(B * H_kv,)`` int64, of per-(row, head) ``counts`` ``(B, H_kv)`` packed head after
    head from the start of each row's region."""
    counts = counts.to(torch.int64)
    starts = torch.cumsum(counts, dim=1) - counts
    return starts.reshape(-1), counts.reshape(-1)


def split_offsets(num_kv_heads: int, block_size: int, head_dim: int) -> torch.Tensor:
    """Offsets of ``[block, slot, KV head, dim]`` blocks (flash-attn's cache layout, keys and values apart)."""
    heads = torch.arange(num_kv_heads)[:, None, None]
    slots = torch.arange(block_size)[None, :, None]
    dims = torch.arange(head_dim)[None, None, :]
    return slots * num_kv_heads * head_dim + heads * head_dim + dims


def random_paged_layout(
    bsz: int,
    num_kv_heads: int,
    group: int,
    q_len: int,
    head_dim: int,
    block_size: int,
    seg_lens,
    tail_lens,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    cache_dtype: torch.dtype | None = None,
) -> dict:
    """
    Random inputs of :func:`~kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention`: ``seg_lens``
    ``(B, H_kv)`` region entries per head, ``tail_lens`` ``(B,)`` tail entries per row (at least ``q_len``).

    The cache is one tensor of ``[blocks, H_kv, block_size, 2 * d]`` blocks (vLLM's CPU layout) whose tail keys are
    stored dimension-major inside a block (as the CPU backend's vector kernels do) and values slot-major: the offsets
    are not the trivial ones. Blocks are handed out in a shuffled order, with ``spare_blocks`` never used.
    ``cache_dtype`` (an fp8 dtype, :data:`~kvpress_critical.ops.paged_ragged_attention.FP8_DTYPES`) stores the cache
    as fp8 codes of the entries over per-tensor scales, returned as ``k_scale`` and ``v_scale``; the queries stay in
    ``dtype``.
    """
    gen = torch.Generator().manual_seed(seed)
    seg_lens = torch.as_tensor(seg_lens, dtype=torch.int64).reshape(bsz, num_kv_heads)
    tail_lens = torch.as_tensor(tail_lens, dtype=torch.int64).reshape(bsz)
    if bool((tail_lens < q_len).any()):
        raise ValueError("every tail must hold the q queries' own entries")
    rows = block_size * num_kv_heads
    region_blocks = [max(1, -(-int(seg_lens[b].sum()) // rows)) for b in range(bsz)]
    tail_blocks = [max(1, -(-int(tail_lens[b]) // block_size)) for b in range(bsz)]
    num_blocks = sum(region_blocks) + sum(tail_blocks) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_dim, generator=gen)
    scales = {}
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scales = {"k_scale": 0.75, "v_scale": 1.5}  # a key is its code times k_scale, a value its code times v_scale
        cache = cache * 3  # codes of a few units (e4m3's subnormals, below 2^-6, among them)
    cache = cache.to(cache_dtype or dtype)
    region_table = torch.full((bsz, max(region_blocks)), -1, dtype=torch.int32)
    tail_table = torch.full((bsz, max(tail_blocks)), -1, dtype=torch.int32)
    used = 0
    for b in range(bsz):
        region_table[b, : region_blocks[b]] = order[used : used + region_blocks[b]].to(torch.int32)
        used += region_blocks[b]
        tail_table[b, : tail_blocks[b]] = order[used : used + tail_blocks[b]].to(torch.int32)
        used += tail_blocks[b]
    seg_start, seg_len = packed_segments(seg_lens)
    heads = torch.arange(num_kv_heads)[:, None, None] * block_size * 2 * head_dim
    slots = torch.arange(block_size)[None, :, None]
    dims = torch.arange(head_dim)[None, None, :]
    key_offsets = heads + dims * block_size + slots  # dimension-major keys
    value_offsets = heads + block_size * head_dim + slots * head_dim + dims
    flat = cache.view(num_blocks, -1)
    halves = cache.view(num_blocks, 2, rows, head_dim)  # the region's rows: keys, then values, of each block
    query = torch.randn(bsz, num_kv_heads * group, q_len, head_dim, generator=gen).to(dtype)
    return {
        "query": query.to(device),
        "region_keys": halves[:, 0].to(device),
        "region_values": halves[:, 1].to(device),
        "region_table": region_table.to(device),
        "seg_start": seg_start.to(device),
        "seg_len": seg_len.to(device),
        "tail_keys": flat.to(device),
        "tail_values": flat.to(device),
        "tail_table": tail_table.to(device),
        "tail_len": tail_lens.to(device),
        "key_offsets": key_offsets.to(device),
        "value_offsets": value_offsets.to(device),
        "scale": head_dim**-0.5,
        **scales,
    }
