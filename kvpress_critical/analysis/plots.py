"""Figures of a run (matplotlib, PNG), after the paper's figures 4, 5 and 6."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvpress_critical.analysis.presses import PressPair  # noqa: E402
from kvpress_critical.analysis.runner import SampleResult  # noqa: E402
from kvpress_critical.analysis.summary import reduction_map  # noqa: E402

__all__ = ["plot_all", "plot_layer_curves", "plot_reduction_maps", "plot_reduction_vs_cache"]

_COLORS = {"kv": "tab:blue", "adakv": "tab:orange"}


def plot_reduction_maps(results: list[SampleResult], pairs: list[PressPair], path: Path) -> Path:
    """Figure 4: layer x head map of the relative perturbation reduction of each critical variant."""
    modes = sorted({p.mode for p in pairs})
    ratios = sorted({p.ratio for p in pairs})
    fig, axes = plt.subplots(
        len(modes),
        len(ratios),
        figsize=(3.2 * len(ratios) + 1.5, 4.8 * len(modes)),
        squeeze=False,
        sharey=True,
        layout="constrained",
    )
    image = None
    for pair in pairs:
        ax = axes[modes.index(pair.mode)][ratios.index(pair.ratio)]
        data = reduction_map(results, pair).numpy() * 100
        image = ax.imshow(
            data, aspect="auto", cmap="RdBu", vmin=-100, vmax=100, origin="lower", interpolation="nearest"
        )
        ax.set_title(f"{pair.critical_name}\nvs {pair.base_name}, cache {1 - pair.ratio:.0%}", fontsize=9)
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="perturbation reduction (%), blue = lower with CriticalKV")
    fig.suptitle("First-decoded-token attention-output perturbation reduction per head")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_layer_curves(summary: dict, path: Path) -> Path:
    """Figure 5: per-layer mean actual perturbation, base (solid) vs critical (dashed), per cache size."""
    ratios = sorted({p["ratio"] for p in summary["presses"].values()})
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 3.8), squeeze=False)
    for press in summary["presses"].values():
        ax = axes[0][ratios.index(press["ratio"])]
        curve = press["per_layer_first_token"]["actual"]
        style = "-" if press["role"] == "base" else "--"
        ax.plot(range(len(curve)), curve, style, color=_COLORS.get(press["mode"]), label=press["name"], marker=".")
        ax.set_title(f"cache {1 - press['ratio']:.0%}")
        ax.set_xlabel("layer")
        ax.set_ylabel("mean ||o - ô||_1 (first decoded token)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reduction_vs_cache(summary: dict, path: Path) -> Path:
    """Figure 6: mean perturbation reduction and fraction of heads improved vs cache size."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in sorted({p["mode"] for p in summary["pairs"]}):
        rows = sorted((p for p in summary["pairs"] if p["mode"] == mode), key=lambda p: p["cache_size"])
        sizes = [100 * p["cache_size"] for p in rows]
        name = summary["presses"][rows[0]["critical"]]["name"]
        color = _COLORS.get(mode)
        left.plot(sizes, [100 * p["first_token"]["mean_reduction"] for p in rows], "o-", color=color, label=name)
        right.plot(sizes, [100 * p["first_token"]["heads_improved"] for p in rows], "o-", color=color, label=name)
    left.axhline(0, color="grey", lw=0.8)
    right.axhline(50, color="grey", lw=0.8)
    left.set(xlabel="cache size (%)", ylabel="mean perturbation reduction (%)", title="reduction vs its base")
    right.set(
        xlabel="cache size (%)", ylabel="heads improved (%)", title="heads with lower perturbation", ylim=(0, 100)
    )
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: list[SampleResult], pairs: list[PressPair], summary: dict, folder: Path) -> list[Path]:
    """Write every figure into ``folder``; returns their paths."""
    folder = Path(folder)
    return [
        plot_reduction_maps(results, pairs, folder / "fig4_reduction_map.png"),
        plot_layer_curves(summary, folder / "fig5_layer_perturbation.png"),
        plot_reduction_vs_cache(summary, folder / "fig6_reduction_vs_cache.png"),
    ]
