"""CriticalKV's two-stage selection (Algorithm 1 of arXiv 2502.03805), batched over rows and heads.

Stage 1 keeps each head's top ``b1 = floor(first_stage_ratio * b)`` entries by the base score ``A`` (securing the
retained attention mass ``s >= 1/2``); stage 2 fills the head's budget ``b`` with the highest ``(A_i + eps) * N_i``,
``N_i`` the projected-value norm.
"""

import torch

from kvpress_critical.selection.ranking import _MAX, descending_rank


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
