"""kvpress-critical: CriticalKV (arXiv 2502.03805) as a first-class, fast extension of NVIDIA's kvpress.

The presses import kvpress when they are first used (``from kvpress_critical import CriticalKVPress``), which
registers kvpress's ``"kv-press-text-generation"`` pipeline and patches attention functions for head-wise masking.
The ops (:mod:`kvpress_critical.ops`: the projected-value norm, the ragged attention of the compact cache and its
paged variant, their backends) need only torch: ``import kvpress_critical`` and the ops work where kvpress is not
installed (a GPU machine checking the kernels), and a press asked for there raises an ``ImportError`` that says what
to install.
"""

import importlib

from kvpress_critical._version import __version__
from kvpress_critical.ops.paged_ragged_attention import paged_ragged_attention
from kvpress_critical.ops.projected_value_norm import PROJECTED_VALUE_NORM, projected_value_norm
from kvpress_critical.ops.ragged_attention import ragged_attention

_PRESSES = (
    "ChunkedPrefillPress",
    "CompactCachePress",
    "CompactDecodingCachePress",
    "CriticalAdaKVPress",
    "CriticalHeadKVPress",
    "CriticalKVPress",
    "DefensiveKVPress",
    "HeadKVPress",
    "LayerDefensiveKVPress",
)

# the names that need kvpress, and the module of each
_LAZY = {**{name: "kvpress_critical.presses" for name in _PRESSES}, "Conversation": "kvpress_critical.conversation"}

__all__ = [
    *_LAZY,
    "__version__",
    "available_backends",
    "paged_ragged_attention",
    "projected_value_norm",
    "ragged_attention",
]


def available_backends(device=None) -> list[str]:
    """The projected-norm backends usable here (``device``: only those running on it); the ops' registries, e.g.
    ``kvpress_critical.ops.RAGGED_ATTENTION.available()``, answer for each op."""
    return PROJECTED_VALUE_NORM.available(device)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvpress_critical' has no attribute {name!r}")
    try:
        module = importlib.import_module(_LAZY[name])
    except ImportError as error:
        if error.name is None or not error.name.startswith("kvpress") or error.name.startswith("kvpress_critical"):
            raise
        raise ImportError(
            f"kvpress_critical.{name} needs kvpress, which failed to import ({error}). Install it with "
            "`pip install 'kvpress>=0.5.5,<0.6'` (it needs transformers>=4.56,<5.3); the ops in "
            "kvpress_critical.ops work without it."
        ) from error
    value = getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
