"""Triton kernel of the paged ragged attention (layer 1 of 2; :mod:`.triton_backend` launches it).

Kept undecorated and jitted on first use (:func:`get_paged_kernel`), so the interpreter mode is read when it runs
(``TRITON_INTERPRET=1``), as the other kernels of the package.

fp8 caches (``CODES`` 1: e4m3fn, 2: e5m2) are read as their bytes and converted in registers through fp16's bits, as
the C++ kernel does: an e5m2 code is the upper byte of its value's fp16; an e4m3fn code's sign, exponent and mantissa
moved into fp16's give its value times 2^-8 exactly (normals and subnormals). The launcher folds 2^8 and the
per-tensor scales into ``scale`` (keys) and ``v_factor`` (values, applied to the partial outputs).
"""

import types

import triton
import triton.language as tl

_KERNELS: dict = {}


def _fp8_as_half(codes, CODES: tl.constexpr):
    """fp8 codes (uint8) as fp16 values, exactly: e4m3fn (``CODES`` 1) its value times 2^-8, e5m2 (2) its value;
    float entries (0) as they are."""
    if CODES == 1:  # e4m3fn: sign, exponent and mantissa moved into fp16's
        bits = codes.to(tl.uint16)
        return (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True)
    elif CODES == 2:  # e5m2: the upper byte of the value's fp16
        return (codes.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    else:
        return codes


def _paged_ragged_attention(
    q_ptr,  # (B, H, q, d) queries, strides sq_*
    rk_ptr,  # (blocks, R, d) region keys, strides srk_*
    rv_ptr,  # (blocks, R, d) region values, strides srv_*
    rt_ptr,  # (B, M) region table (int32 / int64), strides srt_*
    ss_ptr,  # (B * H_kv,) int64 segment starts
    sl_ptr,  # (B * H_kv,) int64 segment lengths
    tk_ptr,  # (blocks, W) tail keys: a block's elements, block stride stk
    tv_ptr,  # (blocks, W) tail values, block stride stv
    tt_ptr,  # (B, T) tail table, strides stt_*
    tl_ptr,  # (B,) int64 tail lengths
    ko_ptr,  # (H_kv, block_size, d) int64 key offsets (contiguous)
    vo_ptr,  # (H_kv, block_size, d) int64 value offsets (contiguous)
    o_ptr,  # (S, n_splits, rows_pad, d) float32 partial outputs, times v_factor
    ml_ptr,  # (S, n_splits, rows_pad, 2) float32 partial (max, sum)
    sq_b,
    sq_h,
    sq_i,
    sq_d,
    srk_b,
    srk_r,
    srv_b,
    srv_r,
    srt_b,
    stk,
    stv,
    stt_b,
    num_kv_heads,
    group,
    q_len,
    head_dim,
    rows_per_block,
    block_size,
    scale,
    v_factor,
    soft_cap,  # > 0 with SOFT_CAP: scores capped at soft_cap * tanh(score / soft_cap)
    chunk,
    n_splits,
    rows_pad,
    BLOCK_M: tl.constexpr,  # problem rows (g, i) per program
    BLOCK_N: tl.constexpr,  # entries per step
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two (masked)
    COMPUTE_DTYPE: tl.constexpr,  # operand dtype of the dots (fp32 accumulation)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 operands
    CODES: tl.constexpr,  # 0: float entries, 1: fp8 e4m3fn codes, 2: fp8 e5m2 codes (uint8 pointers)
    SOFT_CAP: tl.constexpr,  # a logits soft cap (Gemma 2)
):
    # program (segment s, split, block of rows): partial softmax attention over entries [split * chunk, ...) of the
    # segment's virtual sequence "region entries, then the row's tail"
    s = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    b = (s // num_kv_heads).to(tl.int64)
    kv = (s % num_kv_heads).to(tl.int64)
    start = tl.load(ss_ptr + s)
    n_ctx = tl.load(sl_ptr + s)
    tail_len = tl.load(tl_ptr + b)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_ctx + tail_len)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = g * q_len + i
    row_mask = rows < group * q_len
    g = rows // q_len
    i = rows % q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_ptrs = q_ptr + b * sq_b + (kv * group + g)[:, None] * sq_h + i[:, None] * sq_i + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(COMPUTE_DTYPE)
    last_visible = tail_len - q_len + i  # the last tail position row (g, i) sees

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)
        valid = idx < hi
        in_ctx = idx < n_ctx
        ctx_mask = (valid & in_ctx)[:, None] & d_mask[None, :]
        tail_mask = (valid & (idx >= n_ctx))[:, None] & d_mask[None, :]
        # region entries: row e % R of block region_table[b, e // R]
        entry = start + tl.where(in_ctx, idx, 0)
        rblock = tl.load(rt_ptr + b * srt_b + entry // rows_per_block, mask=valid & in_ctx, other=0).to(tl.int64)
        rrow = entry % rows_per_block
        # tail entries: the element offsets of slot t % bs, KV head kv, in block tail_table[b, t // bs]
        tpos = tl.where(in_ctx, 0, idx - n_ctx)
        tblock = tl.load(tt_ptr + b * stt_b + tpos // block_size, mask=valid & (idx >= n_ctx), other=0).to(tl.int64)
        slot_offsets = (kv * block_size + tpos % block_size)[:, None] * head_dim + offs_d[None, :]
        k_off = tl.load(ko_ptr + slot_offsets, mask=tail_mask, other=0)
        kc = tl.load(
            rk_ptr + rblock[:, None] * srk_b + rrow[:, None] * srk_r + offs_d[None, :], mask=ctx_mask, other=0.0
        )
        kt = tl.load(tk_ptr + tblock[:, None] * stk + k_off, mask=tail_mask, other=0.0)
        kc, kt = _fp8_as_half(kc, CODES), _fp8_as_half(kt, CODES)
        k = tl.where(in_ctx[:, None], kc.to(COMPUTE_DTYPE), kt.to(COMPUTE_DTYPE))  # (BLOCK_N, BLOCK_D)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION, out_dtype=tl.float32) * scale  # (M, N)
        if SOFT_CAP:  # soft_cap * tanh(s / soft_cap), tanh(x) = 2 / (1 + exp(-2x)) - 1 (exp's overflow gives -1)
            scores = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * scores / soft_cap)) - 1.0)
        visible = valid[None, :] & (in_ctx[None, :] | (tpos[None, :] <= last_visible[:, None]))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        v_off = tl.load(vo_ptr + slot_offsets, mask=tail_mask, other=0)
        vc = tl.load(
            rv_ptr + rblock[:, None] * srv_b + rrow[:, None] * srv_r + offs_d[None, :], mask=ctx_mask, other=0.0
        )
        vt = tl.load(tv_ptr + tblock[:, None] * stv + v_off, mask=tail_mask, other=0.0)
        vc, vt = _fp8_as_half(vc, CODES), _fp8_as_half(vt, CODES)
        v = tl.where(in_ctx[:, None], vc.to(COMPUTE_DTYPE), vt.to(COMPUTE_DTYPE))
        acc = acc * alpha[:, None] + tl.dot(
            p.to(COMPUTE_DTYPE), v, input_precision=INPUT_PRECISION, out_dtype=tl.float32
        )
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new

    base = (s * n_splits + split).to(tl.int64) * rows_pad
    out_rows = base + rows
    acc = acc * v_factor  # the values' scale (1 for float entries)
    tl.store(o_ptr + out_rows[:, None] * head_dim + offs_d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])
    tl.store(ml_ptr + out_rows * 2, m, mask=row_mask)
    tl.store(ml_ptr + out_rows * 2 + 1, denom, mask=row_mask)


def get_paged_kernel():
    """The jitted kernel for the current mode (compiled, or interpreted under ``TRITON_INTERPRET=1``)."""
    from kvpress_critical.ops.triton_utils import interpreter_enabled

    mode = interpreter_enabled()
    if mode not in _KERNELS:
        # the kernel's helper jitted in the same mode, bound in a copy of this module's globals (as ragged_attention's)
        scope = dict(globals(), _fp8_as_half=triton.jit(_fp8_as_half))
        kernel = types.FunctionType(_paged_ragged_attention.__code__, scope, _paged_ragged_attention.__name__)
        _KERNELS[mode] = triton.jit(kernel)
    return _KERNELS[mode]
