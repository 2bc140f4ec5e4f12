"""Projected-value norms computed once per entry while a prefill is compressed chunk after chunk.

The projected-value norm of an entry, ``N_i = mean_g ||V_i W_O^g||``, depends on that entry's value only: once it is
known, scoring the same entry again (after the next chunk of a chunked prefill) needs no new computation. While
:func:`reusing_norms` is active, :func:`~kvpress_critical.modeling.module_projected_norm` takes the norms of the first
entries of ``values`` from ``known`` (``norm name -> (B, H_kv, L_known)`` float32, the entries in the same order) and
computes only the rest; every full result is recorded in :attr:`NormReuse.computed` so that the caller can keep the
norms of the entries that stay. Exact: the same numbers per entry as computing them all (each backend's result for an
entry does not depend on the other entries), so selections do not change.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("kvpress_critical_norm_reuse", default=None)


@dataclass
class NormReuse:
    """What one compression may reuse (``known``) and what it computed (``computed``), by norm name."""

    known: dict = field(default_factory=dict)
    computed: dict = field(default_factory=dict)
    reused_entries: int = 0  # for tests and benchmarks: how many entries' norms were not recomputed


@contextmanager
def reusing_norms(known: dict | None = None):
    """Inside the block, projected norms of the first entries come from ``known`` (module docstring)."""
    state = NormReuse(dict(known or {}))
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)


def projected_norm_reusing(values: torch.Tensor, norm: str, compute: Callable[[torch.Tensor], torch.Tensor]):
    """``compute(values)`` (``(B, H_kv, T, d)`` -> ``(B, H_kv, T)``), computing only the entries not known."""
    state = _ACTIVE.get()
    if state is None:
        return compute(values)
    known = state.known.get(norm)
    if known is not None and known.shape[:2] == values.shape[:2] and 0 < known.shape[2] <= values.shape[2]:
        n_known = known.shape[2]
        new = compute(values[:, :, n_known:]) if n_known < values.shape[2] else known[:, :, :0]
        result = torch.cat([known.to(device=new.device, dtype=new.dtype), new], dim=2)
        state.reused_entries += known.numel()
    else:
        result = compute(values)
    state.computed[norm] = result
    return result


__all__ = ["NormReuse", "projected_norm_reusing", "reusing_norms"]
