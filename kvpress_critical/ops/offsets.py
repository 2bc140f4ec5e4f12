"""Device copies of a ragged layout's host offsets (``cu_seqlens``), made once per offsets tensor.

The compact layer keeps its ``cu_seqlens`` on the host (validating it costs no synchronisation); the CUDA backends
need it on the device. Copying it at every call would add a small synchronous host-to-device copy per layer and per
decoding step, so the copy is cached for as long as the host tensor lives (layouts are rebuilt, never edited).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def offsets_on(cu_seqlens: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``cu_seqlens`` on ``device`` as ``dtype`` (the tensor itself when it already is)."""
    if cu_seqlens.device == device and cu_seqlens.dtype == dtype:
        return cu_seqlens
    copies = _COPIES.setdefault(cu_seqlens, {})
    key = (str(device), dtype)
    if key not in copies:
        copies[key] = cu_seqlens.to(device=device, dtype=dtype)
    return copies[key]
