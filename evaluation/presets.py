"""
Presets: small YAML files describing a sweep, expanded into one job per configuration.

A preset lists ``models``, ``datasets`` (kvpress dataset name + ``data_dir``; a ``generate`` block makes a
local RULER-style dataset instead of a Hugging Face one), ``presses`` and ``compression_ratios``, plus
options passed to kvpress's ``EvaluationConfig`` (``device``, ``model_kwargs``, ``fraction``,
``max_new_tokens``, ``max_context_length``, ``query_aware``), and ``head_scores`` (model -> HeadKV head-score file, for
the HeadKV presses on models without shipped scores) and ``chunk_size`` (prefill every press but ``no_press`` in
chunks, :class:`kvpress_critical.presses.chunked_prefill_press.ChunkedPrefillPress`: the chunk size becomes part of
the press name, so of the results folder, and the press's repr in ``config.yaml`` shows it). ``no_press`` runs once
per model and dataset
(kvpress forces its ratio to 0). A model is a name (or path), ``embedded`` for this package's SmolLM2, or a
mapping ``{name: ..., gpus: 2}`` for models that need several GPUs. A press is a registry name or a mapping that
sets its parameters (:func:`press_entry`); DuoAttention's ratio is passed as ``head_compression_ratio``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evaluation.registry import HEAD_RATIO_PRESSES, variant_name

PRESET_DIR = Path(__file__).resolve().parent / "presets"
EMBEDDED = "embedded"
CONFIG_KEYS = ("device", "model_kwargs", "fraction", "max_new_tokens", "max_context_length", "query_aware", "seed")


@dataclass(frozen=True)
class Model:
    """A model of a sweep: its name for kvpress (a hub id or a path) and how many GPUs one job needs."""

    name: str
    gpus: int = 1

    @property
    def embedded(self) -> bool:
        return self.name == EMBEDDED


@dataclass(frozen=True)
class DatasetSpec:
    """A dataset of a sweep; ``generate`` holds the arguments of a locally generated RULER-style dataset."""

    dataset: str
    data_dir: str | None = None
    generate: dict | None = None


@dataclass
class Preset:
    """A parsed preset file."""

    name: str
    models: list[Model]
    datasets: list[DatasetSpec]
    presses: list[str]
    compression_ratios: list[float]
    config: dict[str, Any] = field(default_factory=dict)
    output_dir: str = "outputs"
    description: str = ""
    head_scores: dict[str, str] = field(default_factory=dict)  # model -> HeadKV head-score file
    chunk_size: int | None = None  # prefill in chunks (ChunkedPrefillPress): every press but no_press
    slurm: dict[str, Any] = field(default_factory=dict)  # --launcher slurm defaults: partition, time, account...


@dataclass(frozen=True)
class Job:
    """One configuration: what kvpress's runner receives (``config``) and where its results land (``name``)."""

    model: Model
    dataset: DatasetSpec
    press: str
    compression_ratio: float
    config: dict[str, Any]
    name: str = ""

    def describe(self) -> str:
        data = f"{self.dataset.dataset}/{self.dataset.data_dir}" if self.dataset.data_dir else self.dataset.dataset
        return f"{self.model.name} | {data} | {self.press} | {self.compression_ratio:g}"


def preset_path(preset: str) -> Path:
    """The YAML file of a named preset (``smoke``, ``paper``, ``leaderboard``) or a path to one."""
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no preset {preset!r}; known presets: {', '.join(known)} (or a path to a YAML file)")
    return path


def load_preset(preset: str) -> Preset:
    """Parse a preset by name or path."""
    path = preset_path(preset)
    raw = yaml.safe_load(path.read_text()) or {}
    known = {"models", "datasets", "presses", "compression_ratios", "output_dir", "description", "head_scores"}
    known |= {"chunk_size", "slurm"}
    unknown = set(raw) - known
    unknown -= set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    for key in ("models", "datasets", "presses", "compression_ratios"):
        if not raw.get(key):
            raise ValueError(f"{path}: {key!r} is missing or empty")
    models = [Model(**m) if isinstance(m, dict) else Model(str(m)) for m in raw["models"]]
    datasets = [
        DatasetSpec(d["dataset"], None if d.get("data_dir") is None else str(d["data_dir"]), d.get("generate"))
        for d in raw["datasets"]
    ]
    return Preset(
        name=path.stem,
        models=models,
        datasets=datasets,
        presses=[press_entry(p, path) for p in raw["presses"]],
        compression_ratios=[float(r) for r in raw["compression_ratios"]],
        config={k: raw[k] for k in CONFIG_KEYS if k in raw},
        output_dir=str(raw.get("output_dir", f"outputs/{path.stem}")),
        description=str(raw.get("description", "")).strip(),
        head_scores={str(k): str(v) for k, v in (raw.get("head_scores") or {}).items()},
        chunk_size=None if raw.get("chunk_size") is None else int(raw["chunk_size"]),
        slurm=dict(raw.get("slurm") or {}),
    )


def press_entry(entry, path: Path) -> str:
    """
    A preset's press: a registry name, or ``{press: <name>, <parameter>: <value>...}`` (``first_stage_ratio``,
    ``window_size``, ``kernel_size``, ``norm``) which becomes the name of that variant
    (:func:`evaluation.registry.variant_name`: ``{press: snapkv, window_size: 256, kernel_size: 1}`` is
    ``snapkv_window256_kernel1``), so that the results folder names it and variants never collide.
    """
    if not isinstance(entry, dict):
        return str(entry)
    parameters = dict(entry)
    name = parameters.pop("press", None)
    if name is None:
        raise ValueError(f"{path}: a press given as a mapping needs 'press: <registry name>', got {entry}")
    try:
        return variant_name(str(name), **parameters)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def model_name_for_kvpress(model: Model) -> str:
    """The ``model`` string kvpress receives (the embedded model is passed as its folder name, see worker)."""
    if model.embedded:
        from kvpress_critical.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return model.name


def expand(preset: Preset) -> list[Job]:
    """One job per model x dataset x press x ratio; ``no_press`` once per model and dataset."""
    jobs = []
    for model in preset.models:
        for dataset in preset.datasets:
            for press in preset.presses:
                ratios = [0.0] if press == "no_press" else preset.compression_ratios
                for ratio in ratios:
                    config = dict(preset.config)
                    config.update(
                        dataset=dataset.dataset,
                        data_dir=dataset.data_dir,
                        model=model_name_for_kvpress(model),
                        press_name=press,
                        compression_ratio=ratio,
                    )
                    if press in HEAD_RATIO_PRESSES:  # DuoAttention: the ratio of heads reduced to sink + window
                        config["head_compression_ratio"] = ratio
                    jobs.append(Job(model, dataset, press, ratio, config))
    return jobs
