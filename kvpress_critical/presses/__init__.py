"""The presses of kvpress-critical."""

from kvpress_critical.presses.chunked_prefill_press import ChunkedPrefillPress
from kvpress_critical.presses.compact_cache_press import CompactCachePress, CompactDecodingCachePress
from kvpress_critical.presses.critical_adakv_press import CriticalAdaKVPress
from kvpress_critical.presses.critical_headkv_press import CriticalHeadKVPress
from kvpress_critical.presses.critical_kv_press import CriticalKVPress
from kvpress_critical.presses.defensivekv_press import DefensiveKVPress
from kvpress_critical.presses.headkv_press import HeadKVPress
from kvpress_critical.presses.layer_defensivekv_press import LayerDefensiveKVPress

__all__ = [
    "ChunkedPrefillPress",
    "CompactCachePress",
    "CompactDecodingCachePress",
    "CriticalAdaKVPress",
    "CriticalHeadKVPress",
    "CriticalKVPress",
    "DefensiveKVPress",
    "HeadKVPress",
    "LayerDefensiveKVPress",
]
