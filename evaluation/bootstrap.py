"""
Paired cluster bootstrap: confidence intervals for the difference between two presses on the same samples.

Two presses evaluated on the same questions give paired measurements; questions that share a context (the quality
benchmark asks several per context, all answered from one compressed cache) are not independent. The bootstrap
therefore resamples whole contexts (clusters) with replacement, keeping every question of a drawn context and the
pairing between the presses, and recomputes the statistic on each resample; the interval is the percentile interval
of those replicates (Efron & Tibshirani, *An Introduction to the Bootstrap*, ch. 13). With one question per context
it is the ordinary paired bootstrap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A point estimate with its bootstrap percentile interval."""

    estimate: float
    low: float
    high: float
    n_samples: int
    n_clusters: int
    level: float = 0.95

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def format(self, digits: int = 2, percent: bool = False) -> str:
        scale, unit = (100.0, "%") if percent else (1.0, "")
        if not math.isfinite(self.estimate):
            return "–"
        return (
            f"{self.estimate * scale:.{digits}f}{unit} [{self.low * scale:.{digits}f}, {self.high * scale:.{digits}f}]"
        )


def _cluster_indices(clusters) -> list[np.ndarray]:
    codes = {}
    members: list[list[int]] = []
    for i, c in enumerate(clusters):
        if c not in codes:
            codes[c] = len(members)
            members.append([])
        members[codes[c]].append(i)
    return [np.asarray(m) for m in members]


def paired_bootstrap(
    statistic: Callable[..., float],
    *columns: np.ndarray,
    clusters=None,
    n_resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """
    ``statistic(*columns)`` and its percentile interval under resampling of clusters.

    Parameters
    ----------
    statistic : callable
        Takes the (resampled) columns, all of the same length, and returns a number (may be NaN).
    *columns : array-like
        Paired per-sample measurements, aligned (row i of every column is the same sample).
    clusters : array-like, optional
        Cluster label of every sample (e.g. its context); default: every sample its own cluster.
    n_resamples, level, seed
        Bootstrap replicates, interval coverage, RNG seed (same inputs, same interval).
    """
    data = [np.asarray(c, dtype=float) for c in columns]
    n = len(data[0])
    if any(len(c) != n for c in data):
        raise ValueError("paired columns must have the same length")
    groups = _cluster_indices(range(n) if clusters is None else list(clusters))
    estimate = float(statistic(*data))
    if n == 0 or len(groups) < 2:
        return Interval(estimate, math.nan, math.nan, n, len(groups), level)
    rng = np.random.default_rng(seed)
    replicates = np.empty(n_resamples)
    for b in range(n_resamples):
        drawn = rng.integers(0, len(groups), size=len(groups))
        index = np.concatenate([groups[g] for g in drawn])
        replicates[b] = statistic(*(c[index] for c in data))
    replicates = replicates[np.isfinite(replicates)]
    if len(replicates) == 0:
        return Interval(estimate, math.nan, math.nan, n, len(groups), level)
    alpha = (1 - level) / 2
    low, high = np.quantile(replicates, [alpha, 1 - alpha])
    return Interval(estimate, float(low), float(high), n, len(groups), level)


def mean_difference(a: np.ndarray, b: np.ndarray) -> float:
    """``mean(a - b)``."""
    return float(np.mean(a - b)) if len(a) else math.nan


def relative_reduction(base_loss: np.ndarray, other_loss: np.ndarray) -> float:
    """``1 - mean(other_loss) / mean(base_loss)``: the fraction of the base's loss the other press removes."""
    denominator = float(np.mean(base_loss)) if len(base_loss) else math.nan
    if not math.isfinite(denominator) or denominator <= 0:
        return math.nan
    return 1.0 - float(np.mean(other_loss)) / denominator
