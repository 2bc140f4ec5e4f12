from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import BasePress, ScorerPress

from kvpress_critical.capabilities import Capabilities
from kvpress_critical.presses.checks import check_common, check_fraction
from kvpress_critical.presses.head_budgets import HeadBudgetsMixin
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.selection import two_stage_keep_mask


@dataclass
class CriticalHeadKVPress(HeadBudgetsMixin, InnerPressMixin, BasePress):
    """
    CriticalHeadKV: HeadKV's offline per-head budgets with CriticalKV's two-stage selection inside each head.

    Budgets as :class:`HeadKVPress`; inside a head with budget ``b_h``, Algorithm 1: the top
    ``floor(first_stage_ratio * b_h)`` entries by base score (at least one), then the highest ``(A_i + epsilon) *
    N_i`` with ``N_i`` the projected-value norm (:func:`kvpress_critical.selection.two_stage_keep_mask`, the rule
    :class:`~kvpress_critical.CriticalAdaKVPress` uses inside AdaKV's budgets). With uniform head scores it selects
    exactly what :class:`~kvpress_critical.CriticalKVPress` selects. The paper's best combination (RULER, Llama-3.1-8B,
    40% cache: HeadKV 79.98 -> 89.29).

    Based on CriticalKV (https://arxiv.org/abs/2502.03805) and HeadKV (https://arxiv.org/abs/2410.19258).

    Parameters
    ----------
    press : ScorerPress
        Base press providing the scores ``A``; it holds the ``compression_ratio``.
    head_scores, beta, temperature
        As :class:`HeadKVPress`.
    epsilon : float, default=1e-4
    first_stage_ratio : float, default=0.5
    norm : {"l1", "l2"}, default="l1"
    backend : str, default="auto"
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        selection="head-wise", budgeted=True, applies_criticalkv=True, scores_exclusions=True
    )

    press: ScorerPress = None
    head_scores: object = None
    beta: float = 1.5
    temperature: float = 1.0
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    norm: str = "l1"
    backend: str = "auto"
    _importance: torch.Tensor = field(default=None, init=False, repr=False, compare=False)
    _budget_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_common(self.press, type(self).__name__, self.epsilon, self.first_stage_ratio, self.norm, self.backend)
        check_fraction(self.first_stage_ratio, "first_stage_ratio")
        self.check_headkv()

    def keep_mask(self, layer: LayerInput, n_kept: int) -> torch.Tensor:
        """``(B, H_kv, T)`` bool: HeadKV's budgets (``n_kept`` per head on average), Algorithm 1 inside each head."""
        scores, budgets = self.scores_and_budgets(layer, n_kept)
        n_first = (budgets * self.first_stage_ratio).long()
        if self.first_stage_ratio > 0:  # like first_stage_budget: at least one stage-1 entry in a non-empty head
            n_first = torch.where(budgets > 0, n_first.clamp(min=1), n_first)
        projected_norm = layer.projected_norm(self.norm, self.backend)
        keep, _ = two_stage_keep_mask(scores, projected_norm, budgets, n_first, self.epsilon)
        return keep


__all__ = ["CriticalHeadKVPress"]
