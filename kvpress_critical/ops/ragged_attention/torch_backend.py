"""The ``"torch"`` backend of :func:`kvpress_critical.ops.ragged_attention`: plain PyTorch, any device.

One segment (batch row, KV head) at a time: the segment's ``G`` query heads and ``q`` queries form one
``(G * q, d)`` problem against its context entries and against the tail, each scored in float32 without copying
the cache (no ``repeat_kv``, no concatenation); the two softmax parts are merged by their log-sum-exp. A Python
loop over segments: the portable fallback (``cpp`` on CPU and ``flash`` / ``triton`` on CUDA are the fast paths).
Quantized entries are dequantized one segment at a time (a temporary of one segment, never of the layer).

From ``SDPA_MIN_QUERIES`` queries on (a prefill chunk over a compact cache), each segment is one float32
``scaled_dot_product_attention`` call over its entries followed by the tail, with the causal part as a boolean mask:
the fused kernel then beats both the loop above and the cpp kernel (which is written for decoding).
"""

import torch
import torch.nn.functional as F

from kvpress_critical.ops.ragged_attention.codes import QuantizedEntries

SDPA_MIN_QUERIES = 8


def _rows(entries, lo: int, hi: int) -> torch.Tensor:
    """Entries ``lo:hi`` of a segment as a float tensor (quantized entries dequantized, one segment at a time)."""
    part = entries[lo:hi]
    return part.dequantize() if isinstance(part, QuantizedEntries) else part


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, soft_cap: float = 0.0):
    """(max, sum, unnormalised output) of softmax(q k^T) v in float32; q: (R, d), k, v: (n, d); a ``soft_cap`` > 0
    caps each score ``s`` at ``soft_cap * tanh(s / soft_cap)`` first."""
    scores = q @ k.float().T  # (R, n)
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    peak = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # finite even if all masked
    weights = torch.exp(scores - peak)
    return peak, weights.sum(-1, keepdim=True), weights @ v.float()


def ragged_attention_torch(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale, max_seqlen=None):
    """See :func:`kvpress_critical.ops.ragged_attention`."""
    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads = tail_keys.shape[1]
    group = heads // num_kv_heads
    out = torch.empty(bsz, q_len, heads, head_dim, dtype=query.dtype, device=query.device)
    offsets = cu_seqlens.tolist()
    if q_len >= SDPA_MIN_QUERIES and tail_len >= q_len:  # every query sees at least itself
        return _ragged_attention_sdpa(query, keys, values, offsets, tail_keys, tail_values, tail_len, scale, out)
    rows = torch.arange(q_len, device=query.device)
    tail_mask = None
    if tail_len:
        tail_mask = torch.arange(tail_len, device=query.device)[None, :] <= (tail_len - q_len + rows)[:, None]
        tail_mask = tail_mask.repeat(group, 1)  # row r = g * q + i
    for b in range(bsz):
        for h in range(num_kv_heads):
            s = b * num_kv_heads + h
            q = query[b, h * group : (h + 1) * group].reshape(group * q_len, head_dim).float() * scale
            parts = []
            if offsets[s + 1] > offsets[s]:
                lo, hi = offsets[s], offsets[s + 1]
                parts.append(_part(q, _rows(keys, lo, hi), _rows(values, lo, hi), None))
            if tail_len:
                parts.append(_part(q, tail_keys[b, h, :tail_len], tail_values[b, h, :tail_len], tail_mask))
            result = merge_parts(parts, group * q_len, head_dim, query.device)
            out[b, :, h * group : (h + 1) * group] = result.view(group, q_len, head_dim).transpose(0, 1).to(out.dtype)
    return out


def merge_parts(parts: list, rows: int, head_dim: int, device) -> torch.Tensor:
    """``(rows, d)`` attention output from the ``(max, sum, unnormalised output)`` of its parts (:func:`_part`),
    merged by their log-sum-exp; rows that see no entry get zeros."""
    if not parts:
        return torch.zeros(rows, head_dim, device=device)
    peak = torch.stack([p[0] for p in parts]).amax(0)
    weights = [torch.exp(p[0] - peak) for p in parts]
    total = sum(w * p[1] for w, p in zip(weights, parts))
    result = sum(w * p[2] for w, p in zip(weights, parts)) / total.clamp_min(1e-30)
    return torch.where(total > 0, result, torch.zeros_like(result))


def _ragged_attention_sdpa(query, keys, values, offsets, tail_keys, tail_values, tail_len, scale, out):
    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads = tail_keys.shape[1]
    group = heads // num_kv_heads
    # query i sees tail positions j <= tail_len - q_len + i, and every context entry of its segment
    causal = torch.ones(q_len, tail_len, dtype=torch.bool, device=query.device).tril(tail_len - q_len)
    for b in range(bsz):
        for h in range(num_kv_heads):
            s = b * num_kv_heads + h
            n = offsets[s + 1] - offsets[s]
            lo, hi = offsets[s], offsets[s + 1]
            k = torch.cat([_rows(keys, lo, hi).float(), tail_keys[b, h, :tail_len].float()])  # (n + t, d)
            v = torch.cat([_rows(values, lo, hi).float(), tail_values[b, h, :tail_len].float()])
            mask = torch.cat([causal.new_ones(q_len, n), causal], dim=1)  # (q, n + t)
            q = query[b : b + 1, h * group : (h + 1) * group].float()  # (1, G, q, d)
            k, v = k[None, None].expand(1, group, -1, -1), v[None, None].expand(1, group, -1, -1)
            result = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (1, G, q, d)
            out[b, :, h * group : (h + 1) * group] = result[0].transpose(0, 1).to(out.dtype)
    return out
