"""kvpress-critical: CriticalKV (arXiv 2502.03805) as a first-class, fast extension of NVIDIA's kvpress.

Importing this package imports kvpress, which registers the ``"kv-press-text-generation"`` pipeline and
patches attention functions for head-wise masking. The ops (``kvpress_critical.ops``: the projected-value
norm and its backends) need only torch: where kvpress is not installed (e.g. a GPU machine checking the
kernels), the package still imports and the presses raise an ``ImportError`` that says what to install.
"""

from kvpress_critical._version import __version__
from kvpress_critical.ops import available_backends, projected_value_norm

_PRESSES = (
    "ChunkedPrefillPress",
    "CompactCachePress",
    "CriticalAdaKVPress",
    "CriticalHeadKVPress",
    "CriticalKVPress",
    "DefensiveKVPress",
    "HeadKVPress",
    "LayerDefensiveKVPress",
)

try:
    import kvpress  # noqa: F401  (registers the pipeline and the attention patch)
except ImportError as error:  # the ops work without kvpress; the presses do not
    _KVPRESS_ERROR: ImportError | None = error
else:
    _KVPRESS_ERROR = None
    from kvpress_critical.presses import (  # noqa: F401
        ChunkedPrefillPress,
        CompactCachePress,
        CriticalAdaKVPress,
        CriticalHeadKVPress,
        CriticalKVPress,
        DefensiveKVPress,
        HeadKVPress,
        LayerDefensiveKVPress,
    )

__all__ = [*_PRESSES, "__version__", "available_backends", "projected_value_norm"]


def __getattr__(name: str):
    if name in _PRESSES and _KVPRESS_ERROR is not None:
        raise ImportError(
            f"kvpress_critical.{name} needs kvpress, which failed to import ({_KVPRESS_ERROR}). Install it with "
            "`pip install 'kvpress>=0.5.5,<0.6'` (it needs transformers>=4.56,<5.3); the ops in "
            "kvpress_critical.ops work without it."
        ) from _KVPRESS_ERROR
    raise AttributeError(f"module 'kvpress_critical' has no attribute {name!r}")
