"""Rendering of aggregated results: paper-like markdown tables and score-vs-cache-size plots."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from evaluation.registry import BASELINE, critical_base
from evaluation.tasks import KEYS, LONGBENCH_DOMAINS, LONGBENCH_TASKS, RULER_ORDER, task_order


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}f}"


def _press_order(presses) -> list[str]:
    """Base presses in order of appearance, each followed by its CriticalKV variants; no_press first."""
    presses = list(dict.fromkeys(presses))
    ordered = [BASELINE] if BASELINE in presses else []
    for press in presses:
        if press in ordered or critical_base(press) in presses:
            continue
        ordered.append(press)
        ordered.extend(p for p in presses if critical_base(p) == press and p not in ordered)
    return ordered + [p for p in presses if p not in ordered]


def markdown_tables(summary: pd.DataFrame, comparison: pd.DataFrame, missing: pd.DataFrame) -> str:
    """Paper-like markdown: per model and benchmark, rows = cache size x press, columns = tasks, avg, loss."""
    lines = ["# Evaluation summary", ""]
    lines.append("Scores are kvpress's metrics (RULER: string match, %). Loss = (full - x) / full, in %, vs no_press.")
    lines.append("Cache = 100 % - compression ratio. — marks a missing cell (see the Missing section).")
    for (model, benchmark), group in summary.groupby(["model", "benchmark"], sort=False):
        task_columns = [c for c in group.columns if c in set(RULER_ORDER + LONGBENCH_TASKS)] + [
            c for c in group.columns if c not in set(RULER_ORDER + LONGBENCH_TASKS) and _is_task_column(c)
        ]
        task_columns = task_order([c for c in task_columns if group[c].notna().any()])
        domains = [d for d in LONGBENCH_DOMAINS if d in group.columns]
        lines += ["", f"## {model} — {benchmark}", ""]
        header = ["Cache", "Press"] + task_columns + domains + ["Avg.", "Loss %"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        ordered = group.assign(_order=group["press"].map({p: i for i, p in enumerate(_press_order(group["press"]))}))
        ordered = ordered.sort_values(["cache_size", "_order"], ascending=[False, True])
        for _, row in ordered.iterrows():
            cache = "full" if row["press"] == BASELINE else f"{row['cache_size']:g}%"
            cells = [cache, row["press"]] + [_fmt(row.get(t)) for t in task_columns + domains]
            cells += [_fmt(row["average"]), "—" if row["press"] == BASELINE else _fmt(row["loss"])]
            lines.append("| " + " | ".join(cells) + " |")
    if not comparison.empty:
        lines += ["", "## CriticalKV vs its base press", ""]
        paired = "n_samples" in comparison.columns
        header = [
            "Model",
            "Benchmark",
            "Cache",
            "Base",
            "Critical",
            "Base avg",
            "Critical avg",
            "Base loss %",
            "Critical loss %",
            "Loss reduction (pp)",
            "Relative reduction %",
        ]
        if paired:
            header += ["Samples", "Critical better", "Base better"]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for _, row in comparison.sort_values(["model", "benchmark", "critical", "cache_size"]).iterrows():
            cells = [
                row["model"],
                row["benchmark"],
                f"{row['cache_size']:g}%",
                row["base"],
                row["critical"],
                _fmt(row["base_score"]),
                _fmt(row["critical_score"]),
                _fmt(row["base_loss"]),
                _fmt(row["critical_loss"]),
                _fmt(row["loss_reduction_pp"]),
                _fmt(row["relative_loss_reduction"], 1),
            ]
            if paired:
                cells += [
                    _fmt(row.get("n_samples"), 0),
                    _fmt(row.get("critical_better"), 0),
                    _fmt(row.get("base_better"), 0),
                ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        lines += ["", "Over all cache sizes:", ""]
        for (model, bench, crit, base), group in comparison.groupby(
            ["model", "benchmark", "critical", "base"], sort=False
        ):
            reduction = _fmt(group["loss_reduction_pp"].mean())
            text = f"- {crit} vs {base} ({model}, {bench}): mean loss reduction {reduction} pp"
            if paired and group["n_samples"].notna().all():
                text += (
                    f"; per sample, critical better on {int(group['critical_better'].sum())}, base better on "
                    f"{int(group['base_better'].sum())}, tied on {int(group['ties'].sum())} of "
                    f"{int(group['n_samples'].sum())}"
                )
            lines.append(text)
    lines += ["", "## Missing", ""]
    if missing.empty:
        lines.append("Nothing missing.")
    else:
        lines.append("| Model | Benchmark | Press | Ratio | Task | Reason |")
        lines.append("|---|---|---|---|---|---|")
        for _, row in missing.iterrows():
            lines.append(
                f"| {row['model']} | {row['benchmark']} | {row['press']} | {_fmt(row['compression_ratio'], 3)} | "
                f"{row['task'] or 'all'} | {row['reason']} |"
            )
    return "\n".join(lines) + "\n"


def _is_task_column(column: str) -> bool:
    reserved = (
        set(KEYS)
        | {"cache_size", "n_tasks", "n_expected_tasks", "average_available", "average", "full_cache_average", "loss"}
        | set(LONGBENCH_DOMAINS)
    )
    return column not in reserved


def plot(summary: pd.DataFrame, folder: Path) -> list[Path]:
    """Average score vs cache size, one PNG per model and benchmark, one line per press."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for (model, benchmark), group in summary.groupby(["model", "benchmark"], sort=False):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for press in _press_order(group["press"]):
            if press == BASELINE:
                continue
            rows = group[(group["press"] == press)].sort_values("cache_size")
            y = rows["average"].where(rows["average"].notna(), rows["average_available"])
            style = "-" if critical_base(press) is not None else "--"
            ax.plot(rows["cache_size"], y, style, marker="o", label=press)
        full = group.loc[group["press"] == BASELINE, "average"]
        if len(full) and math.isfinite(full.iloc[0]):
            ax.axhline(full.iloc[0], color="black", linestyle=":", label="full cache")
        ax.set_xlabel("KV cache size (% of the context kept)")
        ax.set_ylabel("average score")
        ax.set_title(f"{model} — {benchmark}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{_safe(model)}__{_safe(benchmark)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")
