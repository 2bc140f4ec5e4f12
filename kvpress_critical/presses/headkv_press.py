from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import BasePress, ScorerPress

from kvpress_critical.capabilities import Capabilities
from kvpress_critical.presses.checks import check_inner_press
from kvpress_critical.presses.head_budgets import HeadBudgetsMixin
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.selection import top_budget_mask


@dataclass
class HeadKVPress(HeadBudgetsMixin, InnerPressMixin, BasePress):
    """
    HeadKV: per-layer-and-head budgets allocated offline from head-importance scores, selection by the base press.

    The budget of every (layer, KV head) follows HeadKV's rule (:func:`kvpress_critical.selection.headkv_budgets`):
    a shared pool split in proportion to the heads' retrieval-reasoning scores plus a uniform floor, the total being
    exactly the press's budget over the whole model (``(1 - compression_ratio) * k_len`` per head on average, so
    layers keep different totals). Inside each head the entries with the highest base scores are kept; the others
    are masked through kvpress's attention patch (``module.masked_key_indices``), or freed with
    :class:`~kvpress_critical.CompactCachePress`. With uniform head scores every head gets the same budget and the
    selection is the base press's.

    Based on HeadKV (https://arxiv.org/abs/2410.19258).

    Parameters
    ----------
    press : ScorerPress
        Base press providing the scores (it holds the ``compression_ratio``); SnapKV's window is excluded from the
        pool and kept by every head, as in HeadKV.
    head_scores : str, dict or None
        A file in HeadKV's format, a dict, or ``None`` for the scores shipped for the model
        (``python -m kvpress_critical.head_scores`` profiles any other model).
    beta : float, default=1.5
        Pool size ``B' // beta``; the rest of each head's average budget is its floor (HeadKV's code default).
    temperature : float, default=1.0
        ``p <- p ** temperature`` before the split.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(selection="head-wise", budgeted=True, scores_exclusions=True)

    press: ScorerPress = None
    head_scores: object = None
    beta: float = 1.5
    temperature: float = 1.0
    _importance: torch.Tensor = field(default=None, init=False, repr=False, compare=False)
    _budget_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_inner_press(self.press, type(self).__name__)
        self.check_headkv()

    def keep_mask(self, layer: LayerInput, n_kept: int) -> torch.Tensor:
        """``(B, H_kv, T)`` bool: each head's top entries by base score, within HeadKV's budgets."""
        scores, budgets = self.scores_and_budgets(layer, n_kept)
        return top_budget_mask(scores, budgets)


__all__ = ["HeadKVPress"]
