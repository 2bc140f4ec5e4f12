from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress import AdaKVPress, ScorerPress
from torch import nn

from kvpress_critical.capabilities import Capabilities
from kvpress_critical.modeling import check_attention_supports_masking
from kvpress_critical.presses.base_scores import base_scores
from kvpress_critical.presses.checks import check_common, check_fraction
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.presses.masking import set_masked_key_indices
from kvpress_critical.selection import compute_n_kept, critical_adakv_keep_mask


@dataclass
class CriticalAdaKVPress(InnerPressMixin, AdaKVPress):
    """
    CriticalAdaKV: AdaKV head-wise budgets with CriticalKV's two-stage selection inside each head.

    Per layer and per batch row, the budget ``n_kept * H_kv`` is shared across KV heads by a top-k over
    the base scores, after every head is guaranteed its top ``alpha_safeguard * n_kept`` entries. Each
    head then runs Algorithm 1 in its own budget ``b_h``: the top ``max(n_safe, floor(first_stage_ratio
    * b_h))`` entries by base score, then the highest ``(A_i + epsilon) * N_i``. Entries outside a
    head's selection are masked through kvpress's attention patch (``module.masked_key_indices``): the
    cache keeps its size, so no memory is saved, but attention ignores them during decoding.

    Unlike kvpress's built-in ``CriticalAdaKVPress``: budgets are computed per batch row (batch size > 1
    works), ``post_init_from_model`` is forwarded, selection is batched over heads with no Python loop
    or host synchronisation, it is an ``AdaKVPress`` (so ``DecodingPress`` and
    ``PrefillDecodingPress`` accept it), and it works on Qwen2 / Phi-3 configs without ``head_dim``.

    Based on CriticalKV (https://arxiv.org/abs/2502.03805) and AdaKV (https://arxiv.org/abs/2407.11550).

    Parameters
    ----------
    press : ScorerPress
        Base press providing the scores ``A``; it holds the ``compression_ratio``.
    alpha_safeguard : float, default=0.2
        Fraction of the average budget every head keeps regardless of the global ranking.
    epsilon : float, default=1e-4
        Added to ``A`` in stage 2 so that entries with near-zero attention stay comparable.
    first_stage_ratio : float, default=0.5
        Fraction of each head's budget chosen by ``A`` alone (stage 1).
    norm : {"l1", "l2"}, default="l1"
        Norm of the projected values.
    backend : str, default="auto"
        Backend of :func:`kvpress_critical.projected_value_norm`.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        selection="head-wise", budgeted=True, applies_criticalkv=True, scores_exclusions=True
    )

    press: ScorerPress = None
    alpha_safeguard: float = 0.2
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    norm: str = "l1"
    backend: str = "auto"

    def __post_init__(self):
        check_common(self.press, type(self).__name__, self.epsilon, self.first_stage_ratio, self.norm, self.backend)
        check_fraction(self.alpha_safeguard, "alpha_safeguard")

    def post_init_from_model(self, model):
        check_attention_supports_masking(model.config, type(self).__name__)
        super().post_init_from_model(model)

    def keep_mask(self, layer: LayerInput, n_kept: int) -> torch.Tensor:
        """``(B, H_kv, T)`` bool: AdaKV's budgets for ``n_kept`` per head on average, Algorithm 1 inside each head."""
        check_attention_supports_masking(layer.module.config, type(self).__name__)
        scores = base_scores(self.press, layer, n_kept)
        projected_norm = layer.projected_norm(self.norm, self.backend)
        keep, _, _ = critical_adakv_keep_mask(
            scores, projected_norm, n_kept, self.alpha_safeguard, self.first_stage_ratio, self.epsilon
        )
        return keep

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compression_ratio == 0:
            return keys, values
        bsz, num_kv_heads, k_len, _ = keys.shape
        n_kept = compute_n_kept(k_len, self.compression_ratio)
        keep = self.keep_mask(LayerInput.from_compress(module, hidden_states, keys, values, attentions, kwargs), n_kept)
        set_masked_key_indices(module, keep, num_kv_heads * (k_len - n_kept))
        return keys, values
