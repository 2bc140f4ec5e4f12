"""Selection with an explicit budget: what a press keeps for ``n_kept`` entries per head, whatever its ratio.

``compress`` derives its budget from the press's ``compression_ratio`` and the context it sees; a chunked prefill
(:class:`~kvpress_critical.ChunkedPrefillPress`) needs another one after every chunk (the budget of the tokens seen so
far, over the entries held plus the chunk). Presses declared ``budgeted`` (:mod:`kvpress_critical.capabilities`)
give it: this package's presses through their ``keep_mask(..., n_kept)`` method, kvpress's ``ScorerPress`` through
its scores and a per-head top-k, kvpress's ``AdaKVPress`` through its scorer's scores and AdaKV's budgets. Entries a
chunked prefill excludes get the lowest scores (:func:`~kvpress_critical.presses.base_scores.base_scores`).
"""

import torch
from kvpress import AdaKVPress, ScorerPress

from kvpress_critical.capabilities import capabilities
from kvpress_critical.presses.base_scores import base_scores
from kvpress_critical.selection import adaptive_head_budgets, top_budget_mask

__all__ = ["keep_mask"]


def keep_mask(press, module, hidden_states, keys, values, attentions, kwargs, n_kept: int) -> torch.Tensor:
    """``(B, H_kv, T)`` bool: the entries ``press`` keeps with a budget of ``n_kept`` per head on average."""
    if not capabilities(press).budgeted:
        raise TypeError(f"{type(press).__name__} does not select with an explicit budget")
    own = getattr(press, "keep_mask", None)
    if callable(own):
        return own(module, hidden_states, keys, values, attentions, kwargs, n_kept)
    if isinstance(press, AdaKVPress):  # kvpress's AdaKV: its scorer's scores, AdaKV's head budgets
        scores = base_scores(press.press, module, hidden_states, keys, values, attentions, kwargs)
        return top_budget_mask(scores, adaptive_head_budgets(scores, n_kept, press.alpha_safeguard))
    if isinstance(press, ScorerPress):  # a pruning scorer: its scores, the same top-k in every head
        scores = base_scores(press, module, hidden_states, keys, values, attentions, kwargs)
        return top_budget_mask(scores, torch.full(scores.shape[:2], n_kept, device=scores.device))
    raise TypeError(f"{type(press).__name__} is declared budgeted but has no keep_mask(..., n_kept) method")
