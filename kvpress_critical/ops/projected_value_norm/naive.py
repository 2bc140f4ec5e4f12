"""The plain-torch reference of ``projected_value_norm`` and the worst-case error bound of its backends.

The reference is the specification: it materialises every intermediate, computes in float64 and is written to be
obviously correct, not fast. Every backend is tested against it, within :func:`projected_value_norm_error_bound`.
"""

import torch


def projected_value_norm_ref(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
) -> torch.Tensor:
    """
    Reference projected-value norm (arXiv 2502.03805, section 3), materialising ``P = V W_O^h`` for every query head.

    Parameters
    ----------
    values : torch.Tensor
        ``(B, H_kv, T, d)`` cached values.
    o_proj_weight : torch.Tensor
        ``(D, H * d)`` weight of the attention output projection, as stored in ``nn.Linear``.
    num_attention_heads : int
        Number of query heads ``H`` (a multiple of ``H_kv``).
    norm : {"l1", "l2"}
        Vector norm taken over the ``D`` output features.

    Returns
    -------
    torch.Tensor
        ``(B, H_kv, T)`` float32: for each KV head, the mean over its query group of ``||V_i W_O^h||``.
    """
    bsz, num_kv_heads, k_len, head_dim = values.shape
    hidden = o_proj_weight.shape[0]
    group = num_attention_heads // num_kv_heads
    # W_O^h = o_proj.weight[:, h*d:(h+1)*d].T  -> (H, d, D)
    w_o = o_proj_weight.double().reshape(hidden, num_attention_heads, head_dim).permute(1, 2, 0)
    # query head h reads KV head h // group
    v = values.double().repeat_interleave(group, dim=1)  # (B, H, T, d)
    projected = torch.einsum("bhtd,hdo->bhto", v, w_o)  # (B, H, T, D)
    if norm == "l1":
        per_head = projected.abs().sum(-1)
    elif norm == "l2":
        per_head = projected.pow(2).sum(-1).sqrt()
    else:
        raise ValueError(f"norm must be 'l1' or 'l2', got {norm!r}")
    return per_head.view(bsz, num_kv_heads, group, k_len).mean(2).float()


#: Unit roundoff of float32 accumulation: IEEE round-to-nearest (CPU kernels, CUDA FMA, Triton fp32 ``ieee`` dots)
#: and tensor cores, whose fp32 accumulation is not guaranteed to round to nearest (truncation: one ulp per addition).
UNIT_ROUNDOFF = {"ieee": 2.0**-24, "tensor_core": 2.0**-23}


def _gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of an n-term floating-point sum."""
    return n * u / (1 - n * u)


def projected_value_norm_error_bound(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
    unit_roundoff: float = UNIT_ROUNDOFF["ieee"],
) -> torch.Tensor:
    """
    Worst-case error of a float32-accumulating backend of the projected-value norm, per output (float64).

    The bound of a dot product computed in any order with unit roundoff ``u`` (Higham, *Accuracy and Stability of
    Numerical Algorithms*, 3.1): ``|fl(x . y) - x . y| <= gamma_n |x| . |y|``. Inputs of any float dtype are exact
    in float32 (16-bit products too), so the error comes from accumulation only:

    - each projected entry ``P_n = sum_k v_k M_nk`` (``d`` terms; ``M`` = ``W_O^h^T`` for L1, the float32 Gram factor
      ``R_h`` for L2, one more roundoff for the factor itself): ``E_n = gamma_(d+1) sum_k |v_k| |M_nk|``;
    - L1: ``sum_n E_n + gamma_N sum_n |P_n|``; L2: the same through the sum of squares and the square root;
    - the mean over the query group and the float32 result: ``gamma_(G+1)`` and ``u`` relative.

    ``unit_roundoff``: :data:`UNIT_ROUNDOFF` ``["ieee"]`` (round to nearest) or ``["tensor_core"]``.
    """
    from kvpress_critical.ops.projected_value_norm.torch_backend import gram_factors

    bsz, num_kv_heads, k_len, head_dim = values.shape
    hidden = o_proj_weight.shape[0]
    group = num_attention_heads // num_kv_heads
    u = unit_roundoff
    if norm == "l1":  # M[h, n, k] = W_O^h[k, n]
        proj = o_proj_weight.double().reshape(hidden, num_attention_heads, head_dim).permute(1, 0, 2)
    else:
        proj = gram_factors(o_proj_weight.float(), num_attention_heads).double()
    features = proj.shape[1]
    v = values.double().repeat_interleave(group, dim=1)  # (B, H, T, d)
    exact = torch.einsum("bhtk,hnk->bhtn", v, proj)  # (B, H, T, N)
    dot_error = _gamma(head_dim + 1, u) * torch.einsum("bhtk,hnk->bhtn", v.abs(), proj.abs())
    if norm == "l1":
        per_head = dot_error.sum(-1) + _gamma(features, u) * exact.abs().sum(-1)
        value = exact.abs().sum(-1)
    else:
        squares = (exact**2).sum(-1)
        value = squares.sqrt()
        sq_error = (2 * exact.abs() * dot_error + dot_error**2).sum(-1) + _gamma(features, u) * squares
        # |sqrt(a) - sqrt(b)| <= |a - b| / (2 sqrt(b)) and <= sqrt(|a - b|); plus the rounding of the square root
        by_derivative = torch.where(value > 0, sq_error / (2 * value.clamp_min(1e-300)), float("inf"))
        per_head = torch.minimum(by_derivative, sq_error.sqrt()) + u * value
    mean = per_head.view(bsz, num_kv_heads, group, k_len).mean(2)
    result = value.view(bsz, num_kv_heads, group, k_len).mean(2)
    return mean + (_gamma(group + 1, u) + u) * result
