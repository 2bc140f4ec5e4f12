"""Entries a press must not select: the padding and the already-evicted entries of a chunked prefill.

During a chunked prefill (:class:`~kvpress_critical.ChunkedPrefillPress`), a layer is compressed again after every
chunk, on a dense view of what it holds: for a masking layout the evicted entries are still there (masked), for the
compact layout each head's entries are padded to a common length. Those entries must neither be selected nor weigh
in the scores of the others. While :func:`excluding` is active, the window attention of the presses of this package
gives them no attention (:mod:`~kvpress_critical.presses.window_attention`), and :func:`mask_excluded` sets their
scores to ``-inf``.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch

_EXCLUDED: contextvars.ContextVar = contextvars.ContextVar("kvpress_critical_excluded", default=None)


def excluded_entries() -> torch.Tensor | None:
    """``(B, H_kv, T)`` bool of the entries to leave out, or None (nothing excluded)."""
    return _EXCLUDED.get()


@contextmanager
def excluding(mask: torch.Tensor | None):
    """Exclude ``mask``'s entries from selection and from the window attention inside the block."""
    token = _EXCLUDED.set(mask)
    try:
        yield
    finally:
        _EXCLUDED.reset(token)


def mask_excluded(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (``(B, H_kv, T)``) with the excluded entries at ``-inf`` (unchanged when nothing is excluded)."""
    mask = _EXCLUDED.get()
    if mask is None or mask.shape != scores.shape:
        return scores
    return scores.masked_fill(mask.to(scores.device), float("-inf"))
