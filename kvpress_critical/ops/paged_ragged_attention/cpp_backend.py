"""The ``"cpp"`` backend of ``paged_ragged_attention``: the C++ extension's CPU kernel (``csrc/ragged_attention.cpp``).

``kvpress_critical::paged_ragged_attention`` runs ragged_attention's work items and micro-kernels over a paged cache:
region entries read in place run by run through the region table, each row's tail gathered per KV head through its
block table and element offsets a block at a time (runs of consecutive offsets copied whole, dimension-major blocks
transposed), merged by log-sum-exp (the module docstring of :mod:`..paged_ragged_attention`).
"""

import torch

from kvpress_critical.ops.extension import extension_state


def paged_ragged_attention_cpp(
    query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
    tail_len, key_offsets, value_offsets, scale, max_len=None, k_scale=1.0, v_scale=1.0, soft_cap=0.0, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """See :func:`kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention` (``max_len``: unused, the grid
    of the ``triton`` backend only). fp8 codes are read in place by the micro-kernels, converted in registers (their
    bits moved into fp16's, then ``vcvtph2ps``), the scales applied to the softmax scale and to the output. The soft
    cap is applied to each block's scores in the micro-kernels, the sinks in the merge of a segment's items."""
    reason = extension_state().reason
    if reason is not None:
        raise RuntimeError(reason)
    return torch.ops.kvpress_critical.paged_ragged_attention(
        query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
        tail_len, key_offsets, value_offsets, scale, k_scale, v_scale, soft_cap, sinks,
    )  # fmt: skip
