"""Triton kernel of the ragged attention over the compact KV layout (layer 1 of 2; :mod:`.triton_backend` launches it).

Like the projected norm's kernel, the function is kept undecorated and jitted on first use
(:func:`get_attention_kernel`), so the interpreter mode is read when it runs (``TRITON_INTERPRET=1``).
"""

import triton
import triton.language as tl

_KERNELS: dict = {}


def _ragged_attention(
    q_ptr,  # (B, H, q, d) queries, strides sq_*
    k_ptr,  # (N, d) packed context keys, strides sk_*
    v_ptr,  # (N, d) packed context values, strides sv_*
    cu_ptr,  # (S + 1,) int64 segment offsets, S = B * H_kv
    tk_ptr,  # (B, H_kv, C, d) tail keys, strides st_*
    tv_ptr,  # (B, H_kv, C, d) tail values, strides su_*
    o_ptr,  # (S, n_splits, rows_pad, d) float32 partial outputs
    ml_ptr,  # (S, n_splits, rows_pad, 2) float32 partial (max, sum)
    sq_b,
    sq_h,
    sq_i,
    sq_d,
    sk_n,
    sk_d,
    sv_n,
    sv_d,
    st_b,
    st_h,
    st_t,
    st_d,
    su_b,
    su_h,
    su_t,
    su_d,
    num_kv_heads,
    group,
    q_len,
    head_dim,
    tail_len,
    scale,
    chunk,
    n_splits,
    rows_pad,
    BLOCK_M: tl.constexpr,  # problem rows (g, i) per program
    BLOCK_N: tl.constexpr,  # entries per step
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two (masked)
    COMPUTE_DTYPE: tl.constexpr,  # operand dtype of the dots (fp32 accumulation)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 operands (Triton's default would be tf32)
):
    # program (segment s, split of its entries, block of rows): partial softmax attention over entries
    # [split * chunk, (split + 1) * chunk) of the segment's virtual sequence "context entries, then tail"
    s = tl.program_id(0)
    split = tl.program_id(1)
    row_block = tl.program_id(2)
    b = (s // num_kv_heads).to(tl.int64)
    kv = (s % num_kv_heads).to(tl.int64)
    start = tl.load(cu_ptr + s)
    n_ctx = tl.load(cu_ptr + s + 1) - start
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_ctx + tail_len)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = g * q_len + i
    row_mask = rows < group * q_len
    g = rows // q_len
    i = rows % q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_ptrs = q_ptr + b * sq_b + (kv * group + g)[:, None] * sq_h + i[:, None] * sq_i + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(COMPUTE_DTYPE)  # the scale is applied to the fp32 scores (no extra rounding of q)
    last_visible = tail_len - q_len + i  # the last tail position row (g, i) sees

    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)
        valid = idx < hi
        in_ctx = idx < n_ctx
        tpos = idx - n_ctx
        ctx_mask = (valid & in_ctx)[:, None] & d_mask[None, :]
        tail_mask = (valid & (idx >= n_ctx))[:, None] & d_mask[None, :]
        kc = tl.load(k_ptr + (start + idx)[:, None] * sk_n + offs_d[None, :] * sk_d, mask=ctx_mask, other=0.0)
        kt = tl.load(
            tk_ptr + b * st_b + kv * st_h + tpos[:, None] * st_t + offs_d[None, :] * st_d, mask=tail_mask, other=0.0
        )
        k = tl.where(in_ctx[:, None], kc.to(COMPUTE_DTYPE), kt.to(COMPUTE_DTYPE))  # (BLOCK_N, BLOCK_D)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION, out_dtype=tl.float32) * scale  # (M, N)
        visible = valid[None, :] & (in_ctx[None, :] | (tpos[None, :] <= last_visible[:, None]))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        vc = tl.load(v_ptr + (start + idx)[:, None] * sv_n + offs_d[None, :] * sv_d, mask=ctx_mask, other=0.0)
        vt = tl.load(
            tv_ptr + b * su_b + kv * su_h + tpos[:, None] * su_t + offs_d[None, :] * su_d, mask=tail_mask, other=0.0
        )
        v = tl.where(in_ctx[:, None], vc.to(COMPUTE_DTYPE), vt.to(COMPUTE_DTYPE))
        acc = acc * alpha[:, None] + tl.dot(
            p.to(COMPUTE_DTYPE), v, input_precision=INPUT_PRECISION, out_dtype=tl.float32
        )
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new

    base = (s * n_splits + split).to(tl.int64) * rows_pad
    out_rows = base + rows
    tl.store(o_ptr + out_rows[:, None] * head_dim + offs_d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])
    tl.store(ml_ptr + out_rows * 2, m, mask=row_mask)
    tl.store(ml_ptr + out_rows * 2 + 1, denom, mask=row_mask)


def get_attention_kernel():
    """The jitted kernel for the current mode (compiled, or interpreted under ``TRITON_INTERPRET=1``)."""
    from kvpress_critical.ops.triton_utils import interpreter_enabled

    mode = interpreter_enabled()
    if mode not in _KERNELS:
        _KERNELS[mode] = triton.jit(_ragged_attention)
    return _KERNELS[mode]
