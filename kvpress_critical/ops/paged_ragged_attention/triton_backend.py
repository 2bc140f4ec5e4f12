"""The ``"triton"`` backend of ``paged_ragged_attention`` (layer 2 of 2, :mod:`.triton_kernel` is the kernel): split of
every segment's "region, then tail" sequence into chunks (flash-decoding), grid, and ragged_attention's log-sum-exp
merge of the partial results. Tile configuration: ragged_attention's (:func:`..ragged_attention.triton_backend.
kernel_constants`), checked with ``ptxas`` for sm_80 / sm_90 (``python -m kvpress_critical.ops.triton_aot --op
paged_ragged_attention``; not yet timed on a GPU)."""

import contextlib

import torch
import triton

from kvpress_critical.ops.paged_ragged_attention.triton_kernel import get_paged_kernel
from kvpress_critical.ops.ragged_attention.triton_backend import kernel_constants, merge_splits

# fp8 codes the kernel reads (CODES) and the factor its conversion leaves out (an e4m3fn code read through fp16's bits
# is its value times 2^-8)
FP8_CODES = {torch.float8_e4m3fn: (1, 256.0), torch.float8_e5m2: (2, 1.0)}


def paged_constants(query_dtype: torch.dtype, cache_dtype: torch.dtype, rows: int, head_dim: int):
    """``(constexprs, num_warps, num_stages)`` of the paged kernel: ragged_attention's tiles for float entries; fp8
    codes take the query dtype's (they are converted to it, exactly, in registers)."""
    codes = FP8_CODES.get(cache_dtype, (0, 1.0))[0]
    entries = query_dtype if codes else cache_dtype
    constants, warps, stages = kernel_constants(query_dtype, entries, None, None, rows, head_dim)
    keep = ("BLOCK_M", "BLOCK_N", "BLOCK_D", "COMPUTE_DTYPE", "INPUT_PRECISION")
    return {**{name: constants[name] for name in keep}, "CODES": codes}, warps, stages


def paged_ragged_attention_triton(
    query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
    tail_len, key_offsets, value_offsets, scale, max_len=None, k_scale=1.0, v_scale=1.0, soft_cap=0.0, sinks=None,
) -> torch.Tensor:  # fmt: skip
    """See :func:`kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention` (fp8 codes are read as bytes and
    converted in registers: :mod:`.triton_kernel`; the soft cap is applied to the scores in the kernel, the sinks in
    the merge of its splits)."""
    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads, block_size = key_offsets.shape[0], key_offsets.shape[1]
    group = heads // num_kv_heads
    segments, rows = bsz * num_kv_heads, group * q_len
    out = torch.zeros(bsz, q_len, heads, head_dim, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    device = query.device
    seg_start, seg_len, tail_len = (x.to(device=device, dtype=torch.int64) for x in (seg_start, seg_len, tail_len))
    key_offsets = key_offsets.to(device=device, dtype=torch.int64).contiguous()
    value_offsets = value_offsets.to(device=device, dtype=torch.int64).contiguous()
    region_table, tail_table = region_table.to(device), tail_table.to(device)
    # the grid's length: the caller's host-side bound, or read back from the device (a synchronisation)
    longest = max_len if max_len is not None else int(seg_len.max()) + int(tail_len.max())
    constants, warps, stages = paged_constants(query.dtype, region_keys.dtype, rows, head_dim)
    factor = FP8_CODES.get(region_keys.dtype, (0, 1.0))[1]
    key_scale, value_factor = float(scale) * factor * k_scale, factor * v_scale
    if constants["CODES"]:  # the codes' bytes (Triton reads fp8 pointers on few architectures)
        region_keys, region_values, tail_keys, tail_values = (
            x.view(torch.uint8) for x in (region_keys, region_values, tail_keys, tail_values)
        )
    block_m, block_n = constants["BLOCK_M"], constants["BLOCK_N"]
    target_programs = 4 * (
        torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    )
    row_blocks = triton.cdiv(rows, block_m)
    n_splits = max(1, min(triton.cdiv(longest, block_n), triton.cdiv(target_programs, segments * row_blocks)))
    chunk = triton.cdiv(triton.cdiv(longest, n_splits), block_n) * block_n
    n_splits = triton.cdiv(longest, chunk)
    rows_pad = row_blocks * block_m
    partial_o = torch.empty(segments, n_splits, rows_pad, head_dim, dtype=torch.float32, device=device)
    partial_ml = torch.empty(segments, n_splits, rows_pad, 2, dtype=torch.float32, device=device)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        get_paged_kernel()[(segments, n_splits, row_blocks)](
            query, region_keys, region_values, region_table, seg_start, seg_len, tail_keys, tail_values, tail_table,
            tail_len, key_offsets, value_offsets, partial_o, partial_ml,
            *query.stride(), region_keys.stride(0), region_keys.stride(1), region_values.stride(0),
            region_values.stride(1), region_table.stride(0), tail_keys.stride(0), tail_values.stride(0),
            tail_table.stride(0), num_kv_heads, group, q_len, head_dim, region_keys.shape[1], block_size,
            key_scale, value_factor, float(soft_cap), chunk, n_splits, rows_pad,
            **constants, SOFT_CAP=bool(soft_cap), num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return merge_splits(partial_o, partial_ml, rows, q_len, group, out, None if sinks is None else sinks.to(device))
