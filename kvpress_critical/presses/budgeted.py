"""Selection with an explicit budget: the one path by which a layer is compressed outside kvpress's own hooks.

``compress`` derives its budget from the press's ``compression_ratio`` and the context it sees; a chunked prefill
(:class:`~kvpress_critical.ChunkedPrefillPress`) needs another one after every chunk (the budget of the tokens seen so
far, over the entries held plus the chunk), the decoding compressor the schedule's target size, the compact cache one
per row of a padded batch. Each gives :func:`keep_mask` the press, the layer as a
:class:`~kvpress_critical.presses.layer_input.LayerInput` (its entries, the ones to exclude, the norms already known)
and the budget. Presses declared ``budgeted`` (:mod:`kvpress_critical.capabilities`) take it: this package's presses
through their ``keep_mask(layer, n_kept)`` method, kvpress's ``ScorerPress`` through its scores and a per-head top-k,
kvpress's ``AdaKVPress`` through its scorer's scores and AdaKV's budgets.
"""

import torch
from kvpress import AdaKVPress, ScorerPress

from kvpress_critical.capabilities import capabilities
from kvpress_critical.presses.base_scores import base_scores
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.selection import adaptive_head_budgets, top_budget_mask

__all__ = ["keep_mask"]


def keep_mask(press, layer: LayerInput, n_kept: int) -> torch.Tensor:
    """
    ``(B, H_kv, T)`` bool: the entries ``press`` keeps of ``layer`` with a budget of ``n_kept`` per head on average
    (never one of the layer's excluded entries). The one path by which a layer is compressed outside kvpress's own
    hooks: after a chunk, while decoding, row by row in a padded batch.
    """
    if not capabilities(press).budgeted:
        raise TypeError(f"{type(press).__name__} does not select with an explicit budget")
    own = getattr(press, "keep_mask", None)
    if callable(own):
        keep = own(layer, n_kept)
    elif isinstance(press, AdaKVPress):  # kvpress's AdaKV: its scorer's scores, AdaKV's head budgets
        scores = base_scores(press.press, layer, n_kept)
        keep = top_budget_mask(scores, adaptive_head_budgets(scores, n_kept, press.alpha_safeguard))
    elif isinstance(press, ScorerPress):  # a pruning scorer: its scores, the same top-k in every head
        scores = base_scores(press, layer, n_kept)
        keep = top_budget_mask(scores, torch.full(scores.shape[:2], n_kept, device=scores.device))
    else:
        raise TypeError(f"{type(press).__name__} is declared budgeted but has no keep_mask(layer, n_kept) method")
    if tuple(keep.shape) != layer.shape:
        raise ValueError(f"{type(press).__name__} selected a {tuple(keep.shape)} mask for a layer of {layer.shape}")
    return keep if layer.excluded is None else keep & ~layer.excluded
