"""From per-sample results to the numbers we report: per-press means, bound checks, Assumption 3.4,
fidelity, and base-vs-critical comparisons (the JSON summary and the markdown table)."""

import math

import torch

from kvpress_critical.analysis.presses import PressPair, label
from kvpress_critical.analysis.runner import PressResult, SampleResult

__all__ = ["BOUND_RTOL", "head_means", "markdown_table", "reduction_map", "summarize", "table_rows"]

#: relative tolerance of the bound checks (float64 arithmetic, float32 projected-value norms)
BOUND_RTOL = 1e-5

VIEWS = {
    "first_token": "the first decoded (first answer) token's query",
    "all_tokens": "mean over every post-context query (question, template suffix, answer prefix, answer)",
}


def _view(result: SampleResult, tensor: torch.Tensor, view: str) -> torch.Tensor:
    """``(n_layers, H, L)`` -> ``(n_layers, H)`` for one view."""
    return tensor[..., result.first] if view == "first_token" else tensor.mean(-1)


def head_means(results: list[SampleResult], name: str, metric: str, view: str) -> torch.Tensor:
    """``(S, n_layers, H)``: ``metric`` of press ``name`` per sample, layer and query head."""
    out = []
    for result in results:
        value = getattr(result.presses[name], metric)
        out.append(_view(result, value, view))
    return torch.stack(out)


