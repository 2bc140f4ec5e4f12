"""
Check a leaderboard results folder and package it for the ``nvidia/kvpress-leaderboard`` Space.

``python -m evaluation.leaderboard RESULTS_DIR [--preset leaderboard] [--presses ...] [--out DIR] [--upload]``

The check expands the preset (default ``leaderboard``: Qwen3-8B, RULER 4096, ratios 0.25/0.5/0.75/0.875
and a ``no_press`` baseline), names every configuration with kvpress's own ``EvaluationConfig`` (so the
folder names are exactly kvpress's) and verifies that each folder exists with ``predictions.csv``,
``metrics.json`` and ``config.yaml``, that the config matches the protocol (model, dataset, data_dir,
press, ratio, context-only compression), that the metrics cover every RULER task, and that the press is
recorded with a complete repr. Packaging copies those three files per folder into ``OUT/benchmark/`` (the
Space keeps results under ``benchmark/``). ``--upload`` opens a pull request on the Space with
``huggingface_hub`` (needs ``HF_TOKEN``); without it nothing leaves the machine (dry run).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

import pandas as pd
import yaml

from evaluation.presets import expand, load_preset
from evaluation.tasks import RULER_ORDER
from evaluation.worker import RESULT_FILES

SPACE_ID = "nvidia/kvpress-leaderboard"
SPACE_RESULTS_DIR = "benchmark"


def expected_runs(preset_name: str, presses: list[str] | None, kvpress_eval_dir: str | None = None) -> list:
    """The preset's jobs, named by kvpress's own code."""
    from evaluation.kvpress_eval import import_kvpress_evaluation
    from evaluation.registry import register
    from evaluation.run import name_jobs

    preset = load_preset(preset_name)
    if presses:
        preset.presses = ["no_press"] + [p for p in presses if p != "no_press"]
    kv = import_kvpress_evaluation(kvpress_eval_dir)
    register(kv.registry)
    return name_jobs(expand(preset), kv)


def check_run(folder: Path, job) -> list[str]:
    """Problems of one results folder against its job (empty: fine)."""
    if not folder.is_dir():
        return ["missing"]
    problems = [f"{name} missing" for name in RESULT_FILES if not (folder / name).is_file()]
    if problems:
        return problems
    config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    for key in ("model", "dataset", "data_dir", "press_name"):
        if str(config.get(key)) != str(job.config.get(key)):
            problems.append(f"config.yaml {key}={config.get(key)!r}, expected {job.config.get(key)!r}")
    if abs(float(config.get("compression_ratio", -1)) - job.compression_ratio) > 1e-9:
        problems.append(
            f"config.yaml compression_ratio={config.get('compression_ratio')}, expected {job.compression_ratio}"
        )
    if config.get("query_aware"):
        problems.append("query_aware compression (the leaderboard's main table is context-only)")
    if config.get("fraction", 1.0) != 1.0:
        problems.append(f"fraction={config.get('fraction')} (the leaderboard needs the whole dataset)")
    command = str(config.get("press_init_command"))
    if job.press != "no_press" and (" object at 0x" in command or "(" not in command):
        problems.append(f"incomplete press repr in config.yaml: {command!r}")
    metrics = json.loads((folder / "metrics.json").read_text())
    if job.config.get("dataset") == "ruler":
        missing = [task for task in RULER_ORDER if task not in metrics]
        if missing:
            problems.append(f"metrics.json lacks RULER tasks {missing}")
    predictions = pd.read_csv(folder / "predictions.csv")
    if predictions.empty or "predicted_answer" not in predictions.columns:
        problems.append("predictions.csv has no predictions")
    return problems


def check(results_dir: Path, jobs) -> dict[str, list[str]]:
    """``{folder name: problems}`` for every expected folder with a problem (empty: complete)."""
    report = {}
    for job in jobs:
        problems = check_run(results_dir / job.name, job)
        if problems:
            report[job.name] = problems
    return report


def package(results_dir: Path, jobs, out: Path) -> Path:
    """Copy the result files of ``jobs`` into ``out/benchmark/<name>/``; returns ``out/benchmark``."""
    target = out / SPACE_RESULTS_DIR
    if target.exists():
        shutil.rmtree(target)
    for job in jobs:
        (target / job.name).mkdir(parents=True)
        for name in RESULT_FILES:
            shutil.copy2(results_dir / job.name / name, target / job.name / name)
    return target


def upload(folder: Path, message: str) -> str:
    """Open a pull request on the leaderboard Space adding ``folder`` under ``benchmark/``."""
    from huggingface_hub import HfApi

    commit = HfApi().upload_folder(
        repo_id=SPACE_ID,
        repo_type="space",
        folder_path=str(folder),
        path_in_repo=SPACE_RESULTS_DIR,
        commit_message=message,
        create_pr=True,
    )
    return str(getattr(commit, "pr_url", None) or commit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir")
    parser.add_argument("--preset", default="leaderboard", help="preset describing the protocol (default leaderboard)")
    parser.add_argument("--presses", help="comma-separated presses to submit (default: the preset's)")
    parser.add_argument("--out", help="packaging folder (default RESULTS_DIR/submission)")
    parser.add_argument("--kvpress-eval-dir")
    parser.add_argument("--upload", action="store_true", help=f"open a pull request on the {SPACE_ID} Space")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    results_dir = Path(args.results_dir).resolve()
    presses = [p.strip() for p in args.presses.split(",")] if args.presses else None
    jobs = expected_runs(args.preset, presses, args.kvpress_eval_dir)
    problems = check(results_dir, jobs)
    print(f"{len(jobs)} configurations expected in {results_dir}")
    for name, issues in problems.items():
        print(f"  INCOMPLETE {name}: {'; '.join(issues)}")
    if problems:
        print(f"{len(problems)} configuration(s) incomplete: not packaged. Run the sweep (it resumes) and retry.")
        return 1
    out = Path(args.out).resolve() if args.out else results_dir / "submission"
    folder = package(results_dir, jobs, out)
    files = sorted(p.relative_to(out) for p in folder.rglob("*") if p.is_file())
    print(f"complete; packaged {len(files)} files into {folder}")
    presses_done = sorted({job.press for job in jobs})
    message = f"Add {', '.join(p for p in presses_done if p != 'no_press')} results (kvpress-critical)"
    if not args.upload:
        print(f"dry run: would open a pull request on the {SPACE_ID} Space adding {SPACE_RESULTS_DIR}/ with:")
        for path in files:
            print(f"  {path}")
        print("re-run with --upload (and HF_TOKEN set) to submit")
        return 0
    print(f"pull request: {upload(folder, message)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
