from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvpress_critical.capabilities import Capabilities
from kvpress_critical.modeling import check_attention_supports_masking, hooked_attention_modules
from kvpress_critical.presses.defensivekv_press import DefensiveKVPress
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.presses.masking import set_masked_key_indices
from kvpress_critical.selection import compute_n_kept, global_top_mask


@dataclass
class LayerDefensiveKVPress(DefensiveKVPress):
    """
    Layer-DefensiveKV: DefensiveKV's scores, with one budget shared by all layers and heads.

    Every layer is scored during the prefill as :class:`DefensiveKVPress` does, but nothing is compressed until the
    last layer has been scored: then one top-``n_kept * H_kv * n_layers`` per batch row over every layer's and head's
    scores decides what each layer keeps (the forced entries of every layer, first stage and window, always fit).
    Layers therefore keep different totals; the overall budget is exactly the press's. The selection is recorded as
    ``masked_key_indices`` on every layer at once (or compacted by :class:`~kvpress_critical.CompactCachePress` after
    the prefill).

    Its parameters are :class:`DefensiveKVPress`'s.

    Based on DefensiveKV (Feng et al., ICLR 2026).
    """

    # not budgeted: its budget is shared by all layers, so no single layer can be given one (no keep_mask)
    capabilities: ClassVar[Capabilities] = Capabilities(
        selection="head-wise",
        applies_criticalkv=True,
        normalises_across_heads=True,
        scores_exclusions=True,
        selects_after_last_layer=True,
    )

    _modules: list = field(default_factory=list, init=False, repr=False, compare=False)
    _pending: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    last_selection: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # layer -> keep mask

    def post_init_from_model(self, model):
        super().post_init_from_model(model)
        self._modules = hooked_attention_modules(model)  # the layers kvpress's hooks call
        self._pending = {}

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        check_attention_supports_masking(module.config, type(self).__name__)
        if not self._modules:
            raise RuntimeError(
                "LayerDefensiveKVPress needs to know the model's layers: use it through `with press(model)` or "
                "kvpress's pipeline (they call post_init_from_model)"
            )
        if module is self._modules[0]:
            self._pending = {}  # a new prefill
        n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
        layer = LayerInput.from_compress(module, hidden_states, keys, values, attentions, kwargs)
        scores = self.layer_scores(layer, n_kept)
        self._pending[module.layer_idx] = (module, scores, n_kept)
        module.masked_key_indices = None
        if module is self._modules[-1]:
            self._select_all()
        return keys, values

    def keep_mask(self, layer: LayerInput, n_kept: int) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} selects every layer at once after the last one: it has no per-layer selection "
            "(use DefensiveKVPress for per-layer budgets)"
        )

    def _select_all(self) -> None:
        entries = [self._pending[m.layer_idx] for m in self._modules if m.layer_idx in self._pending]
        self._pending = {}
        lengths = {scores.shape[-1] for _, scores, _ in entries}
        if len(lengths) != 1:
            raise RuntimeError(f"Layer-DefensiveKV needs the same context length in every layer, got {sorted(lengths)}")
        stacked = torch.stack([scores for _, scores, _ in entries], dim=1)  # (B, L, H_kv, T)
        n_total = sum(n_kept * scores.shape[1] for _, scores, n_kept in entries)
        keep = global_top_mask(stacked, n_total)
        self.last_selection = {module.layer_idx: keep[:, i] for i, (module, _, _) in enumerate(entries)}
        for index, (module, _, _) in enumerate(entries):
            layer_keep = keep[:, index]
            if bool((layer_keep.sum((1, 2)) == layer_keep[0].sum()).all()):  # same count in every row
                set_masked_key_indices(module, layer_keep, layer_keep[0].numel() - int(layer_keep[0].sum()))
            else:
                module.masked_key_indices = tuple((~layer_keep).nonzero(as_tuple=True))


__all__ = ["LayerDefensiveKVPress"]
