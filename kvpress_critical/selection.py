"""The selection rules of CriticalKV (Algorithm 1 of arXiv 2502.03805) as pure tensor functions.

Everything here works on float32 scores of shape ``(B, H_kv, T)`` and is batched over rows and heads:
no Python loop over heads and no host synchronisation. The presses call these functions; the analysis
tools reuse them to know which entries each stage selected.
"""

import math

import torch
from kvpress.utils import compute_n_kept

__all__ = [
    "adaptive_head_budgets",
    "compute_n_kept",
    "critical_adakv_keep_mask",
    "critical_scores",
    "defensive_scores",
    "descending_rank",
    "first_stage_budget",
    "first_stage_mask",
    "global_top_mask",
    "headkv_budgets",
    "integer_budgets",
    "kv_head_importance",
    "mass_prefix_mask",
    "safeguard_budget",
    "top_budget_mask",
    "two_stage_keep_mask",
]

_MAX = torch.finfo(torch.float32).max


def first_stage_budget(n_kept: int, first_stage_ratio: float) -> int:
    """
    ``b1 = floor(first_stage_ratio * b)`` entries chosen by the base score alone (stage 1).

    Like kvpress, at least one entry goes to stage 1 whenever ``first_stage_ratio > 0`` and ``b > 0``,
    so a tiny budget never skips the attention-mass safeguard. (For ``first_stage_ratio = 0.5`` this is
    exactly kvpress's ``int((1 - ratio) * k_len * first_stage_ratio)``.)
    """
    n_first = int(n_kept * first_stage_ratio)
    if first_stage_ratio > 0 and n_kept > 0:
        n_first = max(1, n_first)
    return n_first


def safeguard_budget(n_kept: int, alpha_safeguard: float) -> int:
    """AdaKV's safeguard: each head first keeps its top ``floor(alpha_safeguard * n_kept)`` (at least 1)."""
    n_safe = int(n_kept * alpha_safeguard)
    if alpha_safeguard > 0 and n_kept > 0:
        n_safe = max(1, n_safe)
    return n_safe


def descending_rank(scores: torch.Tensor, tiebreak: torch.Tensor | None = None) -> torch.Tensor:
    """
    Rank of every entry along the last dim (0 = highest).

    Equal ``scores`` are ordered by ``tiebreak`` (higher first) when given, then by position, so the
    result is deterministic on every device.
    """
    if tiebreak is None:
        order = scores.argsort(dim=-1, descending=True, stable=True)
    else:
        by_tiebreak = tiebreak.argsort(dim=-1, descending=True, stable=True)
        order = by_tiebreak.gather(-1, scores.gather(-1, by_tiebreak).argsort(dim=-1, descending=True, stable=True))
    positions = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def first_stage_mask(base_scores: torch.Tensor, projected_norm: torch.Tensor, n_first) -> torch.Tensor:
    """
    Boolean ``(B, H_kv, T)`` mask of each head's top ``n_first`` entries by base score (stage 1).

    ``n_first`` is an int or a ``(B, H_kv)`` tensor of per-head budgets. Entries with equal base scores
    (e.g. SnapKV's observation window) are taken in order of decreasing projected norm: for a fixed
    retained mass, that minimises the evicted ``sum A_i N_i`` in the perturbation bound.
    """
    rank = descending_rank(base_scores, projected_norm)
    return rank < (n_first.unsqueeze(-1) if isinstance(n_first, torch.Tensor) else n_first)


def critical_scores(
    base_scores: torch.Tensor, projected_norm: torch.Tensor, n_first: int, epsilon: float
) -> torch.Tensor:
    """
    Scores whose per-head top-``b`` is Algorithm 1 with ``b1 = n_first``.

    Stage-1 entries (:func:`first_stage_mask`) get ``finfo(float32).max``; every other entry gets
    ``(A_i + epsilon) * N_i``. Keeping the top ``b >= n_first`` of these scores keeps all stage-1
    entries, then the best stage-2 entries.

    Parameters
    ----------
    base_scores : torch.Tensor
        ``(B, H_kv, T)`` scores of the base press (``A``), any float dtype; computed on in float32.
    projected_norm : torch.Tensor
        ``(B, H_kv, T)`` float32 projected-value norms (``N``).
    n_first : int
        Stage-1 budget, see :func:`first_stage_budget`.
    epsilon : float
        Added to ``A`` in stage 2 so that near-zero attention stays comparable.
    """
    base = base_scores.float()
    scores = stage2_scores(base, projected_norm, epsilon)
    return scores.masked_fill_(first_stage_mask(base, projected_norm, n_first), _MAX)


def stage2_scores(base: torch.Tensor, projected_norm: torch.Tensor, epsilon: float) -> torch.Tensor:
    """
    ``(A_i + epsilon) * N_i`` in float32, with ``-inf`` wherever ``A_i`` is ``-inf`` (an entry a press excluded):
    ``-inf * 0`` would be NaN, which sorts above every number and would be kept first.
    """
    scores = (base + epsilon) * projected_norm
    return torch.where(torch.isneginf(base) | scores.isnan(), torch.full_like(scores, float("-inf")), scores)


