"""DefensiveKV's scores (Feng et al., ICLR 2026): worst-case aggregation of window attention times normalised norms."""

import torch

from kvpress_critical.selection.ranking import _MAX


def mass_prefix_mask(weights: torch.Tensor, target: torch.Tensor, cap: int) -> torch.Tensor:
    """
    ``(B, H, T)`` bool: per head, the smallest set of top-weighted entries whose ``weights`` sum reaches ``target``
    (``(B, H)``; none when ``target <= 0``), at most ``cap`` entries. The entry that crosses the target is included.
    """
    order = weights.argsort(dim=-1, descending=True, stable=True)
    cumulative = weights.gather(-1, order).cumsum(-1)
    count = (cumulative < target.unsqueeze(-1)).sum(-1) + 1  # entries up to and including the crossing one
    count = torch.where(target > 0, count, torch.zeros_like(count)).clamp(max=min(cap, weights.shape[-1]))
    count = count.clamp(min=0)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(weights.shape[-1], device=weights.device).expand_as(order)
    )
    return rank < count.unsqueeze(-1)


def defensive_scores(
    window_attention: torch.Tensor,
    projected_norm: torch.Tensor,
    n_kept: int,
    kernel_size: int = 5,
    mass: float = 0.9,
    excluded: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    DefensiveKV's scores of one layer (Feng et al., ICLR 2026; the same authors' follow-up to CriticalKV).

    With ``a[g, w, i]`` the attention of window query ``w`` of query head ``g`` (of a KV head's group) over the
    ``T`` entries (float32, full rows: the ``W`` window entries last), ``P = T - W`` the entries before the window:

    1. ``a`` over the first ``P`` entries is average-pooled along ``i`` (kernel ``kernel_size``, zero padding),
       each row rescaled to keep its mass;
    2. defensive aggregation: ``m_i = max over g and w`` of the pooled weights, ``s_i = max(m_i, mean_j m_j)``;
    3. ``N_hat[h, i] = N[h, i] / sum_h' N[h', i]`` (the projected-value norm normalised across the layer's KV heads
       per entry); the score is ``s * N_hat``;
    4. stage 1, per head: the smallest set of entries, by their mean unpooled attention, that brings the retained
       mass (those entries plus the window, which is always kept) to ``mass`` = 90% of the window queries' mean
       attention, at most ``n_kept - W`` entries; these and the window get ``finfo(float32).max`` (with a budget
       smaller than the window, only the window's newest ``n_kept`` entries).

    The stage-1 target is in the units of the mass itself: the window queries' mean attention on the window
    entries ``beta`` is kept anyway, so the entries before it must add ``mass - beta`` (DefensiveKV's code measures
    ``beta`` on the last ``W`` entries *before* the window, one scalar for all heads and the whole batch, and
    compares it with a cumulative sum renormalised over those entries: inconsistent units; here ``beta`` is per head
    and batch row, on the window itself).

    ``excluded`` (``(B, H_kv, T)`` bool, optional): entries evicted after an earlier chunk of a chunked prefill;
    they get no pooled mass and do not count in the mean of step 2.

    Returns
    -------
    scores : torch.Tensor
        ``(B, H_kv, T)`` float32; forced entries (stage 1 and window) at ``finfo(float32).max``.
    forced : torch.Tensor
        ``(B, H_kv, T)`` bool, the forced entries.
    """
    bsz, num_kv_heads, group, window, k_len = window_attention.shape
    prefix_len = k_len - window
    attn = window_attention.float()
    prefix = attn[..., :prefix_len]  # (B, H_kv, G, W, P)
    row_mass = prefix.sum(-1, keepdim=True)
    pooled = torch.nn.functional.avg_pool1d(
        prefix.reshape(-1, window, prefix_len), kernel_size, padding=kernel_size // 2, stride=1
    ).view_as(prefix)
    live = None if excluded is None else ~excluded[..., :prefix_len]  # (B, H_kv, P)
    if live is not None:  # pooling must not spread mass onto excluded entries (evicted after an earlier chunk)
        pooled = pooled * live[:, :, None, None]
    pooled = pooled * (row_mass / pooled.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    m = pooled.amax(dim=(2, 3))  # (B, H_kv, P): the worst case over the group's heads and the window
    if live is None:
        floor = m.mean(-1, keepdim=True)
    else:  # the mean over the live entries only
        floor = m.sum(-1, keepdim=True) / live.sum(-1, keepdim=True).clamp_min(1)
    s = torch.maximum(m, floor)
    norm = projected_norm[..., :prefix_len].float()
    n_hat = norm / norm.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scores = torch.empty(bsz, num_kv_heads, k_len, dtype=torch.float32, device=attn.device)
    scores[..., :prefix_len] = s * n_hat
    mean_attention = prefix.mean(dim=(2, 3))  # (B, H_kv, P), total-mass units
    beta = 1.0 - mean_attention.sum(-1)  # the mean mass on the window entries
    forced = torch.zeros(bsz, num_kv_heads, k_len, dtype=torch.bool, device=attn.device)
    forced[..., :prefix_len] = mass_prefix_mask(mean_attention, mass - beta, max(0, n_kept - window))
    # the window is kept, its newest entries first when the budget is smaller than the window (then nothing else)
    scores[..., prefix_len:] = 0.0
    forced[..., k_len - min(window, max(n_kept, 0)) :] = True
    return scores.masked_fill_(forced, _MAX), forced
