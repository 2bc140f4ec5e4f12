"""Budgets, ranking and budget masks every selection rule shares: deterministic ranks, per-head and global top-k."""

import torch

_MAX = torch.finfo(torch.float32).max


def compute_n_kept(k_len: int, compression_ratio: float) -> int:
    """
    Entries each head keeps out of ``k_len`` at ``compression_ratio``: ``max(1, int(k_len * (1 - ratio)))``, and 0
    when ``compression_ratio >= 1`` (the whole layer evicted on purpose).

    The same rule, and the same float rounding, as kvpress's ``kvpress.utils.compute_n_kept``, so that every press
    and the vLLM plugin keep the number of entries kvpress's presses keep.
    """
    if compression_ratio >= 1.0:
        return 0
    return max(1, int(k_len * (1 - compression_ratio)))


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


def top_budget_mask(scores: torch.Tensor, budgets: torch.Tensor, tiebreak: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H_kv, T)`` bool: each head's top ``budgets[b, h]`` entries by ``scores`` (ties by ``tiebreak``)."""
    return descending_rank(scores.float(), tiebreak) < budgets.unsqueeze(-1)


def global_top_mask(scores: torch.Tensor, n_total: int) -> torch.Tensor:
    """``scores`` of any shape ``(B, ...)``: True for each row's ``n_total`` best entries over all other dims."""
    bsz = scores.shape[0]
    flat = scores.reshape(bsz, -1)
    return (descending_rank(flat) < n_total).view_as(scores)
