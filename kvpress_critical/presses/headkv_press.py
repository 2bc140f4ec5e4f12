import logging
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import BasePress, ScorerPress, SnapKVPress
from torch import nn

from kvpress_critical.modeling import check_attention_supports_masking, module_projected_norm
from kvpress_critical.presses.base_scores import base_scores
from kvpress_critical.presses.checks import check_common, check_fraction, check_inner_press
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.masking import set_masked_key_indices
from kvpress_critical.selection import (
    compute_n_kept,
    headkv_budgets,
    top_budget_mask,
    two_stage_keep_mask,
)

logger = logging.getLogger(__name__)


class HeadBudgetsMixin:
    """
    HeadKV's offline budgets for a press: the head scores (loaded once per model) and the per-layer allocation.

    ``head_scores`` is a path, a dict in HeadKV's format, or ``None`` for the scores shipped for the model
    (:func:`kvpress_critical.head_scores.head_scores_for`). Budgets depend on the context length and ratio only,
    and are computed once for all layers (HeadKV shares its pool across layers) and cached.
    """

    def post_init_from_model(self, model):
        check_attention_supports_masking(model.config, type(self).__name__)
        self.press.post_init_from_model(model)
        self.load_head_scores(model)

    def scores_and_budgets(self, module, hidden_states, keys, values, attentions, kwargs):
        """``(base scores (B, H_kv, T), host budgets (H_kv,), budgets (B, H_kv) on the scores' device)``."""
        check_attention_supports_masking(module.config, type(self).__name__)
        scores = base_scores(self.press, module, hidden_states, keys, values, attentions, kwargs)
        host_budgets = self.layer_budgets(module, scores.shape[-1])  # on the host: the masked count needs no sync
        return scores, host_budgets, host_budgets.to(scores.device).expand(scores.shape[0], -1)

    def load_head_scores(self, model) -> None:
        from kvpress_critical.head_scores import head_scores_for

        scores = head_scores_for(self.head_scores, model)
        self._importance = scores.float()  # (n_layers, H) per query head
        self._num_kv_heads = getattr(model.config, "text_config", model.config).num_key_value_heads
        self._budget_cache = {}

    def layer_budgets(self, module: nn.Module, k_len: int) -> torch.Tensor:
        """``(H_kv,)`` int64 budgets of ``module``'s layer for a context of ``k_len`` entries."""
        if getattr(self, "_importance", None) is None:
            raise RuntimeError(
                f"{type(self).__name__} has no head scores yet: use it through `with press(model)` or kvpress's "
                "pipeline (they call post_init_from_model), or call press.post_init_from_model(model) first"
            )
        key = (k_len, self.compression_ratio)
        if key not in self._budget_cache:
            window = self.press.window_size if isinstance(self.press, SnapKVPress) else 0
            self._budget_cache[key] = headkv_budgets(
                self._importance, compute_n_kept(k_len, self.compression_ratio), k_len, self.beta, self.temperature,
                window=window if k_len > window else 0, num_kv_heads=self._num_kv_heads,
            )  # fmt: skip
        return self._budget_cache[key][module.layer_idx]

    def check_headkv(self) -> None:
        if not isinstance(self.beta, (int, float)) or self.beta < 1:
            raise ValueError(f"beta must be a number >= 1 (HeadKV's pool is B' // beta), got {self.beta!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature <= 0:
            raise ValueError(f"temperature must be a positive number, got {self.temperature!r}")


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

    press: ScorerPress = None
    head_scores: object = None
    beta: float = 1.5
    temperature: float = 1.0
    _importance: torch.Tensor = field(default=None, init=False, repr=False, compare=False)
    _budget_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_inner_press(self.press, type(self).__name__)
        self.check_headkv()

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores, host_budgets, budgets = self.scores_and_budgets(module, hidden_states, keys, values, attentions, kwargs)
        keep = top_budget_mask(scores, budgets)
        set_masked_key_indices(module, keep, scores[0].numel() - int(host_budgets.sum()))
        return keys, values


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

    applies_criticalkv: ClassVar[bool] = True

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

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        scores, host_budgets, budgets = self.scores_and_budgets(module, hidden_states, keys, values, attentions, kwargs)
        n_first = (budgets * self.first_stage_ratio).long()
        if self.first_stage_ratio > 0:  # like first_stage_budget: at least one stage-1 entry in a non-empty head
            n_first = torch.where(budgets > 0, n_first.clamp(min=1), n_first)
        projected_norm = module_projected_norm(module, values, self.norm, self.backend)
        keep, _ = two_stage_keep_mask(scores, projected_norm, budgets, n_first, self.epsilon)
        set_masked_key_indices(module, keep, scores[0].numel() - int(host_budgets.sum()))
        return keys, values


__all__ = ["CriticalHeadKVPress", "HeadBudgetsMixin", "HeadKVPress"]
