"""Ops of kvpress-critical, one folder per op: its reference (``naive``), its backends and one dispatch function.

- :mod:`~kvpress_critical.ops.projected_norm`: :func:`projected_value_norm` (CriticalKV's ``N_i``), backends
  ``torch``, ``cpp``, ``cuda``, ``triton``;
- :mod:`~kvpress_critical.ops.ragged_attention`: :func:`ragged_attention` (attention over the compact per-head KV
  layout), backends ``torch``, ``cpp``, ``triton``, ``flash``.

Both choose their backend through an :class:`~kvpress_critical.ops.registry.OpRegistry`; the C++/CUDA backends load
the extension through :mod:`~kvpress_critical.ops.extension` (compiled on first use), the Triton ones share
:mod:`~kvpress_critical.ops.triton_utils`.

``kvpress_critical.ops.ragged_attention`` as an attribute is the op (the function); its folder's other names import
as ``from kvpress_critical.ops.ragged_attention import RAGGED_ATTENTION, random_layout, ...``.
"""

from kvpress_critical.ops.projected_norm import (
    NORMS,
    PROJECTED_NORM,
    available_backends,
    projected_value_norm,
    projected_value_norm_ref,
    register_backend,
    registered_backends,
    resolve_backend,
)
from kvpress_critical.ops.ragged_attention import RAGGED_ATTENTION, ragged_attention, ragged_attention_ref
from kvpress_critical.ops.registry import Backend, BackendUnavailableError, OpRegistry

__all__ = [
    "NORMS",
    "OpRegistry",
    "PROJECTED_NORM",
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
