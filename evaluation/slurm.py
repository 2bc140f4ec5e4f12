"""
The sweep on a SLURM cluster: ``bash evaluation/evaluate.sh --launcher slurm`` writes one job array, and
``--launcher slurm --status`` reports on it.

- ``<output_dir>/slurm/sweep-<stamp>.sh``: an ``sbatch --array=0-(n-1)`` script, one array index per configuration
  still pending (finished ones are never resubmitted), with the partition, time limit, GPUs, CPUs, account and
  concurrency from the command line or the preset's ``slurm:`` section; submitted when ``sbatch`` is on the PATH (the
  command is printed otherwise, or with ``--no-submit``).
- ``<output_dir>/slurm/sweep-<stamp>.json``: the manifest, index -> configuration (the worker's payload). Each array
  task runs ``python -m evaluation.slurm run MANIFEST $SLURM_ARRAY_TASK_ID``: exactly the local launcher's worker
  (same payload, log, atomic publication under the shared results folder), skipped if that configuration finished
  meanwhile, and a failure is written to ``failed/<name>.txt`` like a local failure. A resubmission after failures
  (run the launcher again) writes a new array of what is still missing.
- ``--status``: per configuration of the sweep, finished / failed / missing (not run, or still running), from the
  results folder; the summary tables are rebuilt from what has finished.

Plain sbatch scripts rather than submitit: the array is a file users can read, edit and resubmit with their site's
own options, each task is one CLI call that needs no pickled Python state to be shared between the login node and
the compute nodes (submitit pickles callables, so both must have the same environment), and nothing but Python and
the repository is needed on the cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from evaluation.presets import Job
from evaluation.sweep import REPO_ROOT, SweepReport, job_payload, record_result, worker_command, worker_env
from evaluation.worker import is_finished

DEFAULTS = {
    "partition": None,
    "time": "04:00:00",
    "gpus_per_job": 1,
    "cpus_per_job": 8,
    "account": None,
    "max_parallel": None,
    "mem": None,
}


def write_array(
    jobs: list[Job], output_dir: str | os.PathLike, worker_extra: dict, options: dict, python: str | None = None
) -> tuple[Path | None, Path | None, list[Job]]:
    """
    Write the job-array script and its manifest for the configurations of ``jobs`` not finished yet.

    Returns ``(script, manifest, pending jobs)``; ``(None, None, [])`` when everything is finished.
    """
    output_dir = Path(output_dir).resolve()
    options = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    pending = [job for job in jobs if not is_finished(output_dir / job.name)]
    if not pending:
        return None, None, []
    folder = output_dir / "slurm"
    for sub in (folder, output_dir / "logs", output_dir / "failed", output_dir / ".staging"):
        sub.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{uuid.uuid4().hex[:4]}"
    manifest = folder / f"sweep-{stamp}.json"
    script = folder / f"sweep-{stamp}.sh"
    entries = []
    for index, job in enumerate(pending):
        gpus = int(options["gpus_per_job"]) * job.model.gpus
        payload = job_payload(job, output_dir, output_dir / ".staging" / job.name, worker_extra)
        if gpus:
            payload["config"] = {**payload["config"], "device": "auto" if gpus > 1 else "cuda:0"}
        else:
            payload["threads"] = int(options["cpus_per_job"])
        entries.append(dict(index=index, name=job.name, describe=job.describe(), gpus=gpus, payload=payload))
    document = dict(created=stamp, output_dir=str(output_dir), options=options, configurations=entries)
    tmp = manifest.with_name(f".{manifest.name}.tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, manifest)
    gpus = max(e["gpus"] for e in entries)
    array = f"0-{len(entries) - 1}" + (f"%{options['max_parallel']}" if options["max_parallel"] else "")
    lines = [
        "#!/usr/bin/env bash",
        f"# kvpress-critical sweep: {len(entries)} configurations of {output_dir} (manifest {manifest.name})",
        f"#SBATCH --job-name=kvpress-critical-{stamp}",
        f"#SBATCH --array={array}",
        f"#SBATCH --time={options['time']}",
        f"#SBATCH --cpus-per-task={options['cpus_per_job']}",
        f"#SBATCH --output={output_dir}/logs/slurm-%A_%a.out",
    ]
    if gpus:
        lines.append(f"#SBATCH --gres=gpu:{gpus}")
    for key, flag in (("partition", "partition"), ("account", "account"), ("mem", "mem")):
        if options[key]:
            lines.append(f"#SBATCH --{flag}={options[key]}")
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(REPO_ROOT))}",
        f'export PYTHONPATH={shlex.quote(str(REPO_ROOT))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
        "export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-0} TOKENIZERS_PARALLELISM=false",
        f"exec {shlex.quote(python or sys.executable)} -m evaluation.slurm run {shlex.quote(str(manifest))} "
        '"$SLURM_ARRAY_TASK_ID"',
    ]
    tmp = script.with_name(f".{script.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.chmod(0o755)
    os.replace(tmp, script)
    return script, manifest, pending


def submit(script: Path, dry_run: bool = False) -> str | None:
    """``sbatch script`` when sbatch exists (returns its output); otherwise (or dry run) print the command."""
    command = ["sbatch", str(script)]
    if dry_run or shutil.which("sbatch") is None:
        print(f"submit with: {shlex.join(command)}" + ("" if dry_run else "   (sbatch is not on this machine's PATH)"))
        return None
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    print(result.stdout.strip())
    return result.stdout


def run_task(manifest: str | os.PathLike, index: int) -> int:
    """One array task: the configuration at ``index`` of the manifest, as the local launcher runs it."""
    document = json.loads(Path(manifest).read_text())
    entries = {e["index"]: e for e in document["configurations"]}
    if index not in entries:
        print(f"array index {index} is not in {manifest} (0..{len(entries) - 1})", file=sys.stderr)
        return 2
    entry = entries[index]
    output_dir = Path(document["output_dir"])
    name = entry["name"]
    if is_finished(output_dir / name):
        print(f"{name} already finished: nothing to do")
        return 0
    attempt = os.environ.get("SLURM_ARRAY_JOB_ID", "local") + "-" + uuid.uuid4().hex[:6]
    payload = {**entry["payload"], "staging_dir": str(output_dir / ".staging" / f"{name}.{attempt}")}
    job_file = output_dir / ".jobs" / f"{name}.{attempt}.json"
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps(payload, indent=2))
    log = output_dir / "logs" / f"{name}.log"
    start = time.time()
    threads = payload.get("threads")
    with open(log, "w") as log_file:
        log_file.write(f"# {entry['describe']}\n# slurm array index {index} ({attempt}), node {os.uname().nodename}\n")
        log_file.flush()
        code = subprocess.run(
            worker_command(job_file),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=worker_env(None, threads),
            cwd=REPO_ROOT,
        ).returncode
    shutil.rmtree(payload["staging_dir"], ignore_errors=True)
    job_file.unlink(missing_ok=True)

    class _Job:  # what record_result needs
        def __init__(self):
            self.name = name

        def describe(self):
            return entry["describe"]

    report = SweepReport()
    record_result(report, _Job(), code, log, output_dir, time.time() - start)
    return 0 if report.ok else 1


def status(output_dir: str | os.PathLike, jobs: list[Job] | None = None) -> dict[str, list[str]]:
    """
    ``{"finished": [...], "failed": [...], "missing": [...]}`` for the configurations of ``jobs`` (default: every
    configuration of every manifest under ``output_dir/slurm``), read from the results folder.
    """
    output_dir = Path(output_dir).resolve()
    if jobs is not None:
        names = [job.name for job in jobs]
    else:
        names = []
        for manifest in sorted((output_dir / "slurm").glob("sweep-*.json")):
            names += [e["name"] for e in json.loads(manifest.read_text())["configurations"]]
        names = list(dict.fromkeys(names))
    result = {"finished": [], "failed": [], "missing": []}
    for name in names:
        if is_finished(output_dir / name):
            result["finished"].append(name)
        elif (output_dir / "failed" / f"{name}.txt").is_file():
            result["failed"].append(name)
        else:
            result["missing"].append(name)
    return result


def print_status(result: dict[str, list[str]], output_dir: Path) -> None:
    total = sum(len(v) for v in result.values())
    print(
        f"{output_dir}: {len(result['finished'])} finished, {len(result['failed'])} failed, "
        f"{len(result['missing'])} missing (not run yet, or running), of {total}"
    )
    for name in result["failed"]:
        print(f"  failed:  {name}  (see failed/{name}.txt)")
    for name in result["missing"]:
        print(f"  missing: {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.slurm", description="one SLURM array task")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the configuration at an array index of a manifest")
    run.add_argument("manifest")
    run.add_argument("index", nargs="?", help="array index (default: $SLURM_ARRAY_TASK_ID)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    index = args.index if args.index is not None else os.environ.get("SLURM_ARRAY_TASK_ID")
    if index is None:
        parser.error("no array index: give one or set SLURM_ARRAY_TASK_ID")
    return run_task(args.manifest, int(index))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())


__all__ = ["DEFAULTS", "print_status", "run_task", "status", "submit", "write_array"]
