"""
Quality tables of runs with likelihood metrics (the quality benchmark): per press and ratio, and critical vs base.

Per sample (question), from each results folder's ``predictions.csv`` (kvpress's) and ``likelihood.csv`` (ours,
joined on ``context_id`` and ``task``):

- ``match``: kvpress's RULER string match of the greedy answer (fraction of reference answers it contains);
- ``nll``: mean negative log-likelihood of the target's answer tokens under the compressed cache;
  ``nll_loss = nll - nll_full``, the loss vs the full cache (the reference pass, same tokens);
- ``kl_topk``: mean per-token ``KL(p_full || p_compressed)`` over the target tokens, the distributions coarsened to
  the full cache's top-512 tokens plus the rest (:mod:`kvpress_critical.likelihood`; a lower bound of the exact KL).

``quality.csv``: means per model, benchmark, press and ratio, with sample and context counts.
``quality_comparisons.csv``: each press next to its base (``evaluation.registry.comparison_pairs``; DefensiveKV next to
CriticalAdaKV and Layer-DefensiveKV next to DefensiveKV, ``FOLLOW_UPS``) on the same
samples: the relative reduction of the NLL loss and of the KL (``1 - critical / base``) and the change of string
match, each with a 95% paired cluster-bootstrap interval (contexts resampled; ``evaluation.bootstrap``).
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from evaluation.bootstrap import mean_difference, paired_bootstrap, relative_reduction
from evaluation.paired import sample_matches
from evaluation.registry import BASELINE, comparison_pairs, critical_base
from evaluation.worker import LIKELIHOOD_FILE

logger = logging.getLogger(__name__)

SAMPLE_KEYS = ["context_id", "task"]


def quality_samples(runs: list[dict]) -> pd.DataFrame:
    """One row per run and question of every run with a ``likelihood.csv``."""
    frames = []
    for run in runs:
        folder = Path(run["folder"])
        if not (folder / LIKELIHOOD_FILE).is_file() or not (folder / "predictions.csv").is_file():
            continue
        # (results written before the KL column was named kl_topk call it kl: the same quantity)
        likelihood = pd.read_csv(folder / LIKELIHOOD_FILE).rename(columns={"kl": "kl_topk", "kl_max": "kl_topk_max"})
        predictions = pd.read_csv(folder / "predictions.csv")
        if not set(SAMPLE_KEYS) <= set(predictions.columns):
            logger.warning("%s: predictions.csv has no %s columns; string match not paired", folder, SAMPLE_KEYS)
            continue
        predictions["match"] = sample_matches(predictions)
        frame = likelihood.merge(predictions[SAMPLE_KEYS + ["match"]], on=SAMPLE_KEYS, how="left")
        frame["nll_loss"] = frame["nll"] - frame["nll_full"]
        for key in ("model", "benchmark", "press", "compression_ratio"):
            frame[key] = run[key]
        frames.append(frame)
    if not frames:
        return pd.DataFrame()
    samples = pd.concat(frames, ignore_index=True)
    samples["cache_size"] = (100 * (1 - samples["compression_ratio"])).round(1)
    return samples


def quality_summary(samples: pd.DataFrame) -> pd.DataFrame:
    """Means per model, benchmark, press and ratio."""
    if samples.empty:
        return pd.DataFrame()
    keys = ["model", "benchmark", "press", "compression_ratio", "cache_size"]
    grouped = samples.groupby(keys, sort=False)
    summary = grouped.agg(
        n_samples=("nll", "size"),
        n_contexts=("context_id", "nunique"),
        string_match=("match", "mean"),
        nll=("nll", "mean"),
        nll_loss=("nll_loss", "mean"),
        kl_topk=("kl_topk", "mean"),
    ).reset_index()
    summary["string_match"] *= 100
    return summary


def _paired(samples: pd.DataFrame, model, benchmark, ratio, press: str, base: str) -> pd.DataFrame:
    cell = samples[(samples["model"] == model) & (samples["benchmark"] == benchmark)]
    a = cell[(cell["press"] == press) & (cell["compression_ratio"] == ratio)]
    b = cell[(cell["press"] == base) & (cell["compression_ratio"] == ratio)]
    return a.merge(b, on=SAMPLE_KEYS, suffixes=("", "_base"))


def quality_comparisons(samples: pd.DataFrame, n_resamples: int = 2000, pairs: dict | None = None) -> pd.DataFrame:
    """Each press next to its base at every model, benchmark and ratio, with paired cluster-bootstrap intervals."""
    if samples.empty:
        return pd.DataFrame()
    pairs = comparison_pairs(samples["press"].unique()) if pairs is None else pairs
    rows = []
    cells = samples[["model", "benchmark", "compression_ratio"]].drop_duplicates().itertuples(index=False)
    for model, benchmark, ratio in cells:
        present = set(samples.loc[samples["compression_ratio"] == ratio, "press"])
        for press, base in pairs.items():
            if press not in present or base not in present or press == BASELINE:
                continue
            paired = _paired(samples, model, benchmark, ratio, press, base)
            if paired.empty:
                continue
            clusters = paired["context_id"].to_numpy()
            nll_base = paired["nll_loss_base"].to_numpy()
            nll_crit = paired["nll_loss"].to_numpy()
            kl_base, kl_crit = paired["kl_topk_base"].to_numpy(), paired["kl_topk"].to_numpy()
            match_base, match_crit = paired["match_base"].to_numpy(), paired["match"].to_numpy()
            boot = dict(clusters=clusters, n_resamples=n_resamples)
            nll_rel = paired_bootstrap(relative_reduction, nll_base, nll_crit, **boot)
            kl_rel = paired_bootstrap(relative_reduction, kl_base, kl_crit, **boot)
            nll_abs = paired_bootstrap(mean_difference, nll_base, nll_crit, **boot)
            match = paired_bootstrap(mean_difference, match_crit, match_base, **boot)
            rows.append(
                dict(
                    model=model,
                    benchmark=benchmark,
                    compression_ratio=ratio,
                    cache_size=round(100 * (1 - ratio), 1),
                    press=press,
                    base=base,
                    n_samples=nll_rel.n_samples,
                    n_contexts=nll_rel.n_clusters,
                    base_nll_loss=float(np.mean(nll_base)),
                    press_nll_loss=float(np.mean(nll_crit)),
                    nll_loss_reduction=nll_rel.estimate,
                    nll_loss_reduction_low=nll_rel.low,
                    nll_loss_reduction_high=nll_rel.high,
                    nll_loss_diff=nll_abs.estimate,
                    nll_loss_diff_low=nll_abs.low,
                    nll_loss_diff_high=nll_abs.high,
                    base_kl=float(np.mean(kl_base)),
                    press_kl=float(np.mean(kl_crit)),
                    kl_reduction=kl_rel.estimate,
                    kl_reduction_low=kl_rel.low,
                    kl_reduction_high=kl_rel.high,
                    base_string_match=100 * float(np.nanmean(match_base)),
                    press_string_match=100 * float(np.nanmean(match_crit)),
                    string_match_diff=100 * match.estimate,
                    string_match_diff_low=100 * match.low,
                    string_match_diff_high=100 * match.high,
                )
            )
    return pd.DataFrame(rows)


def _interval(row, name: str, percent: bool = True) -> str:
    scale = 100 if percent else 1
    est, low, high = row[name], row[f"{name}_low"], row[f"{name}_high"]
    if not math.isfinite(est):
        return "–"
    unit = "%" if percent else ""
    bounds = f" [{low * scale:+.0f}, {high * scale:+.0f}]" if math.isfinite(low) else ""
    return f"{est * scale:+.0f}{unit}{bounds}"


def quality_markdown(summary: pd.DataFrame, comparisons: pd.DataFrame) -> str:
    """The quality tables as markdown."""
    if summary.empty:
        return ""
    lines = ["## Quality benchmark", ""]
    for (model, benchmark), group in summary.groupby(["model", "benchmark"], sort=False):
        lines += [f"### {model} — {benchmark}", ""]
        full = group[group["press"] == BASELINE]
        if len(full):
            f = full.iloc[0]
            lines += [
                f"Full cache: string match {f['string_match']:.1f}, answer NLL {f['nll']:.3f} "
                f"({int(f['n_samples'])} questions, {int(f['n_contexts'])} contexts).",
                "",
            ]
        lines += [
            "| cache | press | string match | answer NLL | NLL loss vs full | KL (top-512) vs full |",
            "|---|---|---|---|---|---|",
        ]
        body = group[group["press"] != BASELINE].sort_values(["cache_size", "press"], ascending=[False, True])
        for r in body.itertuples():
            cells = [f"{r.cache_size:g}%", r.press, f"{r.string_match:.1f}", f"{r.nll:.3f}", f"{r.nll_loss:+.3f}"]
            lines.append("| " + " | ".join(cells + [f"{r.kl_topk:.3f}"]) + " |")
        lines.append("")
        comp = (
            comparisons[(comparisons["model"] == model) & (comparisons["benchmark"] == benchmark)]
            if len(comparisons)
            else comparisons
        )
        if len(comp):
            lines += [
                "Paired comparisons (same questions; 95% cluster-bootstrap intervals over contexts). Reductions are "
                "`1 - press / base` of the loss vs the full cache: positive = the press loses less.",
                "",
                "| cache | press vs base | n (contexts) | NLL loss: base → press | NLL loss reduction "
                "| KL (top-512): base → press | KL reduction | string match change (pp) |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for _, r in comp.sort_values(["cache_size", "press"], ascending=[False, True]).iterrows():
                sm = r["string_match_diff"]
                sm_text = (
                    f"{sm:+.1f} [{r['string_match_diff_low']:+.1f}, {r['string_match_diff_high']:+.1f}]"
                    if math.isfinite(r["string_match_diff_low"])
                    else f"{sm:+.1f}"
                )
                lines.append(
                    f"| {r['cache_size']:g}% | {r['press']} vs {r['base']} | {int(r['n_samples'])} "
                    f"({int(r['n_contexts'])}) | {r['base_nll_loss']:.3f} → {r['press_nll_loss']:.3f} | "
                    f"{_interval(r, 'nll_loss_reduction')} | {r['base_kl']:.3f} → {r['press_kl']:.3f} | "
                    f"{_interval(r, 'kl_reduction')} | {sm_text} |"
                )
            lines.append("")
    return "\n".join(lines) + "\n"


def quality_by_turn(samples: pd.DataFrame, n_resamples: int = 2000) -> tuple[pd.DataFrame, pd.DataFrame]:
    """For multi-turn runs (a ``turn`` column), :func:`quality_summary` and :func:`quality_comparisons` per turn."""
    if samples.empty or "turn" not in samples.columns or samples["turn"].isna().all():
        return pd.DataFrame(), pd.DataFrame()
    summaries, comparisons = [], []
    for turn, part in samples.dropna(subset=["turn"]).groupby("turn"):
        summary = quality_summary(part)
        summary.insert(4, "turn", int(turn))
        summaries.append(summary)
        paired = quality_comparisons(part, n_resamples)
        if not paired.empty:
            paired.insert(4, "turn", int(turn))
            comparisons.append(paired)
    return pd.concat(summaries, ignore_index=True), (
        pd.concat(comparisons, ignore_index=True) if comparisons else pd.DataFrame()
    )


def quality_turns_markdown(comparisons: pd.DataFrame) -> str:
    """Per-turn paired comparisons of multi-turn runs, as markdown (empty without any)."""
    if comparisons.empty:
        return ""
    lines = [
        "## Per turn (multi-turn runs)",
        "",
        "Each turn asked after the earlier questions and their reference answers, over the context compressed once. "
        "Reductions as above (95% cluster-bootstrap intervals over contexts).",
        "",
    ]
    for (model, benchmark), group in comparisons.groupby(["model", "benchmark"], sort=False):
        lines += [
            f"### {model} — {benchmark}",
            "",
            "| cache | press vs base | turn | n | NLL loss: base → press | NLL loss reduction | KL reduction |",
            "|---|---|---|---|---|---|---|",
        ]
        for _, r in group.sort_values(["cache_size", "press", "turn"], ascending=[False, True, True]).iterrows():
            lines.append(
                f"| {r['cache_size']:g}% | {r['press']} vs {r['base']} | {int(r['turn']) + 1} | {int(r['n_samples'])} "
                f"| {r['base_nll_loss']:.3f} → {r['press_nll_loss']:.3f} | {_interval(r, 'nll_loss_reduction')} "
                f"| {_interval(r, 'kl_reduction')} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def quality_plot(summary: pd.DataFrame, folder: Path) -> list[Path]:
    """NLL loss and KL vs cache size, one PNG per model and benchmark, one line per press."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for (model, benchmark), group in summary.groupby(["model", "benchmark"], sort=False):
        fig, axes = plt.subplots(1, 3, figsize=(13, 4))
        for press in sorted(set(group["press"]) - {BASELINE}):
            rows = group[group["press"] == press].sort_values("cache_size")
            style = "-" if critical_base(press) is not None else "--"
            for ax, column in zip(axes, ("nll_loss", "kl_topk", "string_match")):
                ax.plot(rows["cache_size"], rows[column], style, marker="o", label=press)
        full = group[group["press"] == BASELINE]
        if len(full):
            axes[2].axhline(full["string_match"].iloc[0], color="black", linestyle=":", label="full cache")
        for ax, label in zip(
            axes, ("answer NLL loss vs full (nats/token)", "KL(full || press) per token (top-512)", "string match")
        ):
            ax.set_xlabel("KV cache size (% kept)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].set_yscale("symlog", linthresh=0.01)
        axes[1].set_yscale("log")
        axes[2].legend(fontsize=7)
        fig.suptitle(f"{model} — {benchmark}", fontsize=10)
        fig.tight_layout()
        path = folder / f"quality__{re.sub(r'[^A-Za-z0-9._-]+', '-', f'{model}__{benchmark}').strip('-')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
