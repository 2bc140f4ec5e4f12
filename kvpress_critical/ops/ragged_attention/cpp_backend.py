"""The ``"cpp"`` backend of ``ragged_attention``: the C++ extension's CPU kernel (``csrc/ragged_attention.cpp``).

``kvpress_critical::ragged_attention(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale)``
computes, per (segment, query row), the attention over the segment's packed entries and the causal part of the tail
with an online float32 softmax, parallel over segments and chunks of long segments. Written for decoding (a few
queries): from ``CPU_MULTI_QUERY`` queries on, ``auto`` prefers the torch backend's per-segment ``sdpa``.
Quantized entries go to ``kvpress_critical::ragged_attention_quantized``, which dequantizes each block of entries in
registers as it attends (no float copy of the layer).
"""

import torch

from kvpress_critical.ops.extension import extension_state
from kvpress_critical.ops.ragged_attention.codes import QuantizedEntries


def ragged_attention_cpp(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale, max_seqlen=None):
    """The C++ extension's CPU kernel (``kvpress_critical::ragged_attention``, or ``ragged_attention_quantized`` when
    the entries are :class:`~kvpress_critical.ops.ragged_attention.codes.QuantizedEntries`: read as codes)."""
    reason = extension_state().reason
    if reason is not None:
        raise RuntimeError(reason)
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if isinstance(keys, QuantizedEntries):
        return torch.ops.kvpress_critical.ragged_attention_quantized(
            query,
            keys.codes,
            keys.scales,
            keys.zeros,
            keys.groups,
            values.codes,
            values.scales,
            values.zeros,
            values.groups,
            keys.bits,
            cu,
            tail_keys,
            tail_values,
            tail_len,
            scale,
        )
    return torch.ops.kvpress_critical.ragged_attention(query, keys, values, cu, tail_keys, tail_values, tail_len, scale)
