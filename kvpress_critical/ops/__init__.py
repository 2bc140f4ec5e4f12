"""Ops of kvpress-critical, one folder per op: its reference (``naive``), its backends and one dispatch function.

Each op folder exposes the same names: the op, its float64 reference (``<op>_ref``), its backend registry
(``<OP>``, an :class:`~kvpress_critical.ops.registry.OpRegistry`: ``.available(device)``, ``.register(backend)``,
``.resolve(name, device)``) and its ``"auto"`` preference order (``AUTO_ORDER``):

- :mod:`~kvpress_critical.ops.projected_value_norm`: ``projected_value_norm`` (CriticalKV's ``N_i``), backends
  ``torch``, ``cpp``, ``cuda``, ``triton``;
- :mod:`~kvpress_critical.ops.ragged_attention`: ``ragged_attention`` (attention over the compact per-head KV
  layout), backends ``torch``, ``cpp``, ``triton``, ``flash``;
- :mod:`~kvpress_critical.ops.paged_ragged_attention`: ``paged_ragged_attention`` (the same over head-wise entries
  kept inside a paged cache's blocks, as the vLLM plugin keeps them), backends ``torch``, ``cpp``, ``triton``.

The op functions are imported from their folder (``from kvpress_critical.ops.ragged_attention import
ragged_attention``) or from the package root (``kvpress_critical.projected_value_norm``,
``kvpress_critical.ragged_attention``): this package binds no name over its submodules.
``$KVPRESS_CRITICAL_<OP>_BACKEND`` (``KVPRESS_CRITICAL_PROJECTED_VALUE_NORM_BACKEND``,
``KVPRESS_CRITICAL_RAGGED_ATTENTION_BACKEND``, ``KVPRESS_CRITICAL_PAGED_RAGGED_ATTENTION_BACKEND``) replaces ``"auto"``.
The C++/CUDA backends load the extension through :mod:`~kvpress_critical.ops.extension` (compiled on first use), the
Triton ones share :mod:`~kvpress_critical.ops.triton_utils`.
"""

from kvpress_critical.ops.paged_ragged_attention import PAGED_RAGGED_ATTENTION
from kvpress_critical.ops.projected_value_norm import NORMS, PROJECTED_VALUE_NORM
from kvpress_critical.ops.ragged_attention import RAGGED_ATTENTION
from kvpress_critical.ops.registry import Backend, BackendUnavailableError, OpRegistry

__all__ = [
    "NORMS",
    "PAGED_RAGGED_ATTENTION",
    "PROJECTED_VALUE_NORM",
    "RAGGED_ATTENTION",
    "Backend",
    "BackendUnavailableError",
    "OpRegistry",
]
