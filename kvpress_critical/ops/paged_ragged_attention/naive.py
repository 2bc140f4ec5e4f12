"""The plain-torch reference of ``paged_ragged_attention``: float64, one (row, KV head) segment at a time.

It reads every entry through the same addressing the op documents (:mod:`kvpress_critical.ops.paged_ragged_attention`):
region entry ``e`` of row ``b`` at region block ``region_table[b, e // R]``, row ``e % R``; tail position ``t`` at
block ``tail_table[b, t // bs]``, the elements ``key_offsets[h, t % bs]`` of that block of ``tail_keys`` (values:
``value_offsets`` in ``tail_values``). Written to be obviously
correct, not fast: every backend is tested against it.
"""

import torch


def gather_segment(region_keys, region_values, region_table, seg_start, seg_len, b: int, s: int):
    """``(n, d)`` keys and values of segment ``s`` (row ``b``) of the region, in its order."""
    rows = region_keys.shape[1]
    entries = torch.arange(int(seg_start[s]), int(seg_start[s]) + int(seg_len[s]))
    blocks = region_table[b].long()[entries // rows]
    return region_keys[blocks, entries % rows], region_values[blocks, entries % rows]


def gather_tail(tail_keys, tail_values, tail_table, length: int, key_offsets, value_offsets, b: int, h: int):
    """``(length, d)`` keys and values of row ``b``'s tail for KV head ``h``."""
    block_size = key_offsets.shape[1]
    positions = torch.arange(length)
    blocks = tail_table[b].long()[positions // block_size][:, None]
    slots = positions % block_size
    return tail_keys[blocks, key_offsets[h][slots].long()], tail_values[blocks, value_offsets[h][slots].long()]


def paged_ragged_attention_ref(
    query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
    tail_len, key_offsets, value_offsets, scale, max_len=None, k_scale=1.0, v_scale=1.0, soft_cap=0.0, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """
    Reference of :func:`kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention` (same arguments; an
    entry is its stored number times ``k_scale`` or ``v_scale``, fp8 codes included). A ``soft_cap`` > 0 replaces each
    score ``s`` by ``soft_cap * tanh(s / soft_cap)`` before the softmax; ``sinks[head]`` is one more logit in that
    head's softmax, with no value (its weight is dropped).

    Returns ``(B, q, H, d)`` in the query's dtype; a query that sees no entry gets zeros.
    """
    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads = key_offsets.shape[0]
    group = heads // num_kv_heads
    out = torch.zeros(bsz, q_len, heads, head_dim, dtype=torch.float64)
    for b in range(bsz):
        length = int(tail_len[b])
        for h in range(num_kv_heads):
            s = b * num_kv_heads + h
            rk, rv = gather_segment(region_keys, region_values, region_table, seg_start, seg_len, b, s)
            tk, tv = gather_tail(tail_keys, tail_values, tail_table, length, key_offsets, value_offsets, b, h)
            k = torch.cat([rk, tk]).cpu().double() * k_scale
            v = torch.cat([rv, tv]).cpu().double() * v_scale
            q = query[b, h * group : (h + 1) * group].double().cpu()  # (G, q, d)
            scores = torch.einsum("gid,nd->gin", q, k) * scale
            if soft_cap:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            position = torch.arange(k.shape[0]) - rk.shape[0]  # tail position of each entry (negative: region)
            visible = position[None, :] <= (length - q_len + torch.arange(q_len))[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:  # (G, q, n + 1): the sink last, then dropped
                sink = sinks[h * group : (h + 1) * group].double().cpu()[:, None, None].expand(group, q_len, 1)
                weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
            else:
                weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
            out[b, :, h * group : (h + 1) * group] = torch.einsum("gin,nd->igd", weights, v)
    return out.to(query.dtype)
