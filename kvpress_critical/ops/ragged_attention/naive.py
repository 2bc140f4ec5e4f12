"""The plain-torch reference of ``ragged_attention`` and the tolerances of its backends against it.

The reference is the specification: float64, one segment at a time, the context entries and the tail concatenated,
written to be obviously correct, not fast. Every backend is tested against it.
"""

import torch


def ragged_attention_ref(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tail_len: int,
    scale: float,
) -> torch.Tensor:
    """
    Reference attention over the compact per-head layout (float64, one segment at a time, entries concatenated).

    Parameters
    ----------
    query : torch.Tensor
        ``(B, H, q, d)`` post-RoPE queries of the ``q`` new tokens.
    keys, values : torch.Tensor or QuantizedEntries
        ``(N, d)`` packed context entries (quantized ones are dequantized first: ``float(code) * scale``);
        segment ``s = b * H_kv + h`` (batch row ``b``, KV head ``h``) is rows ``cu_seqlens[s]:cu_seqlens[s + 1]``.
    cu_seqlens : torch.Tensor
        ``(B * H_kv + 1,)`` segment offsets.
    tail_keys, tail_values : torch.Tensor
        ``(B, H_kv, C, d)``: tokens appended after the context, the first ``tail_len`` valid. The queries are the
        last ``q`` of them: query ``i`` sees tail positions ``j <= tail_len - q + i`` (causal).
    scale : float
        Softmax scale (``1 / sqrt(d)`` for most models).

    Returns
    -------
    torch.Tensor
        ``(B, q, H, d)`` in the query's dtype (the layout transformers' attention functions return). A query that
        sees no entry gets zeros.
    """
    if not isinstance(keys, torch.Tensor):  # QuantizedEntries (.codes): the dequantized entries are the spec
        keys, values = keys.dequantize(), values.dequantize()
    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads = tail_keys.shape[1]
    group = heads // num_kv_heads
    out = torch.zeros(bsz, q_len, heads, head_dim, dtype=torch.float64)
    offsets = [int(x) for x in cu_seqlens.tolist()]
    for b in range(bsz):
        for h in range(num_kv_heads):
            s = b * num_kv_heads + h
            k = torch.cat([keys[offsets[s] : offsets[s + 1]], tail_keys[b, h, :tail_len]]).double().cpu()
            v = torch.cat([values[offsets[s] : offsets[s + 1]], tail_values[b, h, :tail_len]]).double().cpu()
            n_ctx = offsets[s + 1] - offsets[s]
            q = query[b, h * group : (h + 1) * group].double().cpu()  # (G, q, d)
            scores = torch.einsum("gid,nd->gin", q, k) * scale
            position = torch.arange(k.shape[0]) - n_ctx  # tail position of each entry (negative: context)
            visible = position[None, :] <= (tail_len - q_len + torch.arange(q_len))[:, None]  # (q, n)
            scores = scores.masked_fill(~visible, float("-inf"))
            weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible: zeros
            out[b, :, h * group : (h + 1) * group] = torch.einsum("gin,nd->igd", weights, v)
    return out.to(query.dtype)


#: Tolerances ``(rtol, atol)`` of an attention output against the float64 reference, per input dtype: inputs are
#: exact in float32, so the error is float32 accumulation (~1e-6 relative) plus, for 16-bit outputs, the rounding
#: of the result to the output dtype (half an ulp: 2^-9 for bf16, 2^-12 for fp16, relative to the output scale).
ATTENTION_TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2**-8, 2**-8),
    torch.float16: (2**-10, 2**-10),
}
