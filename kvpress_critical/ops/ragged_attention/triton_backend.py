"""The ``"triton"`` backend of ``ragged_attention`` (layer 2 of 2, :mod:`.triton_kernel` is the kernel): split of
every segment into chunks (flash-decoding), grid, and the log-sum-exp merge of the partial results."""

import contextlib

import torch
import triton
import triton.language as tl

from kvpress_critical.ops.ragged_attention.codes import CodeSpec, QuantizedEntries
from kvpress_critical.ops.ragged_attention.layout import offsets_on
from kvpress_critical.ops.ragged_attention.triton_kernel import get_attention_kernel
from kvpress_critical.ops.triton_utils import interpreter_enabled

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _blocks(rows: int, head_dim: int, sixteen: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) for ``rows`` query rows per segment.

    Chosen with ``ptxas -v`` on sm_80 and sm_90 (``python -m kvpress_critical.ops.triton_aot --op ragged_attention``,
    no GPU needed; not yet timed on a GPU): with 16-bit dot operands, up to 32 rows, 16 entries per step (32 for
    head_dim <= 64) and 8 warps; with float32 operands (FMA dots), 16 rows and 16 entries. Every case of that table
    then spills at most 36 bytes, where the earlier 64 entries and 4 warps spilled 0.3-1.6 KB with 16-bit operands
    and 15-18 KB with float32 ones.
    """
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if interpreter_enabled():
        return block_m, 32, block_d, 1, 1
    if sixteen:
        return min(block_m, 32), 32 if block_d <= 64 else 16, block_d, 8, 2
    return 16, 16, block_d, 8, 2


def sixteen_bit_dots(query_dtype: torch.dtype, entry_dtype: torch.dtype | None) -> bool:
    """Whether the dots take 16-bit operands: the entries are exact in the query's 16-bit dtype, i.e. float entries
    of the query's dtype, or codes (``entry_dtype`` None: ``|code| <= 127``) under a bfloat16 query (the
    probabilities times the value scales are then rounded to bfloat16, as the probabilities alone are for float
    entries; in float16 small products would fall into its subnormal range: float32 dots)."""
    exact = query_dtype == torch.bfloat16 if entry_dtype is None else entry_dtype == query_dtype
    return query_dtype in (torch.float16, torch.bfloat16) and exact and not interpreter_enabled()


def kernel_constants(
    query_dtype: torch.dtype,
    entry_dtype: torch.dtype | None,
    key_spec: CodeSpec | None,
    value_spec: CodeSpec | None,
    rows: int,
    head_dim: int,
) -> tuple[dict, int, int]:
    """``(constexprs, num_warps, num_stages)`` of the kernel for these operands: float entries of ``entry_dtype``
    (specs None), or codes of ``key_spec`` / ``value_spec`` (``entry_dtype`` None). The launcher and the
    ahead-of-time compilation (:mod:`kvpress_critical.ops.triton_aot`) both take their configuration here."""
    sixteen = sixteen_bit_dots(query_dtype, entry_dtype)
    block_m, block_n, block_d, warps, stages = _blocks(rows, head_dim, sixteen)
    constants = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        COMPUTE_DTYPE=_TL_DTYPES[query_dtype] if sixteen else tl.float32,
        INPUT_PRECISION="tf32" if sixteen else "ieee",
        BITS=key_spec.bits if key_spec is not None else 0,
        K_ZERO=key_spec is not None and not key_spec.symmetric,
        K_CHANNEL=key_spec is not None and key_spec.per_channel,
        V_ZERO=value_spec is not None and not value_spec.symmetric,
        V_CHANNEL=value_spec is not None and value_spec.per_channel,
    )
    return constants, warps, stages


def ragged_attention_triton(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len, scale, max_seqlen=None):
    """See :func:`kvpress_critical.ops.ragged_attention`."""
    bsz, heads, q_len, head_dim = query.shape
    num_kv_heads = tail_keys.shape[1]
    group = heads // num_kv_heads
    segments = bsz * num_kv_heads
    rows = group * q_len
    out = torch.zeros(bsz, q_len, heads, head_dim, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    cu = offsets_on(cu_seqlens, query.device, torch.int64)
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max()) if segments else 0
    longest = max_seqlen + tail_len
    if longest == 0:
        return out
    quantized = isinstance(keys, QuantizedEntries)
    specs = (keys.spec, values.spec) if quantized else (None, None)
    constants, warps, stages = kernel_constants(query.dtype, None if quantized else keys.dtype, *specs, rows, head_dim)
    block_m, block_n = constants["BLOCK_M"], constants["BLOCK_N"]
    # enough programs to fill the GPU even with a few segments (decoding: B * H_kv may be 8)
    target_programs = 4 * (
        torch.cuda.get_device_properties(query.device).multi_processor_count if query.device.type == "cuda" else 1
    )
    row_blocks = triton.cdiv(rows, block_m)
    n_splits = max(1, min(triton.cdiv(longest, block_n), triton.cdiv(target_programs, segments * row_blocks)))
    chunk = triton.cdiv(triton.cdiv(longest, n_splits), block_n) * block_n
    n_splits = triton.cdiv(longest, chunk)
    rows_pad = row_blocks * block_m
    partial_o = torch.empty(segments, n_splits, rows_pad, head_dim, dtype=torch.float32, device=query.device)
    partial_ml = torch.empty(segments, n_splits, rows_pad, 2, dtype=torch.float32, device=query.device)
    # every (split, row < rows) is written by the kernel (a split past its segment's end writes m = -inf, 0);
    # the padding rows past `rows` are never read back
    if quantized:
        k_arg, v_arg = keys.codes, values.codes
        # (absent zeros and groups: any tensor stands in, never read)
        k_extra = [
            keys.scales,
            keys.scales if keys.zeros is None else keys.zeros,
            cu if keys.groups is None else keys.groups,
        ]
        v_extra = [values.scales, values.scales if values.zeros is None else values.zeros]
        v_extra.append(cu if values.groups is None else values.groups)
    else:
        k_arg, v_arg = keys, values  # (the code pointers are not read)
        k_extra, v_extra = [cu] * 3, [cu] * 3
    guard = torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext()
    with guard:
        get_attention_kernel()[(segments, n_splits, row_blocks)](
            query,
            k_arg,
            v_arg,
            *k_extra,
            *v_extra,
            cu,
            tail_keys,
            tail_values,
            partial_o,
            partial_ml,
            *query.stride(),
            *k_arg.stride(),
            *v_arg.stride(),
            *tail_keys.stride(),
            *tail_values.stride(),
            num_kv_heads,
            group,
            q_len,
            head_dim,
            tail_len,
            float(scale),
            chunk,
            n_splits,
            rows_pad,
            **constants,
            num_warps=warps,
            num_stages=stages,
        )
    return merge_splits(partial_o, partial_ml, rows, q_len, group, out)


def merge_splits(
    partial_o, partial_ml, rows: int, q_len: int, group: int, out: torch.Tensor, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Merge the kernel's splits of every (segment, row) by log-sum-exp weights into ``out`` ``(B, q, H, d)``:
    ``partial_o`` ``(S, n_splits, rows_pad, d)``, ``partial_ml`` ``(S, n_splits, rows_pad, 2)`` (max, sum).
    ``sinks`` ``(H,)``: one more logit per query head in the softmax's denominator (a row's output times
    ``sigmoid(lse - sink)``)."""
    bsz, _, heads, head_dim = out.shape
    num_kv_heads = heads // group
    m, denom = partial_ml[:, :, :rows, 0], partial_ml[:, :, :rows, 1]  # (S, n_splits, rows)
    peak = m.amax(1, keepdim=True)
    finite_peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    weight = torch.exp(m - finite_peak)
    weight = torch.where(torch.isinf(m), torch.zeros_like(weight), weight)
    total = (weight * denom).sum(1)  # (S, rows)
    merged = (weight.unsqueeze(-1) * partial_o[:, :, :rows]).sum(1) / total.clamp_min(1e-30).unsqueeze(-1)
    merged = torch.where(total.unsqueeze(-1) > 0, merged, torch.zeros_like(merged))  # (S, G * q, d)
    if sinks is not None:  # row g * q + i of segment b * H_kv + h: query head h * G + g
        sink = sinks.float().view(num_kv_heads, group, 1).expand(-1, -1, q_len).reshape(1, num_kv_heads, rows)
        sink = sink.expand(bsz, -1, -1).reshape(bsz * num_kv_heads, rows)
        lse = finite_peak.squeeze(1) + torch.log(total)  # -inf where nothing is visible: the output stays 0
        merged = merged * torch.sigmoid(lse - sink).unsqueeze(-1)
    merged = merged.view(bsz, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    out.copy_(merged.reshape(bsz, q_len, heads, head_dim))
    return out
