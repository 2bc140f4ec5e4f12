"""Cache layouts of kvpress-critical: the compact per-head layout head-wise presses free memory with.

- :mod:`~kvpress_critical.cache.compact`: :class:`CompactLayer`, one attention layer's kept entries packed per
  (batch row, KV head), plus a dense tail for the tokens added later;
- :mod:`~kvpress_critical.cache.attention`: the attention wrapper that runs the ragged attention op on it, in
  transformers' attention functions while a press needs it or a compact layer exists;
- :mod:`~kvpress_critical.cache.convert`: turning a layer a press has compressed (pruned, or masked through
  ``module.masked_key_indices``) into a compact layer;
- :mod:`~kvpress_critical.cache.windows`: sliding windows, kvpress's masked entries as a keep mask;
- :mod:`~kvpress_critical.cache.layouts`: the views a compression after the prefill trims, per layout;
- int8 / int4 entries (``CompactLayer(quantize=...)``) are codes with one scale per entry
  (:mod:`kvpress_critical.ops.ragged_attention.codes`), read as they are by the attention kernels.
"""

from kvpress_critical.cache.attention import CompactKV, attention_wrapping
from kvpress_critical.cache.compact import DEFAULT_RESERVE, CompactLayer, LogicalView
from kvpress_critical.cache.convert import compact_layer
from kvpress_critical.cache.windows import is_sliding_layer, keep_mask_from_indices

__all__ = [
    "DEFAULT_RESERVE",
    "CompactKV",
    "CompactLayer",
    "LogicalView",
    "attention_wrapping",
    "compact_layer",
    "is_sliding_layer",
    "keep_mask_from_indices",
]
