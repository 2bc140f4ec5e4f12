"""
Sweep driver: ``bash evaluation/evaluate.sh [options]`` (or ``python -m evaluation.run``).

Runs a preset (``smoke``, ``paper``, ``leaderboard`` or a YAML file) through kvpress's own evaluation
runner with our presses registered, one job per configuration, then aggregates the results. Without a
GPU or without network access the default preset is ``smoke`` (the embedded SmolLM2 on a locally
generated RULER-style dataset, on CPU); with both, ``paper``.

Examples
--------
bash evaluation/evaluate.sh --dry-run                      # the job list of the default preset
bash evaluation/evaluate.sh --preset smoke --n-samples 4   # a quick CPU sweep
bash evaluation/evaluate.sh --preset leaderboard           # Qwen3-8B, RULER 4096, ratios 0.25..0.875
bash evaluation/evaluate.sh --preset paper --presses snapkv,critical_snapkv --ratios 0.8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from evaluation.presets import Job, Model, Preset, expand, load_preset
from evaluation.sweep import REPO_ROOT, gpu_ids, run_sweep
from evaluation.worker import is_finished

logger = logging.getLogger("evaluation.run")


def network_available(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub can be reached (and is not disabled with ``HF_HUB_OFFLINE``)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def default_preset() -> tuple[str, str]:
    """``(preset, reason)``: ``paper`` with GPUs and network access, else ``smoke``."""
    if not gpu_ids():
        return "smoke", "no GPU"
    if not network_available():
        return "smoke", "no network access to the Hugging Face Hub"
    return "paper", "GPUs and network access available"


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [v.strip() for v in value.split(",") if v.strip()]


def apply_overrides(preset: Preset, args: argparse.Namespace) -> Preset:
    """Restrict or override a preset with command-line options."""
    if args.presses:
        preset.presses = _split(args.presses)
    if args.ratios:
        preset.compression_ratios = [float(r) for r in _split(args.ratios)]
    if args.models:
        wanted = _split(args.models)
        preset.models = [m for m in preset.models if m.name in wanted] or [Model(name) for name in wanted]
    if args.datasets:
        wanted = _split(args.datasets)
        preset.datasets = [d for d in preset.datasets if d.dataset in wanted or f"{d.dataset}:{d.data_dir}" in wanted]
        if not preset.datasets:
            raise SystemExit(f"--datasets {args.datasets} matches no dataset of the preset")
    if args.n_samples is not None:  # samples per task (RULER-style data) or contexts (quality data)
        preset.datasets = [replace(d, generate=_with_sample_count(d.generate, args.n_samples)) for d in preset.datasets]
    if args.chunk_size is not None:
        preset.chunk_size = args.chunk_size
    if preset.chunk_size:
        from evaluation.registry import BASELINE, chunked_name

        preset.presses = [p if p == BASELINE else chunked_name(p, preset.chunk_size) for p in preset.presses]
    for key in ("fraction", "max_new_tokens", "device"):
        value = getattr(args, key)
        if value is not None:
            preset.config[key] = value
    return preset


def _with_sample_count(generate: dict | None, n: int) -> dict | None:
    if not generate:
        return generate
    key = "n_contexts" if generate.get("generator") == "quality" else "n_samples"
    return {**generate, key: n}


def prepare_datasets(preset: Preset, output_dir: Path) -> dict[str, str]:
    """Generate the preset's local datasets under ``output_dir/datasets`` (once); ``{name: folder}``."""
    from kvpress_critical.data import GENERATORS, save_ruler_dataset

    folders: dict[str, str] = {}
    for spec in preset.datasets:
        if not spec.generate:
            continue
        root = output_dir / "datasets" / spec.dataset
        folders[spec.dataset] = str(root)
        if spec.data_dir is None:
            raise ValueError(f"dataset {spec.dataset}: a generated dataset needs a data_dir")
        generate = dict(spec.generate)
        tokenizer_name = generate.pop("tokenizer", "embedded")
        generator_name = generate.pop("generator", "ruler")
        if generator_name not in GENERATORS:
            raise SystemExit(
                f"dataset {spec.dataset}: unknown generator {generator_name!r}; known: {sorted(GENERATORS)}"
            )
        generator = GENERATORS[generator_name]
        metadata = {
            "generator": f"kvpress_critical.data.{generator.__name__}",
            "tokenizer": tokenizer_name,
            **generate,
        }
        meta_file = root / f"{spec.data_dir}.json"
        if meta_file.is_file():
            existing = json.loads(meta_file.read_text())
            if existing != metadata:
                raise SystemExit(
                    f"{meta_file} was generated with {existing}, this sweep asks for {metadata}: results in "
                    f"{output_dir} would mix datasets. Use another --output-dir."
                )
            continue
        logger.info("generating the %s/%s dataset (%s)", spec.dataset, spec.data_dir, generate)
        df = generator(_tokenizer(tokenizer_name), **generate)
        save_ruler_dataset(df, root, spec.data_dir, metadata=metadata)
    # datasets without a generate block but sharing a generated dataset's name use its folder
    return folders


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == "embedded":
        from kvpress_critical.default_model import default_model_path

        return AutoTokenizer.from_pretrained(default_model_path())
    return AutoTokenizer.from_pretrained(name)


