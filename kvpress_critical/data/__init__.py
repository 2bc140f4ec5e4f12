"""Offline evaluation data for kvpress-critical."""

from kvpress_critical.data.ruler import (
    RULER_TASKS,
    generate_ruler_dataset,
    load_ruler_dataset,
    save_ruler_dataset,
)

__all__ = ["RULER_TASKS", "generate_ruler_dataset", "load_ruler_dataset", "save_ruler_dataset"]