def adaptive_head_budgets(
    base_scores: torch.Tensor, n_kept: int, alpha_safeguard: float, projected_norm: torch.Tensor | None = None
) -> torch.Tensor:
    """
    AdaKV head-wise budgets, per batch row: ``(B, H_kv)`` int64 summing to ``n_kept * H_kv`` in each row.

    Every head's top ``safeguard_budget(n_kept, alpha_safeguard)`` entries are boosted, then the
    ``n_kept * H_kv`` best entries of the row (over all heads) decide how many each head gets. Equal
    scores are ordered by ``projected_norm`` when given, then by position.
    """
    bsz, num_kv_heads, k_len = base_scores.shape
    boosted = base_scores.float()
    n_safe = safeguard_budget(n_kept, alpha_safeguard)
    if n_safe > 0:
        boosted = boosted.masked_fill(descending_rank(boosted, projected_norm) < n_safe, _MAX)
    flat_tiebreak = None if projected_norm is None else projected_norm.reshape(bsz, -1)
    top = descending_rank(boosted.reshape(bsz, -1), flat_tiebreak) < n_kept * num_kv_heads  # (B, H_kv * T)
    return top.reshape(bsz, num_kv_heads, k_len).sum(-1)


def top_budget_mask(scores: torch.Tensor, budgets: torch.Tensor, tiebreak: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H_kv, T)`` bool: each head's top ``budgets[b, h]`` entries by ``scores`` (ties by ``tiebreak``)."""
    return descending_rank(scores.float(), tiebreak) < budgets.unsqueeze(-1)