def name_jobs(jobs: list[Job], kv) -> list[Job]:
    """Give each job the results folder name kvpress's runner will use (computed by kvpress's own code)."""
    named = []
    logging.getLogger(kv.evaluate.__name__).setLevel(logging.WARNING)  # "Overriding compression_ratio to 0.0"
    for job in jobs:
        with tempfile.TemporaryDirectory() as tmp:
            config = kv.evaluate.EvaluationConfig(**{**job.config, "output_dir": tmp, "log_level": "WARNING"})
            folder = config.get_results_dir(Path(tmp))
        named.append(replace(job, name=folder.name))
    names = [job.name for job in named]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"several configurations share a results folder: {duplicates}")
    return named


def check_presses(preset: Preset, registry) -> None:
    from evaluation.registry import ensure_press

    unknown = [p for p in preset.presses if not ensure_press(registry, p)]
    if unknown:
        raise SystemExit(f"unknown press(es) {unknown}; see evaluation/registry.py and kvpress's evaluate_registry.py")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evaluation/evaluate.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", help="smoke, paper, leaderboard or a YAML file (default: see above)")
    parser.add_argument("--output-dir", help="results folder (default: the preset's output_dir)")
    parser.add_argument("--dry-run", action="store_true", help="print the job list and exit")
    parser.add_argument("--presses", help="comma-separated presses (overrides the preset)")
    parser.add_argument("--ratios", help="comma-separated compression ratios (overrides the preset)")
    parser.add_argument("--models", help="comma-separated models (overrides the preset)")
    parser.add_argument("--datasets", help="comma-separated datasets, as name or name:data_dir (filters the preset)")
    parser.add_argument("--n-samples", type=int, help="samples per task (contexts, for quality data) of generated data")
    parser.add_argument("--fraction", type=float, help="fraction of each dataset (kvpress's option)")
    parser.add_argument("--max-new-tokens", type=int, help="kvpress's max_new_tokens (default: per task)")
    parser.add_argument("--device", help="'cpu' runs on CPU (--workers jobs); otherwise each job gets its GPU(s)")
    parser.add_argument("--chunk-size", type=int, help="prefill in chunks of this many tokens (ChunkedPrefillPress)")
    parser.add_argument("--gpus", help="comma-separated GPU ids to use (default: all visible)")
    parser.add_argument("--workers", type=int, default=1, help="parallel jobs without GPUs (default 1)")
    parser.add_argument("--threads", type=int, help="torch threads per CPU job (default: CPUs // workers)")
    parser.add_argument("--kvpress-eval-dir", help="kvpress's evaluation/ folder (default: $KVPRESS_EVAL_DIR or sdist)")
    parser.add_argument("--no-aggregate", action="store_true", help="skip the aggregation at the end")
    cluster = parser.add_argument_group("launchers (--launcher ray|slurm; local: this machine's GPUs or CPU workers)")
    cluster.add_argument("--launcher", choices=("local", "ray", "slurm"), default="local")
    cluster.add_argument("--ray-address", help="Ray cluster address (default $RAY_ADDRESS, else a local cluster)")
    cluster.add_argument("--gpus-per-job", type=float, help="GPUs per configuration (times the model's gpus)")
    cluster.add_argument("--partition", help="SLURM partition")
    cluster.add_argument("--time", help="SLURM time limit per configuration, e.g. 04:00:00")
    cluster.add_argument("--account", help="SLURM account")
    cluster.add_argument("--mem", help="SLURM memory per task, e.g. 64G")
    cluster.add_argument("--max-parallel", type=int, help="SLURM: at most this many array tasks at once")
    cluster.add_argument("--no-submit", action="store_true", help="SLURM: write the array, print the sbatch command")
    cluster.add_argument("--status", action="store_true", help="SLURM: finished / failed / missing configurations")
    parser.add_argument("--log-level", default="INFO")
    return parser


