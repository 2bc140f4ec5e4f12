"""The ``"torch"`` backend of :func:`kvpress_critical.ops.paged_ragged_attention`: plain PyTorch, any device.

One segment (row, KV head) at a time: its region entries and its row's tail are gathered through the block tables
(a copy of one segment, never of the cache), then attended as the ``ragged_attention`` torch backend does (float32
scores, the region and the tail merged by their log-sum-exp). The portable fallback: ``cpp`` (CPU) and ``triton``
(CUDA) read the cache in place.
"""

import torch

from kvpress_critical.ops.paged_ragged_attention.naive import gather_segment, gather_tail
from kvpress_critical.ops.ragged_attention.torch_backend import _part, merge_parts


def paged_ragged_attention_torch(
    query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
    tail_len, key_offsets, value_offsets, scale, max_len=None, k_scale=1.0, v_scale=1.0, soft_cap=0.0, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """See :func:`kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention` (``max_len``: unused, the grid
    of the ``triton`` backend only). fp8 codes are dequantized one segment at a time, in float32; a sink is one more
    part of the merge (its logit, a sum of 1, no output)."""
    quantized = region_keys.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads = key_offsets.shape[0]
    group = heads // num_kv_heads
    out = torch.zeros(bsz, q_len, heads, head_dim, dtype=query.dtype, device=query.device)
    region_table, tail_table = region_table.cpu(), tail_table.cpu()
    seg_start, seg_len, tail_len = seg_start.cpu(), seg_len.cpu(), tail_len.cpu()
    key_offsets, value_offsets = key_offsets.to(query.device), value_offsets.to(query.device)
    for b in range(bsz):
        length = int(tail_len[b])
        visible = (
            torch.arange(length, device=query.device)[None, :]
            <= (length - q_len + torch.arange(q_len, device=query.device))[:, None]
        ).repeat(group, 1)  # (G * q, length): row g * q + i sees tail positions <= length - q + i
        for h in range(num_kv_heads):
            s = b * num_kv_heads + h
            q = query[b, h * group : (h + 1) * group].reshape(group * q_len, head_dim).float() * scale
            rk, rv = gather_segment(region_keys, region_values, region_table, seg_start, seg_len, b, s)
            tk, tv = gather_tail(tail_keys, tail_values, tail_table, length, key_offsets, value_offsets, b, h)
            if quantized:  # (n, d) codes -> float32 entries
                rk, tk = rk.float() * k_scale, tk.float() * k_scale
                rv, tv = rv.float() * v_scale, tv.float() * v_scale
            parts = [_part(q, rk, rv, None, soft_cap)] if rk.shape[0] else []
            if length:
                parts.append(_part(q, tk, tv, visible, soft_cap))
            if sinks is not None:  # row g * q + i: query head h * G + g
                sink = sinks[h * group : (h + 1) * group].float().repeat_interleave(q_len)[:, None]
                parts.append((sink, torch.ones_like(sink), torch.zeros(group * q_len, head_dim, device=query.device)))
            result = merge_parts(parts, group * q_len, head_dim, query.device)
            out[b, :, h * group : (h + 1) * group] = result.view(group, q_len, head_dim).transpose(0, 1).to(out.dtype)
    return out
