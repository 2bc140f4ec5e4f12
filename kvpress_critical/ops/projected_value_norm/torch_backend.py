"""The ``"torch"`` backend of :func:`kvpress_critical.projected_value_norm`: plain PyTorch, any device.

L1: for each query head ``h`` and each tile of tokens, ``|V_tile @ W_O^h|`` is reduced over ``D`` in
float32, so no more than one ``(B, T_tile, D)`` tile of ``V W_O`` ever exists and ``V`` is never copied
with ``repeat_kv`` (query head ``h`` reads KV head ``h // group`` directly).

L2: ``||v W_O^h||_2^2 = v G_h v^T`` with the Gram matrix ``G_h = W_O^h (W_O^h)^T`` (docs/kernels.md).
We cache a factor ``R_h = diag(sqrt(lambda)) Q^T`` of the float64 eigendecomposition ``G_h = Q diag(lambda) Q^T``
(so ``R_h^T R_h = G_h``), and the exact L2 norm is ``||v R_h^T||_2``: ``2 T H d^2`` FLOPs instead of
``2 T H d D``, and no cancellation as in evaluating ``v G v^T`` directly.
"""

import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: Elements of float32 scratch per tile of ``V W_O`` (16 MiB by default).
DEFAULT_TILE_ELEMENTS = 1 << 22

_GRAM_FACTOR_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _tile_elements() -> int:
    mib = os.environ.get("KVPRESS_CRITICAL_TILE_MB")
    return DEFAULT_TILE_ELEMENTS if mib is None else max(1, int(float(mib) * (1 << 20) / 4))


def gram_factors(o_proj_weight: torch.Tensor, num_attention_heads: int) -> torch.Tensor:
    """
    Per-head factors ``R_h`` (float32, ``(H, d, d)``) with ``R_h^T R_h = G_h = W_O^h (W_O^h)^T``.

    Computed once per weight tensor (and recomputed if the weight is modified in place), in float64
    for accuracy, then stored in float32 on the weight's device. The Gram matrices are formed with one
    batched matmul and factored by a symmetric eigendecomposition of ``d x d`` matrices: a QR of the
    ``(D, d)`` weights gives the same factor but stalled for seconds in multi-threaded LAPACK on a
    loaded 2-core machine.
    """
    key = (o_proj_weight._version, num_attention_heads, o_proj_weight.device)
    cached = _GRAM_FACTOR_CACHE.get(o_proj_weight)
    if cached is not None and cached[0] == key:
        return cached[1]
    hidden = o_proj_weight.shape[0]
    head_dim = o_proj_weight.shape[1] // num_attention_heads
    # (W_O^h)^T = o_proj.weight[:, h*d:(h+1)*d]  -> (H, D, d)
    w = o_proj_weight.detach().double().reshape(hidden, num_attention_heads, head_dim).transpose(0, 1)
    gram = w.transpose(1, 2) @ w  # (H, d, d)
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)
    factors = (eigenvectors.transpose(1, 2) * eigenvalues.clamp(min=0).sqrt().unsqueeze(-1)).float()  # (H, d, d)
    _GRAM_FACTOR_CACHE[o_proj_weight] = (key, factors)
    return factors


def head_projections(o_proj_weight: torch.Tensor, num_attention_heads: int, norm: str) -> torch.Tensor:
    """
    Per-head projections ``M_h`` (``(H, N, d)``) such that the norm of ``v @ M_h.T`` is the projected norm.

    L1: ``M_h = (W_O^h)^T``, a view of the weight (``N = D``, no copy). L2: the Gram factors ``R_h``
    (``N = d``, float32, cached), whose L2 norms equal those of ``v W_O^h``. The fused backends
    take this one layout for both norms.
    """
    if norm == "l2":
        return gram_factors(o_proj_weight, num_attention_heads)
    hidden = o_proj_weight.shape[0]
    return o_proj_weight.reshape(hidden, num_attention_heads, -1).permute(1, 0, 2)  # (H, D, d), a view


def projected_value_norm_torch(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
) -> torch.Tensor:
    """Chunked PyTorch implementation; see :func:`kvpress_critical.projected_value_norm`."""
    bsz, num_kv_heads, k_len, head_dim = values.shape
    hidden = o_proj_weight.shape[0]
    group = num_attention_heads // num_kv_heads
    out = torch.zeros(bsz, num_kv_heads, k_len, dtype=torch.float32, device=values.device)
    if k_len == 0 or bsz == 0:
        return out

    if norm == "l2":
        factors = gram_factors(o_proj_weight, num_attention_heads)  # (H, r, d)
        width = factors.shape[1]
    else:
        width = hidden
    t_tile = max(1, _tile_elements() // (bsz * width))

    for h in range(num_attention_heads):
        kv = h // group
        if norm == "l2":
            proj_t = factors[h].T  # (d, r)
        else:
            proj_t = o_proj_weight[:, h * head_dim : (h + 1) * head_dim].float().T  # (d, D)
        for t0 in range(0, k_len, t_tile):
            v_tile = values[:, kv, t0 : t0 + t_tile].float()  # (B, t, d)
            p_tile = torch.matmul(v_tile, proj_t)  # (B, t, D) or (B, t, r)
            out[:, kv, t0 : t0 + t_tile] += torch.linalg.vector_norm(p_tile, ord=1 if norm == "l1" else 2, dim=-1)
    return out.div_(group)
