"""kvpress-critical: CriticalKV (arXiv 2502.03805) as a first-class, fast extension of NVIDIA's kvpress.

Importing this package imports kvpress, which registers the ``"kv-press-text-generation"`` pipeline and
patches attention functions for head-wise masking.
"""

import kvpress  # noqa: F401  (registers the pipeline and the attention patch)

from kvpress_critical.ops import available_backends, projected_value_norm
from kvpress_critical.presses import CriticalAdaKVPress, CriticalKVPress

__version__ = "0.1.0"

__all__ = [
    "CriticalAdaKVPress",
    "CriticalKVPress",
    "available_backends",
    "projected_value_norm",
]