def _f(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else round(x, 6)


def _bound_check(presses: list[PressResult]) -> dict:
    n = violations = prev_violations = n_half = 0
    worst = 0.0
    for p in presses:
        slack = p.theta * (1 + BOUND_RTOL) + 1e-9 - p.actual
        violations += int((slack < 0).sum())
        n += p.actual.numel()
        positive = p.theta > 0
        if positive.any():
            worst = max(worst, float((p.actual[positive] / p.theta[positive]).max()))
        half = p.retained >= 0.5
        n_half += int(half.sum())
        prev_violations += int((p.theta[half] > p.theta_prev[half] * (1 + BOUND_RTOL) + 1e-9).sum())
    return {
        "queries_checked": n,
        "actual_above_theta": violations,
        "max_actual_over_theta": _f(worst),
        "queries_with_s_at_least_half": n_half,
        "theta_above_theta_prev_when_s_at_least_half": prev_violations,
    }


def _press_summary(results: list[SampleResult], name: str) -> dict:
    presses = [r.presses[name] for r in results]
    summary = {"kept_fraction": _f(sum(p.kept_fraction for p in presses) / len(presses))}
    for view in VIEWS:
        summary[view] = {
            metric: _f(head_means(results, name, metric, view).mean())
            for metric in ("actual", "theta", "theta_prev", "retained", "end_to_end")
        }
    if all(p.retained_stage1 is not None for p in presses):
        rates = {}
        for view in VIEWS:
            holds = (head_means(results, name, "retained_stage1", view) >= 0.5).double()  # (S, n_layers, H)
            rates[view] = {
                "rate": _f(holds.mean()),
                "per_layer": [_f(x) for x in holds.mean(dim=(0, 2))],
            }
        summary["assumption_3_4"] = rates
    else:
        summary["assumption_3_4"] = None
    kl = torch.cat([p.fidelity.kl for p in presses])
    summary["fidelity"] = {
        "kl": _f(kl.mean()),
        "loglik_gap": _f(sum(p.fidelity.loglik_gap for p in presses) / len(presses)),
        "top1_agree": _f(torch.cat([p.fidelity.top1_agree for p in presses]).mean()),
    }
    summary["bound_check"] = _bound_check(presses)
    summary["per_layer_first_token"] = {
        metric: [_f(x) for x in head_means(results, name, metric, "first_token").mean(dim=(0, 2))]
        for metric in ("actual", "theta", "theta_prev", "end_to_end")
    }
    return summary


def _comparison(results: list[SampleResult], base: str, critical: str, metric: str, view: str) -> dict:
    per_base = head_means(results, base, metric, view)  # (S, n_layers, H)
    per_crit = head_means(results, critical, metric, view)
    mean_base, mean_crit = per_base.mean(0), per_crit.mean(0)  # per head, over samples
    return {
        "heads_improved": _f((mean_crit < mean_base).double().mean()),
        "heads_worse": _f((mean_crit > mean_base).double().mean()),
        "instances_improved": _f((per_crit < per_base).double().mean()),
        "mean_base": _f(mean_base.mean()),
        "mean_critical": _f(mean_crit.mean()),
        "mean_reduction": _f(1 - mean_crit.mean() / mean_base.mean()) if mean_base.mean() > 0 else 0.0,
        "per_layer_heads_improved": [_f(x) for x in (mean_crit < mean_base).double().mean(-1)],
    }


def reduction_map(results: list[SampleResult], pair: PressPair, view: str = "first_token") -> torch.Tensor:
    """``(n_layers, H)`` relative reduction ``1 - mean_critical / mean_base`` of the actual perturbation."""
    base = head_means(results, label(pair.base_name, pair.ratio), "actual", view).mean(0)
    crit = head_means(results, label(pair.critical_name, pair.ratio), "actual", view).mean(0)
    return torch.where(base > 0, 1 - crit / base.clamp(min=1e-300), torch.zeros_like(base))


def summarize(results: list[SampleResult], pairs: list[PressPair], config: dict | None = None) -> dict:
    """
    The JSON summary of a run.

    Keys: ``config``, ``definitions``, ``presses`` (per ``"<name>@<ratio>"``), ``pairs`` (base vs critical
    per mode and ratio), ``overall`` (heads improved over all pairs, per ratio and in total) and
    ``samples`` (names and context lengths).
    """
    presses, comparisons = {}, []
    for pair in pairs:
        for role, name in (("base", pair.base_name), ("critical", pair.critical_name)):
            key = label(name, pair.ratio)
            presses[key] = {"name": name, "role": role, "mode": pair.mode, "ratio": pair.ratio}
            presses[key].update(_press_summary(results, key))
        base, crit = label(pair.base_name, pair.ratio), label(pair.critical_name, pair.ratio)
        comparison = {
            "mode": pair.mode,
            "ratio": pair.ratio,
            "cache_size": _f(1 - pair.ratio),
            "base": base,
            "critical": crit,
        }
        for view in VIEWS:
            comparison[view] = _comparison(results, base, crit, "actual", view)
        comparison["end_to_end_first_token"] = _comparison(results, base, crit, "end_to_end", "first_token")
        comparison["theta_first_token"] = _comparison(results, base, crit, "theta", "first_token")
        comparison["kl"] = {"base": presses[base]["fidelity"]["kl"], "critical": presses[crit]["fidelity"]["kl"]}
        comparison["loglik_gap"] = {
            "base": presses[base]["fidelity"]["loglik_gap"],
            "critical": presses[crit]["fidelity"]["loglik_gap"],
        }
        comparisons.append(comparison)
    overall = {}
    for ratio in sorted({p.ratio for p in pairs}) + [None]:
        chosen = [p for p in pairs if ratio is None or p.ratio == ratio]
        improved = torch.cat(
            [
                (
                    head_means(results, label(p.critical_name, p.ratio), "actual", "first_token").mean(0)
                    < head_means(results, label(p.base_name, p.ratio), "actual", "first_token").mean(0)
                ).flatten()
                for p in chosen
            ]
        )
        overall["all" if ratio is None else f"{ratio:g}"] = _f(improved.double().mean())
    return {
        "config": config or {},
        "definitions": {
            "actual": "||o - ô||_1 per query head, o = (A V) W_O^h with the full cache, ô the same query's attention "
            "over the kept entries; queries, keys and values from the full-cache run (local, exact)",
            "end_to_end": "the same norm with ô taken from the compressed run itself "
            "(errors of earlier layers propagate)",
            "theta": "(1/s - 1) C + (2 - 1/s) X with the full-cache attention of the same query; actual <= theta",
            "theta_prev": "2 (1 - s) max_j N_j (attention-only bound)",
            "retained": "s, the attention mass of the kept entries (post-context entries always count as kept)",
            "assumption_3_4": "fraction of (sample, layer, query head) where the first-stage set retains s >= 1/2",
            "heads_improved": "fraction of (layer, query head) whose perturbation, averaged over samples, is lower "
            "with the critical variant than with its base",
            "instances_improved": "the same over (sample, layer, query head)",
            "kl": "mean over teacher-forced answer tokens of KL(p_full || p_compressed) of the next-token distribution",
            "loglik_gap": "mean per answer token of log p_full - log p_compressed",
            "views": VIEWS,
        },
        "samples": [
            {"name": r.name, "context_tokens": r.n_context, "reference_error": _f(r.reference_error)} for r in results
        ],
        "presses": presses,
        "pairs": comparisons,
        "overall_heads_improved_first_token": overall,
    }


def table_rows(summary: dict, view: str = "first_token") -> list[dict]:
    """The paper's table 9 for this run: mean actual / theta / theta_prev per cache size and press."""
    rows = []
    for p in sorted(summary["presses"].values(), key=lambda p: (-p["ratio"], p["mode"], p["role"] != "base")):
        a34 = p["assumption_3_4"]
        rows.append(
            {
                "cache_size": _f(1 - p["ratio"]),
                "press": p["name"],
                "actual": p[view]["actual"],
                "theta": p[view]["theta"],
                "theta_prev": p[view]["theta_prev"],
                "retained": p[view]["retained"],
                "assumption_3_4": a34[view]["rate"] if a34 else None,
                "kl": p["fidelity"]["kl"],
                "loglik_gap": p["fidelity"]["loglik_gap"],
            }
        )
    return rows


def markdown_table(summary: dict, view: str = "first_token") -> str:
    """:func:`table_rows` as a markdown table."""
    lines = [
        "| cache | press | actual | theta | theta_prev | s | A3.4 holds | KL | loglik gap |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table_rows(summary, view):
        a34 = "-" if r["assumption_3_4"] is None else f"{r['assumption_3_4']:.1%}"
        lines.append(
            f"| {r['cache_size']:.0%} | {r['press']} | {r['actual']:.3f} | {r['theta']:.3f} | {r['theta_prev']:.3f} "
            f"| {r['retained']:.3f} | {a34} | {r['kl']:.4f} | {r['loglik_gap']:.4f} |"
        )
    return "\n".join(lines) + "\n"
