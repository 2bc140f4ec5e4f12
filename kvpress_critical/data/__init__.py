"""Evaluation data for kvpress-critical: RULER-style tasks and the quality benchmark's planted facts (offline), and
SCBench's multi-turn tasks in kvpress's columns."""

from kvpress_critical.data.quality import QUALITY_TASKS, generate_quality_dataset
from kvpress_critical.data.ruler import (
    RULER_TASKS,
    generate_ruler_dataset,
    load_ruler_dataset,
    save_ruler_dataset,
)
from kvpress_critical.data.scbench import generate_scbench_dataset

GENERATORS = {"ruler": generate_ruler_dataset, "quality": generate_quality_dataset, "scbench": generate_scbench_dataset}
"""Dataset generators by the name a preset's ``generate: {generator: ...}`` block gives (default ``ruler``)."""
SCORERS = {"scbench": "scbench"}
"""The scorer of a generator's datasets, where it is not kvpress's RULER scorer."""

__all__ = [
    "GENERATORS",
    "QUALITY_TASKS",
    "RULER_TASKS",
    "generate_quality_dataset",
    "SCORERS",
    "generate_ruler_dataset",
    "generate_scbench_dataset",
    "load_ruler_dataset",
    "save_ruler_dataset",
]
