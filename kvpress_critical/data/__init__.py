"""Offline evaluation data for kvpress-critical: RULER-style tasks and the quality benchmark's planted facts."""

from kvpress_critical.data.quality import QUALITY_TASKS, generate_quality_dataset
from kvpress_critical.data.ruler import (
    RULER_TASKS,
    generate_ruler_dataset,
    load_ruler_dataset,
    save_ruler_dataset,
)

GENERATORS = {"ruler": generate_ruler_dataset, "quality": generate_quality_dataset}
"""Dataset generators by the name a preset's ``generate: {generator: ...}`` block gives (default ``ruler``)."""

__all__ = [
    "GENERATORS",
    "QUALITY_TASKS",
    "RULER_TASKS",
    "generate_quality_dataset",
    "generate_ruler_dataset",
    "load_ruler_dataset",
    "save_ruler_dataset",
]