def two_stage_keep_mask(
    base_scores: torch.Tensor,
    projected_norm: torch.Tensor,
    budgets: torch.Tensor,
    n_first: torch.Tensor,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Algorithm 1 inside per-head budgets: the one selection rule of every head-wise critical press.

    Per batch row and KV head with budget ``b_h``: stage 1 keeps the top ``n_first[b, h]`` entries by base score
    (ties by ``N``, see :func:`first_stage_mask`), stage 2 fills the head up to ``b_h`` with the highest
    ``(A_i + epsilon) * N_i`` among the rest.

    Returns
    -------
    keep, stage1 : torch.Tensor
        ``(B, H_kv, T)`` bool; ``stage1`` is a subset of ``keep``, which holds exactly ``budgets[b, h]`` per head.
    """
    base = base_scores.float()
    stage1 = first_stage_mask(base, projected_norm, n_first)
    scores = stage2_scores(base, projected_norm, epsilon).masked_fill_(stage1, _MAX)
    keep = descending_rank(scores) < budgets.unsqueeze(-1)
    return keep, stage1


def critical_adakv_keep_mask(
    base_scores: torch.Tensor,
    projected_norm: torch.Tensor,
    n_kept: int,
    alpha_safeguard: float,
    first_stage_ratio: float,
    epsilon: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """
    CriticalKV inside AdaKV budgets (SPEC section 1, "With AdaKV").

    Per batch row and KV head with budget ``b_h`` (:func:`adaptive_head_budgets`): stage 1 keeps the top
    ``max(n_safe, floor(first_stage_ratio * b_h))`` entries by base score, stage 2 fills the head up to
    ``b_h`` with the highest ``(A_i + epsilon) * N_i`` among the rest (:func:`two_stage_keep_mask`). Equal base
    scores are ordered by ``N`` (see :func:`first_stage_mask`), so the result does not depend on ``torch.topk``
    internals.

    Returns
    -------
    keep : torch.Tensor
        ``(B, H_kv, T)`` bool, exactly ``n_kept * H_kv`` True per row.
    stage1 : torch.Tensor
        ``(B, H_kv, T)`` bool, the entries chosen by stage 1 (a subset of ``keep``).
    budgets : torch.Tensor
        ``(B, H_kv)`` int64 head budgets.
    """
    base = base_scores.float()
    budgets = adaptive_head_budgets(base, n_kept, alpha_safeguard, projected_norm)
    n_safe = safeguard_budget(n_kept, alpha_safeguard)
    n_first = (budgets * first_stage_ratio).long().clamp_(min=n_safe)  # (B, H_kv)
    keep, stage1 = two_stage_keep_mask(base, projected_norm, budgets, n_first, epsilon)
    return keep, stage1, budgets


def headkv_budgets(
    head_scores: torch.Tensor,
    n_kept: int,
    k_len: int,
    beta: float = 1.5,
    temperature: float = 1.0,
    window: int = 0,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    """
    HeadKV's offline per-head budgets (Fu et al. 2024, arXiv 2410.19258), for every layer and KV head at once.

    HeadKV's rule, per query head of every layer: with ``B' = n_kept - window`` (the average budget, HeadKV's
    observation window excluded), ``p`` each head's score normalised over all heads of all layers, then
    ``p <- p ** temperature`` renormalised, a shared pool of ``(B' // beta) * n_layers * n_heads`` entries is split in
    proportion to ``p`` and every head also gets the floor ``B' - B' // beta``: ``B_lh = p_lh * pool + floor``
    (then ``+ window``). Higher ``beta``: smaller pool, larger uniform floor (the code's direction; HeadKV's README
    says the opposite).

    A KV head serves the ``G`` query heads of its group: its share is the **sum** of their shares ``p`` (taken after
    the temperature, as HeadKV applies it per query head; it must hold what all of them attend to), and since the
    rule is linear in ``p`` its budget is exactly the **mean** of their HeadKV budgets: the total stays ``n_kept``
    per KV head on average, as for every other press.

    Budgets are then made integers that sum **exactly** to ``n_kept * n_layers * H_kv`` and are capped at ``k_len``
    per head (:func:`integer_budgets`: what a cap cuts goes to the heads below it in proportion to their budgets, then
    largest remainders).

    Parameters
    ----------
    head_scores : torch.Tensor
        ``(n_layers, H)`` non-negative scores per query head (HeadKV's retrieval-reasoning scores).
    n_kept : int
        Average entries kept per head (``compute_n_kept(k_len, compression_ratio)``).
    k_len : int
        Context length (no head keeps more).
    beta, temperature : float
        HeadKV's parameters (our defaults 1.5 and 1.0: HeadKV's code sets none, its README sweeps ``beta``).
    window : int
        Entries every head keeps regardless (SnapKV's observation window), excluded from the pool as in HeadKV.
    num_kv_heads : int, optional
        KV heads per layer (default ``H``: no grouped-query attention).

    Returns
    -------
    torch.Tensor
        ``(n_layers, H_kv)`` int64 budgets.
    """
    if beta < 1:
        raise ValueError(f"beta must be >= 1 (HeadKV: pool = B' // beta), got {beta}")
    if not bool(torch.isfinite(head_scores).all()):
        raise ValueError("head scores contain NaN or inf: re-profile them (python -m kvpress_critical.head_scores)")
    scores = head_scores.double().clamp_min(0)
    n_layers, heads = scores.shape
    num_kv_heads = heads if num_kv_heads is None else num_kv_heads
    total = n_kept * n_layers * num_kv_heads
    if scores.sum() <= 0:
        scores = torch.ones_like(scores)
    p = scores / scores.sum()
    p = p**temperature
    p = kv_head_importance(p / p.sum(), num_kv_heads)  # (L, H_kv): the group's shares
    window = min(window, n_kept)
    b = float(n_kept - window)
    pool = math.floor(b / beta) * n_layers * num_kv_heads
    floor = b - math.floor(b / beta)
    ideal = p * pool + floor + window  # (L, H_kv), sums to ~total
    ideal = ideal * (total / ideal.sum()) if ideal.sum() > 0 else ideal  # exactly the overall budget
    return integer_budgets(ideal, total, k_len)


def integer_budgets(ideal: torch.Tensor, total: int, cap: int) -> torch.Tensor:
    """
    Integers in ``[0, cap]`` summing exactly to ``min(total, cap * numel)``, closest to ``ideal``.

    ``ideal`` is first rescaled to that sum without exceeding ``cap`` (what the caps cut goes to the heads below the
    cap, in proportion to their ideal; uniformly when those are all zero), then rounded by largest remainders.
    """
    if not bool(torch.isfinite(ideal).all()):
        raise ValueError("integer_budgets: the ideal budgets contain NaN or inf")
    ideal = ideal.double().clamp(min=0, max=cap)
    total = max(0, min(int(total), cap * ideal.numel()))
    for _ in range(ideal.numel() + 1):  # each round caps at least one more head, or converges
        excess = total - float(ideal.sum())
        room = ideal < cap if excess > 0 else ideal > 0
        if abs(excess) < 1e-9 or not room.any():
            break
        share = ideal.where(room, 0)
        share = share / share.sum() if float(share.sum()) > 0 else room.double() / room.sum()
        ideal = (ideal + excess * share).clamp(min=0, max=cap)
    budgets = ideal.floor().long()
    remainder = (ideal - budgets).flatten()
    missing = total - int(budgets.sum())
    if missing > 0:  # the largest remainders get one more, heads at the cap excluded
        order = remainder.masked_fill(budgets.flatten() >= cap, -1.0).argsort(descending=True, stable=True)
        budgets.view(-1)[order[:missing]] += 1
    elif missing < 0:  # (float round-off) the smallest remainders give one back, empty heads excluded
        order = remainder.masked_fill(budgets.flatten() <= 0, 2.0).argsort(stable=True)
        budgets.view(-1)[order[:-missing]] -= 1
    return budgets


def kv_head_importance(query_head_scores: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``(n_layers, H)`` query-head scores -> ``(n_layers, H_kv)`` KV-head importance (the sum over each group)."""
    n_layers, heads = query_head_scores.shape
    if heads % num_kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {num_kv_heads} KV heads")
    return query_head_scores.view(n_layers, num_kv_heads, heads // num_kv_heads).sum(-1)


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


def global_top_mask(scores: torch.Tensor, n_total: int) -> torch.Tensor:
    """``scores`` of any shape ``(B, ...)``: True for each row's ``n_total`` best entries over all other dims."""
    bsz = scores.shape[0]
    flat = scores.reshape(bsz, -1)
    return (descending_rank(flat) < n_total).view_as(scores)
