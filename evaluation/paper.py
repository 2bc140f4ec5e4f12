"""
The paper's numbers beside ours: one table per experiment (main LongBench results, appendix B.1, B.2, B.5, C.1).

``evaluation/paper_numbers.yaml`` lists the scores the CriticalKV paper reports, each attributable to one
configuration (model, benchmark, press, cache size, task). :func:`paper_comparison` joins them with an aggregated
``summary.csv`` (:func:`evaluation.aggregate.summarize`) on those keys; :func:`paper_markdown` lays each experiment
out like the paper (a row per press, a column per cache size), each cell ``ours (paper, ours - paper)``. Cells the
paper reports and the results do not have read ``– (paper)``; configurations of the experiment's presets the paper
has no number for show ours alone. The aggregation writes ``summary/paper.md`` when any experiment's model and
benchmark are among the results.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import yaml

PAPER_NUMBERS = Path(__file__).resolve().with_name("paper_numbers.yaml")
AVERAGE = "average"


def paper_numbers(path: str | Path = PAPER_NUMBERS) -> dict:
    """The experiments of ``paper_numbers.yaml``: ``{name: {title, benchmark, notes, presses, entries}}``."""
    experiments = yaml.safe_load(Path(path).read_text())["experiments"]
    for name, experiment in experiments.items():
        for key in ("title", "benchmark", "entries"):
            if key not in experiment:
                raise ValueError(f"{path}: experiment {name!r} has no {key!r}")
    return experiments


def paper_comparison(summary: pd.DataFrame, experiments: dict | None = None) -> pd.DataFrame:
    """
    One row per experiment and cell: ``experiment, model, benchmark, press, cache_size, task, paper, ours,
    difference`` for every number of the paper, plus our results for the experiment's presses the paper has no
    number for (``paper`` NaN), on the models and benchmark the experiment covers.
    """
    experiments = paper_numbers() if experiments is None else experiments
    columns = ["experiment", "model", "benchmark", "press", "cache_size", "task", "paper", "ours", "difference"]
    rows = []
    for name, experiment in experiments.items():
        benchmark = experiment["benchmark"]
        ours = summary[summary["benchmark"] == benchmark] if not summary.empty else summary
        paper = {}
        for entry in experiment["entries"]:
            key = (entry["model"], entry["press"], float(entry["cache"]), entry.get("task", AVERAGE))
            paper[key] = float(entry["score"])
        models = {model for model, *_ in paper}
        tasks = sorted({task for *_, task in paper})
        presses = set(experiment.get("presses") or ()) | {press for _, press, _, _ in paper}
        keys = set(paper)
        if not ours.empty:
            for row in ours[ours["model"].isin(models) & ours["press"].isin(presses)].itertuples():
                keys |= {(row.model, row.press, float(row.cache_size), task) for task in tasks}
        for model, press, cache, task in sorted(keys):
            value = math.nan
            if not ours.empty and task in ours.columns:
                match = ours[(ours["model"] == model) & (ours["press"] == press) & (ours["cache_size"] == cache)]
                if len(match):
                    value = float(match.iloc[0][task])
            reported = paper.get((model, press, cache, task), math.nan)
            rows.append(
                dict(
                    experiment=name,
                    model=model,
                    benchmark=benchmark,
                    press=press,
                    cache_size=cache,
                    task=task,
                    paper=reported,
                    ours=value,
                    difference=value - reported,
                )
            )
    return pd.DataFrame(rows, columns=columns)


def _cell(ours: float, paper: float) -> str:
    if math.isfinite(ours) and math.isfinite(paper):
        return f"{ours:.2f} ({paper:.2f}, {ours - paper:+.2f})"
    if math.isfinite(ours):
        return f"{ours:.2f}"
    return f"– ({paper:.2f})" if math.isfinite(paper) else "–"


def paper_markdown(comparison: pd.DataFrame, experiments: dict | None = None) -> str:
    """The experiments as markdown tables: a row per press (and task), a column per cache size."""
    if comparison.empty or not comparison["ours"].notna().any():
        return ""
    experiments = paper_numbers() if experiments is None else experiments
    lines = [
        "# The paper's numbers beside ours",
        "",
        "Each cell: ours (the paper's, ours - paper); `– (x)`: reported by the paper, not run here.",
        "",
    ]
    for name, group in comparison.groupby("experiment", sort=False):
        if not group["ours"].notna().any():
            continue
        experiment = experiments.get(name, {})
        lines += [f"## {experiment.get('title', name)}", ""]
        if experiment.get("notes"):
            lines += [" ".join(str(experiment["notes"]).split()), ""]
        for model, cells in group.groupby("model", sort=True):
            caches = sorted(cells["cache_size"].unique(), reverse=True)
            lines += [f"### {model}", "", "| press | " + " | ".join(f"{c:g}%" for c in caches) + " |"]
            lines.append("|---|" + "---|" * len(caches))
            for (press, task), row_cells in cells.groupby(["press", "task"], sort=False):
                label = press if task == AVERAGE else f"{press} — {task}"
                by_cache = {c.cache_size: c for c in row_cells.itertuples()}
                values = [_cell(by_cache[c].ours, by_cache[c].paper) if c in by_cache else "" for c in caches]
                lines.append(f"| {label} | " + " | ".join(values) + " |")
            lines.append("")
    return "\n".join(lines) + "\n"
