"""Triton kernel of the ragged attention over the compact KV layout (layer 1 of 2; :mod:`.triton_backend` launches it).

Like the projected norm's kernel, the function is kept undecorated and jitted on first use
(:func:`get_attention_kernel`), so the interpreter mode is read when it runs (``TRITON_INTERPRET=1``).
"""

import types

import triton
import triton.language as tl

_KERNELS: dict = {}


def _context_entries(
    ptr,  # (N, d) float entries (strides s_n, s_d) or their codes (rows s_n bytes apart, contiguous)
    s_ptr,  # float32 scales of the codes: (N,) per entry, or (G, d) per channel (CHANNEL)
    z_ptr,  # float32 zeros (ZERO), the scales' shape
    g_ptr,  # (N,) int32 group of every entry (CHANNEL)
    s_n,
    s_d,
    entry,  # (BLOCK_N,) int64 entries of the block
    entry_mask,  # (BLOCK_N,) the entries that are context entries of the program's range
    mask,  # (BLOCK_N, BLOCK_D) entry_mask and the head_dim mask
    offs_d,  # (BLOCK_D,)
    head_dim,
    BLOCK_N: tl.constexpr,
    BITS: tl.constexpr,  # 0: float entries; 8 / 4: codes
    ZERO: tl.constexpr,  # asymmetric codes
    CHANNEL: tl.constexpr,  # scales (and zeros) per channel of a group (KIVI)
):
    """One block of context keys or values, and the scale of each entry still to be applied to it.

    Float entries are returned as they are (scale 1); symmetric per-entry codes as int32 codes (exact as dot
    operands in 16 bits) with their scales, which the caller applies to the scores (keys) or folds into the
    probabilities (values); per-channel and asymmetric codes dequantized in float32 (scale 1). Masked elements are 0.
    """
    if BITS == 0:
        x = tl.load(ptr + entry[:, None] * s_n + offs_d[None, :] * s_d, mask=mask, other=0.0)
        scale = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
    else:
        if BITS == 8:
            x = tl.load(ptr + entry[:, None] * s_n + offs_d[None, :], mask=mask, other=0).to(tl.int32)
        else:  # two codes a byte: element 2i in the low nibble, 2i + 1 in the high one
            byte = tl.load(ptr + entry[:, None] * s_n + (offs_d // 2)[None, :], mask=mask, other=0)
            x = (byte.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 15
            if not ZERO:  # symmetric 4-bit codes are stored offset by 8
                x = tl.where(mask, x - 8, 0)
        if ZERO or CHANNEL:  # dequantized element by element: float32 code * scale (+ zero)
            if CHANNEL:  # one scale (and zero) per channel of the entry's group
                group = tl.load(g_ptr + entry, mask=entry_mask, other=0).to(tl.int64)
                offsets = group[:, None] * head_dim + offs_d[None, :]
                x = x.to(tl.float32) * tl.load(s_ptr + offsets, mask=mask, other=0.0)
                if ZERO:
                    x += tl.load(z_ptr + offsets, mask=mask, other=0.0)
            else:
                x = x.to(tl.float32) * tl.load(s_ptr + entry, mask=entry_mask, other=0.0)[:, None]
                if ZERO:
                    x += tl.load(z_ptr + entry, mask=entry_mask, other=0.0)[:, None]
            x = tl.where(mask, x, 0.0)
            scale = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
        else:  # the codes themselves are the operand; their scales are applied by the caller
            scale = tl.load(s_ptr + entry, mask=entry_mask, other=1.0)
    return x, scale


def _ragged_attention(
    q_ptr,  # (B, H, q, d) queries, strides sq_*
    k_ptr,  # (N, d) packed context keys, strides sk_* (codes: (N, d) int8 or (N, ceil(d / 2)) uint8)
    v_ptr,  # (N, d) packed context values, strides sv_*
    ks_ptr,  # float32 scales of the key codes (BITS > 0): (N,) per entry, or (G, d) per channel (K_CHANNEL)
    kz_ptr,  # float32 zeros of the key codes, the scales' shape (K_ZERO: asymmetric codes)
    kg_ptr,  # (N,) int32 group of every entry (K_CHANNEL)
    vs_ptr,  # the same for the value codes
    vz_ptr,
    vg_ptr,
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
    BITS: tl.constexpr,  # 0: float entries; 8 / 4: 8-bit / 4-bit codes (codes.py)
    K_ZERO: tl.constexpr,  # key codes asymmetric (unsigned, with zeros)
    K_CHANNEL: tl.constexpr,  # key scales per channel of a group (KIVI)
    V_ZERO: tl.constexpr,
    V_CHANNEL: tl.constexpr,
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
        kt = tl.load(
            tk_ptr + b * st_b + kv * st_h + tpos[:, None] * st_t + offs_d[None, :] * st_d, mask=tail_mask, other=0.0
        )
        entry = start + idx  # the block's context entries (index into the packed rows, codes, scales, groups)
        kc, k_scale = _context_entries(
            k_ptr, ks_ptr, kz_ptr, kg_ptr, sk_n, sk_d, entry, valid & in_ctx, ctx_mask, offs_d, head_dim,
            BLOCK_N, BITS, K_ZERO, K_CHANNEL,
        )  # fmt: skip
        k = tl.where(in_ctx[:, None], kc.to(COMPUTE_DTYPE), kt.to(COMPUTE_DTYPE))  # (BLOCK_N, BLOCK_D)
        scores = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION, out_dtype=tl.float32)  # (M, N)
        scores = scores * (k_scale * scale)[None, :]  # the key codes' scales (1: float or dequantized entries)
        visible = valid[None, :] & (in_ctx[None, :] | (tpos[None, :] <= last_visible[:, None]))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        vt = tl.load(
            tv_ptr + b * su_b + kv * su_h + tpos[:, None] * su_t + offs_d[None, :] * su_d, mask=tail_mask, other=0.0
        )
        vc, v_scale = _context_entries(
            v_ptr, vs_ptr, vz_ptr, vg_ptr, sv_n, sv_d, entry, valid & in_ctx, ctx_mask, offs_d, head_dim,
            BLOCK_N, BITS, V_ZERO, V_CHANNEL,
        )  # fmt: skip
        pv = p * v_scale[None, :]  # the value codes' scales folded into the probabilities (1: float entries)
        v = tl.where(in_ctx[:, None], vc.to(COMPUTE_DTYPE), vt.to(COMPUTE_DTYPE))
        acc = acc * alpha[:, None] + tl.dot(
            pv.to(COMPUTE_DTYPE), v, input_precision=INPUT_PRECISION, out_dtype=tl.float32
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
        # the kernel's helper jitted in the same mode, bound in a copy of this module's globals
        scope = dict(globals(), _context_entries=triton.jit(_context_entries))
        kernel = types.FunctionType(_ragged_attention.__code__, scope, _ragged_attention.__name__)
        _KERNELS[mode] = triton.jit(kernel)
    return _KERNELS[mode]
