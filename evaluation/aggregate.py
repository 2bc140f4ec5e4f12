"""
Aggregate a folder of kvpress evaluation results into the paper's tables and plots.

``python -m evaluation.aggregate RESULTS_DIR [--out DIR]`` (the sweep runs it at the end). It reads every
results folder (``config.yaml`` + ``metrics.json`` + ``predictions.csv``, kvpress's layout) and writes,
under ``RESULTS_DIR/summary`` by default:

- ``scores.csv``: one row per model, benchmark, press, compression ratio and task;
- ``summary.csv``: per model, benchmark, press and ratio: task scores, LongBench domain averages, the
  average score and the **loss vs full cache** ``(full - x) / full`` (in %, ``full`` = ``no_press``);
- ``critical_vs_base.csv``: each CriticalKV press next to its base press at the same cache size: both
  losses, the loss reduction (percentage points and relative) and, where predictions allow it, on how many
  samples each one scores higher (``evaluation.paired``);
- ``missing.csv``: every expected cell that has no result (configuration not run, failed or incomplete;
  task missing from a run; no ``no_press`` baseline), never silently dropped;
- ``tables.md``: the same as markdown tables laid out like the paper's (``evaluation.report``);
- ``paper.md`` / ``paper.csv``, for runs of the paper's models and benchmarks: the paper's reported numbers beside
  ours, experiment by experiment, with the difference (``evaluation.paper``);
- ``plots/<model>__<benchmark>.png``: average score vs cache size, one line per press;
- for runs with likelihood metrics (the quality benchmark, ``evaluation.quality``): ``quality.csv``,
  ``quality_comparisons.csv`` (paired bootstrap intervals), ``quality_samples.csv``, ``quality.md`` and
  ``plots/quality__<model>__<benchmark>.png``.

A benchmark is ``dataset/data_dir`` for datasets whose metrics hold several tasks (RULER: ``ruler/4096``)
and the dataset alone when each ``data_dir`` is one task (LongBench: ``longbench``, tasks = data_dirs).
The average is reported only when every expected task is present (``average_available`` covers the rest).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from pathlib import Path

import pandas as pd
import yaml

from evaluation.paired import paired_samples
from evaluation.paper import paper_comparison, paper_markdown
from evaluation.quality import (
    quality_by_turn,
    quality_comparisons,
    quality_markdown,
    quality_plot,
    quality_samples,
    quality_summary,
    quality_turns_markdown,
)
from evaluation.registry import BASELINE, critical_base
from evaluation.report import markdown_tables, plot
from evaluation.tasks import KEYS, LONGBENCH_DOMAINS, task_order
from evaluation.worker import NON_RESULT_DIRS

logger = logging.getLogger(__name__)

QUERY_AWARE = " (query-aware)"  # appended to the benchmark of runs that compress the question with the context


# ----------------------------------------------------------------------------------------------------------------
# Reading results
# ----------------------------------------------------------------------------------------------------------------


def _flatten_metrics(metrics, data_dir: str | None, dataset: str) -> tuple[dict[str, float], bool]:
    """``({task: score}, per_task_runs)``: a scalar metric means one task per data_dir (LongBench)."""
    if isinstance(metrics, (int, float)):
        return {data_dir or dataset: float(metrics)}, True
    scores = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)):
            scores[key] = float(value)
        elif isinstance(value, dict):
            numbers = {k: v for k, v in value.items() if isinstance(v, (int, float))}
            if len(numbers) == 1:
                scores[key] = float(next(iter(numbers.values())))
            else:
                scores.update({f"{key}/{k}": float(v) for k, v in numbers.items()})
    return scores, False


def read_run(folder: Path) -> dict | None:
    """One results folder as a dict (``None`` if it holds no ``config.yaml``)."""
    config_file = folder / "config.yaml"
    if not config_file.is_file():
        return None
    config = yaml.safe_load(config_file.read_text()) or {}
    run = {
        "name": folder.name,
        "folder": str(folder),
        "model": str(config.get("model")),
        "dataset": str(config.get("dataset")),
        "data_dir": None if config.get("data_dir") is None else str(config.get("data_dir")),
        "press": str(config.get("press_name")),
        # DuoAttention's runs record their head compression ratio instead (kvpress drops compression_ratio)
        "compression_ratio": float(config.get("compression_ratio", config.get("head_compression_ratio", math.nan))),
        "press_init_command": config.get("press_init_command"),
        "scores": {},
        "problems": [],
    }
    if "compression_ratio" not in config and "head_compression_ratio" not in config:
        run["problems"].append("no compression_ratio in config.yaml (threshold-based press)")
    metrics_file = folder / "metrics.json"
    if not metrics_file.is_file():
        run["problems"].append("metrics.json missing")
        run["per_task_runs"] = False
    else:
        run["scores"], run["per_task_runs"] = _flatten_metrics(
            json.loads(metrics_file.read_text()), run["data_dir"], run["dataset"]
        )
    if not (folder / "predictions.csv").is_file():
        run["problems"].append("predictions.csv missing")
    if run["per_task_runs"]:
        run["benchmark"] = run["dataset"]
    else:
        run["benchmark"] = f"{run['dataset']}/{run['data_dir']}" if run["data_dir"] else run["dataset"]
    if config.get("query_aware"):  # the question compressed with the context: another benchmark, another baseline
        run["benchmark"] += QUERY_AWARE
    run["query_aware"] = bool(config.get("query_aware"))
    return run


def read_runs(results_dir: str | os.PathLike) -> list[dict]:
    """Every results folder directly under ``results_dir`` (kvpress's layout), sorted by name."""
    runs = []
    for folder in sorted(Path(results_dir).iterdir()):
        if folder.is_dir() and folder.name not in NON_RESULT_DIRS:
            run = read_run(folder)
            if run is not None:
                runs.append(run)
    return runs


def scores_frame(runs: list[dict]) -> pd.DataFrame:
    """Long table: one row per run and task."""
    rows = [
        {
            **{k: run[k] for k in ("model", "benchmark", "dataset", "data_dir", "press", "compression_ratio", "name")},
            "task": task,
            "score": score,
        }
        for run in runs
        for task, score in run["scores"].items()
    ]
    columns = ["model", "benchmark", "dataset", "data_dir", "press", "compression_ratio", "name", "task", "score"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["compression_ratio"] = pd.to_numeric(frame["compression_ratio"])
    frame["score"] = pd.to_numeric(frame["score"])
    frame["cache_size"] = (100 * (1 - frame["compression_ratio"])).round(1)
    return frame


# ----------------------------------------------------------------------------------------------------------------
# Summaries
# ----------------------------------------------------------------------------------------------------------------


def loss(full: float, score: float) -> float:
    """Relative loss vs the full cache, in %: ``100 * (full - score) / full`` (NaN without a usable baseline)."""
    if full is None or score is None or not math.isfinite(full) or not math.isfinite(score) or full == 0:
        return math.nan
    return 100.0 * (full - score) / full


def summarize(scores: pd.DataFrame) -> pd.DataFrame:
    """
    Per model, benchmark, press and ratio: task scores, domain averages, average, loss vs full cache.

    ``average`` needs every task of the benchmark (the union of tasks seen in any of its runs);
    ``average_available`` averages whatever is there, ``n_tasks`` / ``n_expected_tasks`` tell the two apart.
    """
    if scores.empty:
        return pd.DataFrame(columns=KEYS + ["cache_size", "average", "average_available", "loss"])
    rows = []
    for (model, benchmark), group in scores.groupby(["model", "benchmark"], sort=False):
        expected = task_order(group["task"].unique())
        for (press, ratio), cell in group.groupby(["press", "compression_ratio"], sort=False):
            by_task = cell.groupby("task")["score"].mean()
            row = {"model": model, "benchmark": benchmark, "press": press, "compression_ratio": ratio}
            row["cache_size"] = round(100 * (1 - ratio), 1)
            row.update({task: by_task.get(task, math.nan) for task in expected})
            present = [t for t in expected if t in by_task.index]
            row["n_tasks"], row["n_expected_tasks"] = len(present), len(expected)
            row["average_available"] = float(by_task[present].mean()) if present else math.nan
            row["average"] = row["average_available"] if len(present) == len(expected) else math.nan
            for domain, tasks in LONGBENCH_DOMAINS.items():
                if any(t in expected for t in tasks):
                    row[domain] = float(by_task[tasks].mean()) if all(t in by_task.index for t in tasks) else math.nan
            rows.append(row)
    summary = pd.DataFrame(rows)
    summary["full_cache_average"] = math.nan
    for (model, benchmark), group in summary.groupby(["model", "benchmark"], sort=False):
        full = group.loc[group["press"] == BASELINE, "average"]
        if len(full):
            summary.loc[group.index, "full_cache_average"] = float(full.iloc[0])
    summary["loss"] = [loss(f, s) for f, s in zip(summary["full_cache_average"], summary["average"])]
    return summary


def critical_vs_base(summary: pd.DataFrame, paired: pd.DataFrame | None = None) -> pd.DataFrame:
    """Each CriticalKV press next to its base at the same model, benchmark and ratio."""
    rows = []
    if summary.empty:
        return pd.DataFrame()
    index = summary.set_index(KEYS)
    for (model, benchmark, press, ratio), row in index.iterrows():
        base = critical_base(press)
        if base is None or (model, benchmark, base, ratio) not in index.index:
            continue
        base_row = index.loc[(model, benchmark, base, ratio)]
        entry = {
            "model": model,
            "benchmark": benchmark,
            "cache_size": row["cache_size"],
            "compression_ratio": ratio,
            "base": base,
            "critical": press,
            "full_cache": row["full_cache_average"],
            "base_score": base_row["average"],
            "critical_score": row["average"],
            "base_loss": base_row["loss"],
            "critical_loss": row["loss"],
        }
        entry["loss_reduction_pp"] = entry["base_loss"] - entry["critical_loss"]
        entry["relative_loss_reduction"] = (
            100.0 * entry["loss_reduction_pp"] / entry["base_loss"] if entry["base_loss"] > 0 else math.nan
        )
        rows.append(entry)
    frame = pd.DataFrame(rows)
    if paired is not None and not paired.empty and not frame.empty:
        frame = frame.merge(paired, on=["model", "benchmark", "compression_ratio", "base", "critical"], how="left")
    return frame


# ----------------------------------------------------------------------------------------------------------------
# Missing cells
# ----------------------------------------------------------------------------------------------------------------


def missing_cells(
    runs: list[dict], scores: pd.DataFrame, results_dir: Path, expected: list[tuple[str, dict]] | None = None
) -> pd.DataFrame:
    """
    Every expected result that is absent, with the reason.

    ``expected`` is the sweep's list of ``(results folder name, kvpress config)``; without it the grid is
    inferred: per model and benchmark, every press seen x every ratio seen, plus the ``no_press`` baseline.
    """
    rows = []
    present = {run["name"]: run for run in runs}
    for run in runs:
        for problem in run["problems"]:
            rows.append({**_cell(run), "task": "", "reason": problem})
    if expected is not None:
        per_task = {run["dataset"] for run in runs if run["per_task_runs"]} | {"longbench", "longbench-e", "scbench"}
        for name, config in expected:
            if name in present:
                continue  # its problems, if any, are reported above
            dataset, data_dir = str(config.get("dataset")), config.get("data_dir")
            if dataset in per_task:
                benchmark, task = dataset, str(data_dir or "")
            else:
                benchmark, task = dataset + (f"/{data_dir}" if data_dir else ""), ""
            if config.get("query_aware"):
                benchmark += QUERY_AWARE
            press = config.get("press_name")
            failed = (results_dir / "failed" / f"{name}.txt").is_file()
            reason = f"configuration failed (see failed/{name}.txt)" if failed else "configuration not run"
            ratio = 0.0 if press == BASELINE else config.get("head_compression_ratio", config.get("compression_ratio"))
            rows.append({**_row(config.get("model"), benchmark, press, ratio, task, reason), "name": name})
    else:
        for (model, benchmark), group in scores.groupby(["model", "benchmark"], sort=False):
            presses = [p for p in group["press"].unique() if p != BASELINE]
            ratios = sorted(group.loc[group["press"] != BASELINE, "compression_ratio"].unique())
            seen = set(zip(group["press"], group["compression_ratio"]))
            if not any(p == BASELINE for p, _ in seen):
                rows.append(_row(model, benchmark, BASELINE, 0.0, "", "no full-cache (no_press) baseline"))
            for press in presses:
                for ratio in ratios:
                    if (press, ratio) not in seen:
                        rows.append(_row(model, benchmark, press, ratio, "", "configuration not run"))
    # tasks missing from a run (or a LongBench task run missing for a press and ratio)
    for (model, benchmark), group in scores.groupby(["model", "benchmark"], sort=False):
        expected_tasks = set(group["task"])
        for (press, ratio), cell in group.groupby(["press", "compression_ratio"], sort=False):
            for task in task_order(expected_tasks - set(cell["task"])):
                rows.append(_row(model, benchmark, press, ratio, task, "task missing"))
    columns = ["model", "benchmark", "press", "compression_ratio", "task", "reason", "name"]
    frame = pd.DataFrame(rows, columns=columns)
    # a LongBench task run that never ran is both "not run" and "task missing": keep the first reason
    return frame.drop_duplicates(["model", "benchmark", "press", "compression_ratio", "task"]).reset_index(drop=True)


def _cell(run: dict) -> dict:
    return {k: run[k] for k in ("model", "benchmark", "press", "compression_ratio", "name")}


def _row(model, benchmark, press, ratio, task, reason) -> dict:
    return {
        "model": model,
        "benchmark": benchmark,
        "press": press,
        "compression_ratio": ratio,
        "task": task,
        "reason": reason,
        "name": "",
    }


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text)
    os.replace(tmp, path)


def aggregate(
    results_dir: str | os.PathLike, out: str | os.PathLike | None = None, expected: list[tuple[str, dict]] | None = None
) -> Path:
    """
    Write the tables and plots of ``results_dir`` (see the module docstring); returns the output folder.

    Parameters
    ----------
    results_dir : path-like
        A folder of kvpress results folders.
    out : path-like, optional
        Output folder (default ``results_dir/summary``).
    expected : list of (name, config), optional
        The configurations a sweep planned, to report those without results.
    """
    results_dir = Path(results_dir)
    out = Path(out) if out is not None else results_dir / "summary"
    out.mkdir(parents=True, exist_ok=True)
    runs = read_runs(results_dir)
    scores = scores_frame(runs)
    summary = summarize(scores)
    comparison = critical_vs_base(summary, paired_samples(runs))
    missing = missing_cells(runs, scores, results_dir, expected)
    _write(out / "scores.csv", scores.to_csv(index=False))
    _write(out / "summary.csv", summary.to_csv(index=False))
    _write(out / "critical_vs_base.csv", comparison.to_csv(index=False))
    _write(out / "missing.csv", missing.to_csv(index=False))
    _write(out / "tables.md", markdown_tables(summary, comparison, missing))
    if not summary.empty:
        plot(summary, out / "plots")
        paper = paper_comparison(summary)
        if paper["ours"].notna().any():  # runs of the paper's models and benchmarks: its numbers beside ours
            _write(out / "paper.csv", paper.to_csv(index=False))
            _write(out / "paper.md", paper_markdown(paper))
    samples = quality_samples(runs)
    if not samples.empty:  # runs with likelihood metrics (the quality benchmark)
        quality = quality_summary(samples)
        comparisons = quality_comparisons(samples)
        _write(out / "quality_samples.csv", samples.to_csv(index=False))
        _write(out / "quality.csv", quality.to_csv(index=False))
        _write(out / "quality_comparisons.csv", comparisons.to_csv(index=False))
        by_turn, turn_comparisons = quality_by_turn(samples)
        if not by_turn.empty:
            _write(out / "quality_turns.csv", by_turn.to_csv(index=False))
            _write(out / "quality_turn_comparisons.csv", turn_comparisons.to_csv(index=False))
        _write(out / "quality.md", quality_markdown(quality, comparisons) + quality_turns_markdown(turn_comparisons))
        quality_plot(quality, out / "plots")
    if not missing.empty:
        logger.warning("%d missing cell(s), listed in %s", len(missing), out / "missing.csv")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", help="folder of kvpress results folders")
    parser.add_argument("--out", help="output folder (default RESULTS_DIR/summary)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = aggregate(args.results_dir, args.out)
    print((out / "tables.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
