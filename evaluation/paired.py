"""
Per-sample comparison of a CriticalKV run with its base run on string-match data (RULER format).

kvpress's RULER scorer only writes per-task averages; the per-sample match is recomputed here from
``predictions.csv`` and used only when it reproduces the run's ``metrics.json`` exactly.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pandas as pd

from evaluation.registry import critical_base

logger = logging.getLogger(__name__)

_CONTROL = re.compile(r"[\x00-\x1f]")


def _answers(value) -> list[str]:
    """
    The reference answers of a predictions.csv cell.

    pandas writes the list column as numpy prints it (``['a' 'b']``, no commas; ``ast.literal_eval`` would
    concatenate the strings), or as a Python list (``['a', 'b']``): the quoted strings are the answers.
    """
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    text = str(value)
    quoted = re.findall(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"", text)
    return [single or double for single, double in quoted] or [text]


def sample_matches(predictions: pd.DataFrame) -> pd.Series:
    """
    Per-sample string match, the quantity kvpress's RULER scorer averages per task: control characters are
    removed from the prediction, then the fraction of reference answers it contains (case-insensitive), or
    whether it contains any of them for ``qa`` tasks.
    """
    preds = predictions["predicted_answer"].fillna("").astype(str).map(lambda x: _CONTROL.sub("", x.strip()).strip())
    refs = predictions["answer"].map(_answers)
    tasks = predictions["task"] if "task" in predictions.columns else pd.Series("", index=predictions.index)
    scores = []
    for pred, ref, task in zip(preds.str.lower(), refs, tasks):
        hits = [r.lower() in pred for r in ref]
        scores.append((max(hits) if str(task).startswith("qa") else sum(hits) / len(hits)) if hits else math.nan)
    return pd.Series(scores, index=predictions.index, dtype=float)


def _consistent(predictions: pd.DataFrame, scores: dict[str, float]) -> bool:
    """Whether per-sample matches average to the run's metrics (else pairing would not mean the same thing)."""
    per_task = (100 * sample_matches(predictions)).groupby(predictions["task"]).mean().round(2)
    return all(abs(per_task.get(task, math.nan) - score) < 0.02 for task, score in scores.items())


def paired_samples(runs: list[dict]) -> pd.DataFrame:
    """
    For each CriticalKV run and its base run on the same string-match data: samples, on how many each one
    scores higher (per-sample string match), and ties. Runs whose rows do not align are skipped.
    """
    by_key = {(r["model"], r["benchmark"], r["press"], r["compression_ratio"]): r for r in runs}
    rows = []
    for (model, benchmark, press, ratio), run in by_key.items():
        base = critical_base(press)
        base_run = by_key.get((model, benchmark, base, ratio))
        if base_run is None or run["per_task_runs"]:
            continue
        try:
            crit_df = pd.read_csv(Path(run["folder"]) / "predictions.csv")
            base_df = pd.read_csv(Path(base_run["folder"]) / "predictions.csv")
        except FileNotFoundError:
            continue
        needed = {"predicted_answer", "answer", "task", "question"}
        if not needed <= set(crit_df.columns) or not needed <= set(base_df.columns) or len(crit_df) != len(base_df):
            continue
        if not (crit_df["question"].equals(base_df["question"]) and crit_df["task"].equals(base_df["task"])):
            continue
        if not (_consistent(crit_df, run["scores"]) and _consistent(base_df, base_run["scores"])):
            logger.warning("per-sample matches of %s / %s do not reproduce their metrics: not paired", press, base)
            continue
        crit, base_m = sample_matches(crit_df), sample_matches(base_df)
        rows.append(
            {
                "model": model,
                "benchmark": benchmark,
                "compression_ratio": ratio,
                "base": base,
                "critical": press,
                "n_samples": len(crit_df),
                "critical_better": int((crit > base_m).sum()),
                "base_better": int((crit < base_m).sum()),
                "ties": int((crit == base_m).sum()),
            }
        )
    return pd.DataFrame(rows)
