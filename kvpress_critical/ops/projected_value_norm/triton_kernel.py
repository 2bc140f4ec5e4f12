"""Triton kernel of the projected-value norm (layer 1 of 2: the kernel; :mod:`.triton_backend` launches it).

``_head_projected_norm`` is kept undecorated: :func:`get_kernel` applies ``triton.jit`` on first use, once per
mode, because Triton reads ``TRITON_INTERPRET`` when a function is decorated. Its own standard library
(``tl.sum``...) is decorated when triton is imported, so the interpreter only works when ``TRITON_INTERPRET=1``
is set before triton is imported (:func:`kvpress_critical.ops.triton_utils.interpreter_mismatch` detects the other
case).
"""

import triton
import triton.language as tl

from kvpress_critical.ops.triton_utils import interpreter_enabled

_KERNELS: dict = {}


def _head_projected_norm(
    values_ptr,  # (B, H_kv, T, d), any float dtype, strides sv_*
    proj_ptr,  # (H, N, d) per-head projections, strides sp_*: W_O^h^T for L1, Gram factors R_h for L2
    out_ptr,  # (B, H_kv, T) float32, strides so_*
    num_kv_heads,
    tokens,
    head_dim,
    features,
    group,
    sv_b,
    sv_h,
    sv_t,
    sv_d,
    sp_h,
    sp_n,
    sp_d,
    so_b,
    so_h,
    so_t,
    L1: tl.constexpr,  # True: sum |P|; False: sqrt(sum P^2) per head
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_N: tl.constexpr,  # output features per dot
    BLOCK_D: tl.constexpr,  # head_dim rounded up to a power of two (masked)
    BLOCK_K: tl.constexpr,  # head_dim slice per dot: BLOCK_D keeps the value tile in registers (16-bit operands);
    # smaller slices re-read it from L1 per feature tile (fp32 operands, whose FMA dot would spill otherwise)
    COMPUTE_DTYPE: tl.constexpr,  # operand dtype of tl.dot (accumulation is always float32)
    INPUT_PRECISION: tl.constexpr,  # "ieee" / "tf32" for float32 operands
):
    # One program per (token tile, batch row * KV head): out[b, kv, t] = mean_g || V[b, kv, t] @ P_{kv*G+g}^T ||
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kv = (pid_bh % num_kv_heads).to(tl.int64)
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    offs_d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    t_mask = offs_t < tokens
    d_mask = offs_d < head_dim

    # value tile (BLOCK_T, BLOCK_D): loaded once, reused by every query head of the group and every feature tile
    v_base = values_ptr + b * sv_b + kv * sv_h + offs_t[:, None] * sv_t
    if BLOCK_K == BLOCK_D:
        v = tl.load(v_base + offs_d[None, :] * sv_d, mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        v = v.to(COMPUTE_DTYPE)

    group_acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for g in range(0, group):
        h = kv * group + g  # query head g of this KV head's group
        head_acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for n0 in range(0, features, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
            n_mask = offs_n < features
            w_base = proj_ptr + h * sp_h + offs_n[None, :] * sp_n
            if BLOCK_K == BLOCK_D:
                # projection tile seen as (BLOCK_D, BLOCK_N): element (k, n) = proj[h, n, k]
                w = tl.load(w_base + offs_d[:, None] * sp_d, mask=d_mask[:, None] & n_mask[None, :], other=0.0)
                p = tl.dot(v, w.to(COMPUTE_DTYPE), input_precision=INPUT_PRECISION, out_dtype=tl.float32)
            else:
                p = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, BLOCK_D, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
                    k_mask = offs_k < head_dim
                    v_k = tl.load(v_base + offs_k[None, :] * sv_d, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
                    w_k = tl.load(w_base + offs_k[:, None] * sp_d, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                    p = tl.dot(
                        v_k.to(COMPUTE_DTYPE), w_k.to(COMPUTE_DTYPE), p, input_precision=INPUT_PRECISION
                    )  # (BLOCK_T, BLOCK_N), fp32
            if L1:
                head_acc += tl.sum(tl.abs(p), axis=1)
            else:
                head_acc += tl.sum(p * p, axis=1)
        if L1:
            group_acc += head_acc
        else:
            group_acc += tl.sqrt(head_acc)

    o_ptrs = out_ptr + b * so_b + kv * so_h + offs_t * so_t
    tl.store(o_ptrs, group_acc / group, mask=t_mask)


def get_kernel():
    """The jitted kernel for the current mode (compiled, or interpreted under ``TRITON_INTERPRET=1``)."""
    mode = interpreter_enabled()
    if mode not in _KERNELS:
        _KERNELS[mode] = triton.jit(_head_projected_norm)
    return _KERNELS[mode]
