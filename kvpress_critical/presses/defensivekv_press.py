from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress import BasePress

from kvpress_critical.capabilities import Capabilities
from kvpress_critical.modeling import check_attention_supports_masking
from kvpress_critical.ops import NORMS, PROJECTED_VALUE_NORM
from kvpress_critical.presses.checks import check_fraction, check_ratio
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.presses.masking import set_masked_key_indices
from kvpress_critical.presses.window_attention import window_attention
from kvpress_critical.selection import compute_n_kept, defensive_scores, global_top_mask


@dataclass
class DefensiveKVPress(BasePress):
    """
    DefensiveKV: CriticalKV's projected-value weighting with a worst-case ("defensive") aggregation of attention.

    Per layer, from the attention of the last ``window_size`` queries (float32): the attention over the earlier
    entries is average-pooled (``kernel_size``, row mass kept); each entry's score is the **maximum** over the
    window's queries and the KV head's query group, floored at its mean over the entries, times the projected-value
    L1 norm normalised across the layer's KV heads; a first stage forces in, per head, the fewest top-attended
    entries that bring the retained attention mass to 90% (at most ``(1 - ratio) * T - window_size``), and the window
    itself. One top-``n_kept * H_kv`` over all KV heads of the layer then gives head-wise budgets (no safeguard).
    :func:`kvpress_critical.selection.defensive_scores` has every step; entries outside a head's selection are masked
    (kvpress's attention patch), or freed with :class:`~kvpress_critical.CompactCachePress`.

    Unlike the authors' implementation (a fork of kvpress 0.2.4: batch size 1, flash-attention only): per batch row,
    every attention implementation kvpress's masking patch covers (sdpa, flash_attention_2...; eager has no patch and
    is refused with a clear error, as for every head-wise press), our projected-norm backends, no per-head Python
    loop; the stage-1 mass target is measured on the window entries per
    head (their code measures it on the entries just before the window, one number for the whole batch, against a
    renormalised cumulative sum: see ``defensive_scores``); a short prefill (not longer than the window) uses a
    window of half its length.

    Based on DefensiveKV (Feng et al., ICLR 2026) and CriticalKV (https://arxiv.org/abs/2502.03805).

    Parameters
    ----------
    compression_ratio : float, default=0.0
    window_size : int, default=32
    kernel_size : int, default=5
    mass : float, default=0.9
        Attention mass the first stage secures (with the window).
    norm : {"l1", "l2"}, default="l1"
    backend : str, default="auto"
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        selection="head-wise",
        budgeted=True,
        applies_criticalkv=True,
        normalises_across_heads=True,
        scores_exclusions=True,
    )

    compression_ratio: float = 0.0
    window_size: int = 32
    kernel_size: int = 5
    mass: float = 0.9
    norm: str = "l1"
    backend: str = "auto"

    def __post_init__(self):
        check_ratio(self.compression_ratio)
        if not isinstance(self.window_size, int) or self.window_size < 1:
            raise ValueError(f"window_size must be a positive integer, got {self.window_size!r}")
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(
                f"kernel_size must be a positive odd integer (same-length pooling), got {self.kernel_size!r}"
            )
        check_fraction(self.mass, "mass")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        PROJECTED_VALUE_NORM.check_name(self.backend)

    def post_init_from_model(self, model):
        check_attention_supports_masking(model.config, type(self).__name__)

    def layer_scores(self, layer: LayerInput, n_kept: int):
        """``(B, H_kv, T)`` float32 scores of one layer for ``n_kept`` entries per head on average (forced entries,
        stage 1 and the window, at ``finfo(float32).max``; the layer's excluded entries at ``-inf``)."""
        k_len = layer.keys.shape[2]
        window = self.window_size if k_len > self.window_size else max(1, k_len // 2)
        attention = window_attention(layer, window)
        projected_norm = layer.projected_norm(self.norm, self.backend)
        scores, _ = defensive_scores(attention, projected_norm, n_kept, self.kernel_size, self.mass, layer.excluded)
        return layer.mask_excluded(scores)

    def keep_mask(self, layer: LayerInput, n_kept: int) -> torch.Tensor:
        """``(B, H_kv, T)`` bool: one top-``n_kept * H_kv`` over the layer's KV heads (an explicit budget)."""
        check_attention_supports_masking(layer.module.config, type(self).__name__)
        scores = self.layer_scores(layer, n_kept)
        return global_top_mask(scores, n_kept * scores.shape[1])

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        _, num_kv_heads, k_len, _ = keys.shape
        n_kept = compute_n_kept(k_len, self.compression_ratio)
        keep = self.keep_mask(LayerInput.from_compress(module, hidden_states, keys, values, attentions, kwargs), n_kept)
        set_masked_key_indices(module, keep, num_kv_heads * (k_len - n_kept))
        return keys, values


__all__ = ["DefensiveKVPress"]
