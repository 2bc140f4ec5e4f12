"""The selection rules of CriticalKV (Algorithm 1 of arXiv 2502.03805) as pure tensor functions.

Everything here works on float32 scores of shape ``(B, H_kv, T)`` and is batched over rows and heads:
no Python loop over heads and no host synchronisation. The presses call these functions; the analysis
tools reuse them to know which entries each stage selected.
"""

import torch
from kvpress.utils import compute_n_kept

__all__ = [
    "adaptive_head_budgets",
    "compute_n_kept",
    "critical_adakv_keep_mask",
    "critical_scores",
    "descending_rank",
    "first_stage_budget",
    "first_stage_mask",
    "safeguard_budget",
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
    scores = (base + epsilon) * projected_norm
    return scores.masked_fill_(first_stage_mask(base, projected_norm, n_first), _MAX)


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
    ``b_h`` with the highest ``(A_i + epsilon) * N_i`` among the rest. Equal base scores are ordered by
    ``N`` (see :func:`first_stage_mask`), so the result does not depend on ``torch.topk`` internals.

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
    stage1 = first_stage_mask(base, projected_norm, n_first)
    stage2_scores = ((base + epsilon) * projected_norm).masked_fill_(stage1, _MAX)
    keep = descending_rank(stage2_scores) < budgets.unsqueeze(-1)
    return keep, stage1, budgets
