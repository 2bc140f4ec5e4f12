"""Turning one layer of a ``DynamicCache`` that a press has just compressed into a :class:`CompactLayer`."""

from __future__ import annotations

import torch
from torch import nn

from kvpress_critical.cache.compact import DEFAULT_RESERVE, CompactLayer
from kvpress_critical.cache.windows import keep_mask_from_indices


def compact_layer(
    cache,
    layer_idx: int,
    module: nn.Module,
    reserve: int = DEFAULT_RESERVE,
    keep: torch.Tensor | None = None,
    quantize: str | None = None,
) -> CompactLayer | None:
    """
    Replace ``cache.layers[layer_idx]`` (dense, just compressed) by its compact layout.

    The entries kept are ``keep`` (``(B, H_kv, T)`` bool) when given, else those not listed in
    ``module.masked_key_indices`` (head-wise presses), or all of the layer's entries (pruning presses already dropped
    the others); the masks are then cleared, since the compact layer holds only kept entries. ``quantize``: store the
    kept entries as ``"int8"`` or ``"int4"`` codes. Returns the new layer, or ``None`` when the layer is left as it is
    (already compact, empty).
    """
    layer = cache.layers[layer_idx]
    if isinstance(layer, CompactLayer) or layer.keys is None or layer.keys.numel() == 0:
        return None
    keys, values = layer.keys, layer.values
    if keep is None:
        keep = keep_mask_from_indices(getattr(module, "masked_key_indices", None), keys.shape[:3], keys.device)
    compact = CompactLayer.from_keep_mask(keys, values, keep, reserve=reserve, quantize=quantize)
    cache.layers[layer_idx] = compact
    module.masked_key_indices = None
    return compact