def _stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")  # the sweep then stops its workers


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.preset is None:
        args.preset, reason = default_preset()
        logger.info("preset %s (%s); choose one with --preset", args.preset, reason)
    preset = apply_overrides(load_preset(args.preset), args)
    output_dir = Path(args.output_dir or preset.output_dir)
    if not output_dir.is_absolute():
        output_dir = Path.cwd() / output_dir
    output_dir = output_dir.resolve()

    from evaluation.kvpress_eval import import_kvpress_evaluation
    from evaluation.registry import register

    datasets = prepare_datasets(preset, output_dir) if not args.dry_run else _planned_datasets(preset, output_dir)
    kv = import_kvpress_evaluation(args.kvpress_eval_dir)
    scorers = dataset_scorers(preset)
    register(kv.registry, datasets, scorers)
    check_presses(preset, kv.registry)
    jobs = name_jobs(expand(preset), kv)

    if args.dry_run:
        print(f"preset {preset.name}: {len(jobs)} configurations -> {output_dir}")
        for job in jobs:
            status = "done   " if is_finished(output_dir / job.name) else "pending"
            print(f"  [{status}] {job.describe():<70} {job.name}")
        return 0

    cpu_only = preset.config.get("device") == "cpu"  # the preset (or --device cpu) asks for CPU even with GPUs
    # config.yaml records the output folder as the user gave it (not this machine's absolute path)
    label = args.output_dir or preset.output_dir
    extra = {"datasets": datasets, "kvpress_eval_dir": str(kv.folder), "output_dir_label": label}
    extra["dataset_scorers"] = scorers
    if preset.head_scores:  # absolute paths: workers run elsewhere (the embedded model's folder, a cluster node)
        extra["head_scores"] = {m: str(Path(p).expanduser().resolve()) for m, p in preset.head_scores.items()}
    if any(m.embedded for m in preset.models):
        from kvpress_critical.default_model import default_model_path

        extra["model_cwd"] = str(default_model_path().parent)
    expected = [(job.name, job.config) for job in jobs]

    if args.launcher == "slurm":
        return _slurm(args, preset, jobs, output_dir, extra, expected, cpu_only)
    if args.launcher == "ray":
        from evaluation.ray_sweep import run_ray_sweep

        gpus_per_job = 0 if cpu_only else (args.gpus_per_job if args.gpus_per_job is not None else 1)
        logger.info("%d configurations on Ray (%s GPU(s) per job)", len(jobs), gpus_per_job)
        report = run_ray_sweep(
            jobs,
            output_dir,
            worker_extra=extra,
            address=args.ray_address,
            gpus_per_job=gpus_per_job,
            threads_per_job=args.threads or 1,
        )
    else:
        gpus = [] if cpu_only else (_split(args.gpus) if args.gpus else gpu_ids())
        logger.info("%d configurations, %s", len(jobs), f"GPUs {gpus}" if gpus else f"{args.workers} CPU worker(s)")
        report = run_sweep(
            jobs, output_dir, worker_extra=extra, gpus=gpus, cpu_workers=args.workers, threads_per_job=args.threads
        )
    logger.info(
        "sweep: %d run, %d skipped (already finished), %d failed",
        len(report.done),
        len(report.skipped),
        len(report.failed),
    )
    _aggregate(args, output_dir, expected)
    for name in report.failed:
        logger.error("failed: %s (see %s)", name, output_dir / "failed" / f"{name}.txt")
    return 0 if report.ok else 1


def _aggregate(args, output_dir: Path, expected) -> None:
    if not args.no_aggregate:
        from evaluation.aggregate import aggregate

        summary = aggregate(output_dir, expected=expected)
        logger.info("tables and plots in %s", summary)


def _slurm(args, preset: Preset, jobs, output_dir: Path, extra: dict, expected, cpu_only: bool) -> int:
    """``--launcher slurm``: write (and submit) the job array, or with ``--status`` report on the sweep."""
    from evaluation import slurm

    if args.status:
        result = slurm.status(output_dir, jobs)
        slurm.print_status(result, output_dir)
        if result["finished"]:
            _aggregate(args, output_dir, expected)
        return 0 if not result["failed"] else 1
    options = dict(preset.slurm)
    cli = dict(
        partition=args.partition,
        time=args.time,
        account=args.account,
        max_parallel=args.max_parallel,
        cpus_per_job=args.threads,
        mem=args.mem,
        gpus_per_job=args.gpus_per_job,
    )
    options.update({k: v for k, v in cli.items() if v is not None})
    if cpu_only:
        options["gpus_per_job"] = 0
    script, manifest, pending = slurm.write_array(jobs, output_dir, extra, options)
    if script is None:
        print(f"every configuration of {output_dir} is finished: nothing to submit")
        return 0
    print(f"{len(pending)} configurations (of {len(jobs)}) in the job array {script}\nmanifest {manifest}")
    slurm.submit(script, dry_run=args.no_submit)
    print(
        f"follow it with: bash evaluation/evaluate.sh --launcher slurm --status --preset {args.preset}"
        + (f" --output-dir {args.output_dir}" if args.output_dir else "")
    )
    return 0


def dataset_scorers(preset: Preset) -> dict[str, str]:
    """The scorer of each generated dataset (``ruler`` unless its generator has its own, e.g. ``scbench``)."""
    from kvpress_critical.data import SCORERS

    scorers: dict[str, str] = {}
    for spec in preset.datasets:
        if spec.generate:
            scorer = SCORERS.get(spec.generate.get("generator", "ruler"), "ruler")
            if scorers.setdefault(spec.dataset, scorer) != scorer:
                raise SystemExit(f"dataset {spec.dataset}: its data_dirs come from generators with different scorers")
    return scorers


def _planned_datasets(preset: Preset, output_dir: Path) -> dict[str, str]:
    """Dataset folders a run would use, without generating anything (dry run)."""
    return {d.dataset: str(output_dir / "datasets" / d.dataset) for d in preset.datasets if d.generate}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())


__all__ = ["apply_overrides", "default_preset", "main", "name_jobs", "prepare_datasets"]
