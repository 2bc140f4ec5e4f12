from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress import ScorerPress
from torch import nn

from kvpress_critical.capabilities import Capabilities
from kvpress_critical.presses.base_scores import base_scores
from kvpress_critical.presses.checks import check_common
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.selection import compute_n_kept, critical_scores, first_stage_budget, top_budget_mask


@dataclass(init=False)
class CriticalKVPress(InnerPressMixin, ScorerPress):
    """
    CriticalKV: two-stage selection that bounds the attention-output perturbation.

    Wraps any ``ScorerPress`` (the base score ``A``: SnapKV window attention, expected attention, key
    norms...). For a per-head budget ``b = max(1, int(k_len * (1 - compression_ratio)))``, stage 1 keeps
    the ``b1 = floor(first_stage_ratio * b)`` entries with the highest ``A`` (securing retained
    attention mass ``s >= 1/2``); stage 2 keeps, among the rest, the ``b - b1`` entries with the highest
    ``(A_i + epsilon) * N_i``, where ``N_i`` is the norm of the value projected by the output
    projection, averaged over the KV head's query group. Scores are float32 whatever the model dtype.

    Unlike kvpress's built-in ``CriticalKVPress``: works on models whose config has no ``head_dim``
    (Qwen2, Phi-3), never copies V with ``repeat_kv`` nor materialises ``V W_O`` beyond one tile, offers
    an exact L2 norm and fused backends, dequantizes quantized ``o_proj`` layers, and is a complete
    dataclass (its repr, saved in evaluation configs, shows the inner press and every parameter).

    Based on CriticalKV (https://arxiv.org/abs/2502.03805).

    Parameters
    ----------
    press : ScorerPress
        Base press providing the scores ``A``; it holds the ``compression_ratio``.
    epsilon : float, default=1e-4
        Added to ``A`` in stage 2 so that entries with near-zero attention stay comparable.
    first_stage_ratio : float, default=0.5
        Fraction of the budget chosen by ``A`` alone (stage 1).
    norm : {"l1", "l2"}, default="l1"
        Norm of the projected values (the paper uses L1; L2 is exact and ``D/d`` times cheaper).
    backend : str, default="auto"
        Backend of :func:`kvpress_critical.projected_value_norm` (``"auto"``, ``"torch"``, ...).
    compression_ratio : float, optional
        If given, set on the inner press (convenience; the inner press's own value is used otherwise).
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        selection="pruning", budgeted=True, applies_criticalkv=True, scores_exclusions=True
    )

    press: ScorerPress = None
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    norm: str = "l1"
    backend: str = "auto"

    def __init__(
        self,
        press: ScorerPress,
        epsilon: float = 1e-4,
        first_stage_ratio: float = 0.5,
        norm: str = "l1",
        backend: str = "auto",
        compression_ratio: float | None = None,
    ):
        self.press = press
        self.epsilon = epsilon
        self.first_stage_ratio = first_stage_ratio
        self.norm = norm
        self.backend = backend
        self.__post_init__()
        if compression_ratio is not None:
            self.compression_ratio = compression_ratio

    def __post_init__(self):
        check_common(self.press, type(self).__name__, self.epsilon, self.first_stage_ratio, self.norm, self.backend)

    def critical_scores(self, layer: LayerInput, n_kept: int) -> torch.Tensor:
        """``(B, H_kv, T)`` float32 scores whose per-head top ``n_kept`` is Algorithm 1 with a budget of ``n_kept``."""
        scores = base_scores(self.press, layer, n_kept)
        n_first = first_stage_budget(n_kept, self.first_stage_ratio)
        projected_norm = layer.projected_norm(self.norm, self.backend)
        return critical_scores(scores, projected_norm, n_first, self.epsilon)

    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> torch.Tensor:
        n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
        layer = LayerInput.from_compress(module, hidden_states, keys, values, attentions, kwargs)
        return self.critical_scores(layer, n_kept)

    def keep_mask(self, layer: LayerInput, n_kept: int) -> torch.Tensor:
        """``(B, H_kv, T)`` bool: the ``n_kept`` entries of each head Algorithm 1 keeps (an explicit budget)."""
        scores = self.critical_scores(layer, n_kept)
        return top_budget_mask(scores, torch.full(scores.shape[:2], n_kept, device=scores.device))
