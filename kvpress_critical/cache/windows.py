"""Which entries and windows a layer's attention sees: sliding windows, kvpress's masked entries as a keep mask."""

from __future__ import annotations

import torch
from torch import nn


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
