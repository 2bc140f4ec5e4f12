"""Ops of kvpress-critical: references (``naive``), backends, and the dispatch function."""

from kvpress_critical.ops.naive import projected_value_norm_ref
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

__all__ = [
    "NORMS",
    "Backend",
    "BackendUnavailableError",
    "available_backends",
    "projected_value_norm",
    "projected_value_norm_ref",
    "register_backend",
    "registered_backends",
    "resolve_backend",
]
