"""Plain-torch references for the ops in this package.

These are the specification: they materialise every intermediate, compute in float64 and are written
to be obviously correct, not fast. Every backend is tested against them.
"""

import torch


def projected_value_norm_ref(
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    num_attention_heads: int,
    norm: str = "l1",
) -> torch.Tensor:
    """
    Reference projected-value norm (SPEC section 1), materialising ``P = V W_O^h`` for every query head.

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
