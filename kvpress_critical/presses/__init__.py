"""The presses of kvpress-critical."""

from kvpress_critical.presses.critical_adakv_press import CriticalAdaKVPress
from kvpress_critical.presses.critical_kv_press import CriticalKVPress

__all__ = ["CriticalAdaKVPress", "CriticalKVPress"]
