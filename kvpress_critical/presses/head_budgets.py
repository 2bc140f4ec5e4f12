"""HeadKV's offline budgets as a press needs them: head scores loaded once per model, per-layer budgets cached."""

import torch
from kvpress import SnapKVPress
from torch import nn

from kvpress_critical.modeling import check_attention_supports_masking
from kvpress_critical.presses.base_scores import base_scores
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.presses.masking import set_masked_key_indices
from kvpress_critical.selection import compute_n_kept, headkv_budgets


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

    def scores_and_budgets(self, layer: LayerInput, n_kept: int):
        """``(base scores (B, H_kv, T), budgets (B, H_kv))`` of a layer for ``n_kept`` entries per head on average."""
        check_attention_supports_masking(layer.module.config, type(self).__name__)
        scores = base_scores(self.press, layer, n_kept)
        budgets = self.layer_budgets(layer.module, scores.shape[-1], n_kept)
        return scores, budgets.to(scores.device).expand(scores.shape[0], -1)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        k_len = keys.shape[2]
        n_kept = compute_n_kept(k_len, self.compression_ratio)
        keep = self.keep_mask(LayerInput.from_compress(module, hidden_states, keys, values, attentions, kwargs), n_kept)
        # the host budgets give the masked count without a sync
        n_pruned = keep[0].numel() - int(self.layer_budgets(module, k_len, n_kept).sum())
        set_masked_key_indices(module, keep, n_pruned)
        return keys, values

    def load_head_scores(self, model) -> None:
        from kvpress_critical.head_scores import head_scores_for

        scores = head_scores_for(self.head_scores, model)
        self._importance = scores.float()  # (n_layers, H) per query head
        self._num_kv_heads = getattr(model.config, "text_config", model.config).num_key_value_heads
        self._budget_cache = {}

    def layer_budgets(self, module: nn.Module, k_len: int, n_kept: int | None = None) -> torch.Tensor:
        """``(H_kv,)`` int64 host budgets of a layer: ``n_kept`` per head on average (default: the ratio's)."""
        if getattr(self, "_importance", None) is None:
            raise RuntimeError(
                f"{type(self).__name__} has no head scores yet: use it through `with press(model)` or kvpress's "
                "pipeline (they call post_init_from_model), or call press.post_init_from_model(model) first"
            )
        n_kept = compute_n_kept(k_len, self.compression_ratio) if n_kept is None else n_kept
        key = (k_len, n_kept)
        if key not in self._budget_cache:
            window = self.press.window_size if isinstance(self.press, SnapKVPress) else 0
            self._budget_cache[key] = headkv_budgets(
                self._importance,
                n_kept,
                k_len,
                self.beta,
                self.temperature,
                window=window if k_len > window else 0,
                num_kv_heads=self._num_kv_heads,
            )
        return self._budget_cache[key][module.layer_idx]

    def check_headkv(self) -> None:
        if not isinstance(self.beta, (int, float)) or self.beta < 1:
            raise ValueError(f"beta must be a number >= 1 (HeadKV's pool is B' // beta), got {self.beta!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature <= 0:
            raise ValueError(f"temperature must be a positive number, got {self.temperature!r}")
