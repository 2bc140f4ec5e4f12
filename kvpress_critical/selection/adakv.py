"""AdaKV's head-wise budgets (arXiv 2407.11550) and CriticalKV inside them (the paper's CriticalAdaKV)."""

import torch

from kvpress_critical.selection.criticalkv import two_stage_keep_mask
from kvpress_critical.selection.ranking import _MAX, descending_rank


def safeguard_budget(n_kept: int, alpha_safeguard: float) -> int:
    """AdaKV's safeguard: each head first keeps its top ``floor(alpha_safeguard * n_kept)`` (at least 1)."""
    n_safe = int(n_kept * alpha_safeguard)
    if alpha_safeguard > 0 and n_kept > 0:
        n_safe = max(1, n_safe)
    return n_safe


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
    CriticalKV inside AdaKV budgets (arXiv 2502.03805, section 3.3, with AdaKV's budgets, arXiv 2407.11550).

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
