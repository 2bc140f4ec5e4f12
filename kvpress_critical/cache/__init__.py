"""Cache layouts of kvpress-critical: the compact per-head layout head-wise presses free memory with.

- :mod:`~kvpress_critical.cache.compact`: :class:`CompactLayer`, one attention layer's kept entries packed per
  (batch row, KV head), plus a dense tail for the tokens added later;
- :mod:`~kvpress_critical.cache.attention`: the attention wrapper that runs the ragged attention op on it;
- :mod:`~kvpress_critical.cache.convert`: turning a layer a press has compressed (pruned, or masked through
  ``module.masked_key_indices``) into a compact layer.
"""

from kvpress_critical.cache.attention import install as install_attention
from kvpress_critical.cache.compact import DEFAULT_RESERVE, CompactKV, CompactLayer, LogicalView
from kvpress_critical.cache.convert import compact_layer, is_sliding_layer, keep_mask_from_indices

__all__ = [
    "DEFAULT_RESERVE",
    "CompactKV",
    "CompactLayer",
    "LogicalView",
    "compact_layer",
    "install_attention",
    "is_sliding_layer",
    "keep_mask_from_indices",
]
