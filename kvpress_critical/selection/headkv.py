"""HeadKV's offline per-head budgets (Fu et al. 2024, arXiv 2410.19258) from head-importance scores."""

import math

import torch


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
