"""Ops of kvpress-critical: references (``naive``), backends, and one dispatch function per op.

- :func:`projected_value_norm` (CriticalKV's ``N_i``), backends ``torch``, ``cpp``, ``cuda``, ``triton``;
- :func:`ragged_attention` (attention over the compact per-head KV layout), backends ``torch``, ``cpp``,
  ``triton``, ``flash``.

Both choose their backend through an :class:`~kvpress_critical.ops.registry.OpRegistry`.
"""

from kvpress_critical.ops.naive import projected_value_norm_ref, ragged_attention_ref
from kvpress_critical.ops.projected_norm import (
    NORMS,
    Backend,
    BackendUnavailableError,
    available_backends,
    projected_value_norm,
    register_backend,
    registered_backends,
    resolve_backend,
)
from kvpress_critical.ops.ragged_attention import RAGGED_ATTENTION, ragged_attention
from kvpress_critical.ops.registry import OpRegistry

__all__ = [
    "NORMS",
    "OpRegistry",
    "RAGGED_ATTENTION",
    "Backend",
    "BackendUnavailableError",
    "available_backends",
    "projected_value_norm",
    "projected_value_norm_ref",
    "ragged_attention",
    "ragged_attention_ref",
    "register_backend",
    "registered_backends",
    "resolve_backend",
]
