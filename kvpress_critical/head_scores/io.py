"""Head-importance files: HeadKV's JSON format, read and written.

HeadKV (github.com/FYYFU/HeadKV, ``Important_Head/head_score/*.json``) stores one JSON object per model:
``{"<layer>-<head>": [score of each successful trial, ...], ...}``, 0-based layer and *query* head indices, layer-major.
Its loader takes the mean of every list in insertion order and reshapes it to ``(layers, heads)``; here the keys are
parsed, so files in any key order (pretty-printed or on one line) load the same. Also read: values that are already
means (numbers), and a plain ``(layers, heads)`` nested list.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch


def parse_head_scores(data) -> torch.Tensor:
    """``(n_layers, n_heads)`` float64 mean score per query head, from HeadKV's dict (or a nested list)."""
    if isinstance(data, (list, tuple)):
        matrix = torch.tensor(data, dtype=torch.float64)
        if matrix.dim() != 2:
            raise ValueError(f"a head-score matrix must be (layers, heads), got shape {tuple(matrix.shape)}")
        return matrix
    if not isinstance(data, dict) or not data:
        raise ValueError("head scores must be HeadKV's {'layer-head': [scores]} object or a (layers, heads) list")
    cells = {}
    for key, value in data.items():
        try:
            layer, head = (int(x) for x in str(key).split("-"))
        except ValueError:
            raise ValueError(f"head-score key {key!r} is not '<layer>-<head>' (HeadKV's format)") from None
        values = value if isinstance(value, (list, tuple)) else [value]
        cells[layer, head] = sum(float(v) for v in values) / len(values) if values else 0.0
    n_layers = max(layer for layer, _ in cells) + 1
    n_heads = max(head for _, head in cells) + 1
    missing = [(layer, head) for layer in range(n_layers) for head in range(n_heads) if (layer, head) not in cells]
    if missing:
        raise ValueError(f"head scores miss {len(missing)} of {n_layers} x {n_heads} heads, e.g. {missing[:3]}")
    matrix = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for (layer, head), score in cells.items():
        matrix[layer, head] = score
    return matrix


def load_head_scores(path: str | os.PathLike) -> torch.Tensor:
    """Read a head-score file (HeadKV's format or ours: they are the same)."""
    return parse_head_scores(json.loads(Path(path).read_text()))


def save_head_scores(
    trial_scores: dict[str, list[float]], path: str | os.PathLike, metadata: dict | None = None
) -> Path:
    """
    Write ``{"layer-head": [trial scores]}`` in HeadKV's format (layer-major keys), atomically; ``metadata`` (how the
    scores were computed) goes to ``<path stem>.meta.json`` next to it, leaving the scores file as HeadKV reads it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = dict(sorted(trial_scores.items(), key=lambda kv: tuple(int(x) for x in kv[0].split("-"))))
    for target, payload in ((path, ordered), (path.with_suffix(".meta.json"), metadata)):
        if payload is None:
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=None if payload is ordered else 2)
            f.write("\n")
        os.chmod(tmp, 0o644)  # (mkstemp creates it private; score files are shared data)
        os.replace(tmp, target)
    return path
