"""The presses of kvpress-critical."""

from kvpress_critical.presses.compact_cache_press import CompactCachePress
from kvpress_critical.presses.critical_adakv_press import CriticalAdaKVPress
from kvpress_critical.presses.critical_kv_press import CriticalKVPress

__all__ = ["CompactCachePress", "CriticalAdaKVPress", "CriticalKVPress"]
