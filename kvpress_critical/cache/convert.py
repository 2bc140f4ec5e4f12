"""Turning one layer of a ``DynamicCache`` that a press has just compressed into a :class:`CompactLayer`."""

from __future__ import annotations

import torch
from torch import nn

from kvpress_critical.cache.compact import DEFAULT_RESERVE, CompactLayer


def effective_window(module: nn.Module, window: int | None) -> int | None:
    """``window``, or ``None`` when it cannot bind: not smaller than the model's ``max_position_embeddings``
    (Phi-3-mini-128k and Phi-3.5 configure 262144 for a 131072-position model: full attention in effect)."""
    limit = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    if window is None or (isinstance(limit, int) and window >= limit):
        return None
    return window


def layer_sliding_window(module: nn.Module) -> int | None:
    """The sliding window a layer's attention uses (``None``: full attention, or a window that cannot bind).

    Gemma3, Qwen2 and Qwen3 keep it per layer (``module.sliding_window``); Mistral and Phi-3 pass their config's.
    """
    if hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return effective_window(module, window)


def is_sliding_layer(module: nn.Module) -> bool:
    """Whether the layer attends through a sliding window (its cache stays dense: the compact op has no window)."""
    return layer_sliding_window(module) is not None


def keep_mask_from_indices(masked_key_indices, shape: tuple[int, int, int], device) -> torch.Tensor:
    """``(B, H_kv, T)`` bool: True except at kvpress's ``masked_key_indices = (batch, head, seq)``."""
    keep = torch.ones(shape, dtype=torch.bool, device=device)
    if masked_key_indices is not None:
        b, h, s = (i.to(device) for i in masked_key_indices)
        keep[b, h, s] = False
    return keep


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
