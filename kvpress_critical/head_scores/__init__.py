"""Head importance for HeadKV's offline budgets: profiling (``python -m kvpress_critical.head_scores``), files, and
the scores shipped with the package.

- :func:`profile_head_scores` / :func:`build_trials` (:mod:`~kvpress_critical.head_scores.profiler`): HeadKV's
  retrieval-reasoning (and Wu et al.'s retrieval) head scores from needle trials;
- :func:`load_head_scores` / :func:`save_head_scores` (:mod:`~kvpress_critical.head_scores.io`): HeadKV's JSON;
- :func:`head_scores_for`: the scores a press uses, from a path, a dict, or (``None``) the file shipped for the
  model (``data/<model>.json``; today the embedded SmolLM2-135M-Instruct). Any other model: a clear error naming
  the profiler command.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpress_critical.head_scores.io import load_head_scores, parse_head_scores, save_head_scores
from kvpress_critical.head_scores.profiler import METHODS, Trial, build_trials, profile_head_scores, score_trial

DATA_DIR = Path(__file__).resolve().parent / "data"

__all__ = [
    "DATA_DIR",
    "METHODS",
    "Trial",
    "build_trials",
    "head_scores_for",
    "load_head_scores",
    "parse_head_scores",
    "profile_head_scores",
    "save_head_scores",
    "score_trial",
    "shipped_models",
]


def shipped_models() -> list[str]:
    """Models whose head scores ship with the package."""
    return sorted(p.stem for p in DATA_DIR.glob("*.json") if not p.name.endswith(".meta.json"))


def head_scores_for(source, model=None, n_layers: int | None = None, n_heads: int | None = None) -> torch.Tensor:
    """
    ``(n_layers, n_heads)`` query-head scores from ``source``: a path, a dict (HeadKV's format) or a tensor, or
    ``None`` for the scores shipped for ``model`` (matched on the name of its checkpoint). The shape is checked
    against the model's when it is given.
    """
    if model is not None:
        n_layers = n_layers or model.config.num_hidden_layers
        n_heads = n_heads or model.config.num_attention_heads
    if source is None:
        name = Path(str(getattr(getattr(model, "config", None), "name_or_path", "") or "")).name
        path = DATA_DIR / f"{name}.json"
        if not name or not path.is_file():
            raise FileNotFoundError(
                f"no head scores ship for {name or 'this model'} (shipped: {', '.join(shipped_models()) or 'none'}). "
                "Profile them once: python -m kvpress_critical.head_scores --model <model dir or hub id> "
                "--out head_scores.json, then pass head_scores='head_scores.json'"
            )
        scores = load_head_scores(path)
    elif isinstance(source, torch.Tensor):
        scores = source.double()
    elif isinstance(source, (dict, list, tuple)):
        scores = parse_head_scores(source)
    else:
        scores = load_head_scores(source)
    if n_layers is not None and n_heads is not None and tuple(scores.shape) != (n_layers, n_heads):
        raise ValueError(
            f"head scores of shape {tuple(scores.shape)} (layers, query heads) for a model with {n_layers} layers "
            f"and {n_heads} attention heads: they were profiled on another model"
        )
    return scores
