"""
The sweep: a queue of jobs run by worker processes, one job per free GPU (or per CPU worker).

- resume: a configuration whose results folder is complete is skipped (kvpress's own "results exist"
  check never fires, because its runner first creates a fresh numbered sub-folder);
- failure isolation: a failing configuration is logged with its traceback (``logs/<name>.log`` and
  ``failed/<name>.txt``) and the sweep goes on;
- results are published by the worker with an atomic rename and are never overwritten;
- progress is shown with tqdm.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout
from tqdm import tqdm

from evaluation.presets import Job
from evaluation.worker import RESULT_FILES, is_finished

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class SweepReport:
    """What a sweep did, by results folder name."""

    done: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # name -> last lines of the traceback

    @property
    def ok(self) -> bool:
        return not self.failed


def gpu_ids() -> list[str]:
    """Visible GPUs, as ids valid for ``CUDA_VISIBLE_DEVICES`` in a child process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [i.strip() for i in visible.split(",") if i.strip() and i.strip() != "-1"]
        if ids:
            try:
                import torch

                return ids[: torch.cuda.device_count()]
            except ImportError:
                return ids
        return []
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def job_payload(job: Job, output_dir: Path, staging_dir: Path, extra: dict) -> dict:
    """The JSON document a worker receives."""
    payload = {
        "name": job.name,
        "config": job.config,
        "output_dir": str(output_dir),
        "output_dir_label": extra.get("output_dir_label", str(output_dir)),
        "staging_dir": str(staging_dir),
    }
    payload.update(extra)
    return payload


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _set_aside_incomplete(output_dir: Path, name: str) -> None:
    """Move an incomplete results folder (e.g. left by a crash) out of the way; it is not a finished result."""
    folder = output_dir / name
    if folder.exists() and not is_finished(folder):
        aside = output_dir / ".incomplete" / f"{name}.{time.strftime('%Y%m%d-%H%M%S')}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.rename(folder, aside)
        logger.warning("moved the incomplete results folder %s to %s", folder, aside)


@dataclass
class _Running:
    """A job being run by a worker process."""

    job: Job
    process: subprocess.Popen
    devices: list[str]
    log: Path
    staging: Path
    job_file: Path
    t0: float

    def cleanup(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.job_file.unlink(missing_ok=True)


def run_sweep(
    jobs: list[Job],
    output_dir: str | os.PathLike,
    worker_extra: dict | None = None,
    gpus: list[str] | None = None,
    cpu_workers: int = 1,
    threads_per_job: int | None = None,
    poll_s: float = 0.5,
) -> SweepReport:
    """
    Run ``jobs`` (already named, see ``evaluation.run.name_jobs``) and return what happened.

    Parameters
    ----------
    jobs : list of Job
        Configurations; finished ones (complete results folder under ``output_dir``) are skipped.
    output_dir : path-like
        Where results folders land, in kvpress's layout.
    worker_extra : dict, optional
        Fields added to every worker payload (registered datasets, kvpress eval dir, model cwd...).
    gpus : list of str, optional
        GPU ids to schedule on; each job takes ``job.model.gpus`` of them. Empty or None: CPU.
    cpu_workers : int, default=1
        Parallel jobs without GPUs.
    threads_per_job : int, optional
        torch threads per CPU job (default: CPU count // cpu_workers).
    """
    output_dir = Path(output_dir).resolve()
    lock = sweep_lock(output_dir)
    try:
        return _run_sweep(jobs, output_dir, worker_extra, gpus, cpu_workers, threads_per_job, poll_s)
    finally:
        lock.release()


def pending_jobs(jobs: list[Job], output_dir: Path, report: SweepReport) -> list[Job]:
    """The jobs not finished yet; the finished ones are recorded as skipped in ``report`` (resume)."""
    pending = []
    for job in jobs:
        if is_finished(output_dir / job.name):
            report.skipped.append(job.name)
        else:
            pending.append(job)
    if report.skipped:
        logger.info("%d finished configuration(s) skipped (resume)", len(report.skipped))
    return pending


def _run_sweep(jobs, output_dir: Path, worker_extra, gpus, cpu_workers, threads_per_job, poll_s) -> SweepReport:
    for sub in ("logs", ".staging", ".jobs"):
        (output_dir / sub).mkdir(exist_ok=True)
    report = SweepReport()
    pending = pending_jobs(jobs, output_dir, report)
    gpus = list(gpus or [])
    if gpus:
        too_big = [job for job in pending if job.model.gpus > len(gpus)]
        for job in too_big:
            report.failed[job.name] = f"needs {job.model.gpus} GPUs, only {len(gpus)} available"
            logger.error("%s: %s", job.name, report.failed[job.name])
        pending = [job for job in pending if job not in too_big]
        free = list(gpus)
    else:
        free = [f"cpu{i}" for i in range(max(1, cpu_workers))]
        threads_per_job = threads_per_job or max(1, (os.cpu_count() or 1) // max(1, cpu_workers))
    running: list[_Running] = []
    extra = dict(worker_extra or {})
    bar = tqdm(total=len(pending), desc="sweep", unit="run", dynamic_ncols=True)
    try:
        while pending or running:
            launched = True
            while launched and pending:
                launched = False
                for job in pending:
                    need = job.model.gpus if gpus else 1
                    if need <= len(free):
                        devices, free = free[:need], free[need:]
                        pending.remove(job)
                        running.append(_launch(job, devices, bool(gpus), output_dir, extra, threads_per_job))
                        launched = True
                        break
            time.sleep(poll_s)
            for run in list(running):
                code = run.process.poll()
                if code is None:
                    continue
                running.remove(run)
                free.extend(run.devices)
                run.cleanup()
                _finish(run, code, output_dir, report)
                bar.update(1)
                bar.set_postfix(done=len(report.done), failed=len(report.failed))
    finally:
        bar.close()
        for run in running:  # interrupted: stop our own workers, drop their partial output
            run.process.terminate()
            run.process.wait()
            run.cleanup()
            logger.warning("interrupted %s (not finished, will run again next time)", run.job.name)
    return report


def prepare_job(job: Job, output_dir: Path, extra: dict, gpus: int = 0, threads: int | None = None) -> tuple:
    """
    Everything one configuration's worker needs, as every launcher runs it: ``(job file, staging folder, log)``.

    Sets an incomplete results folder aside, writes the worker's JSON payload (``gpus`` > 0: the job's devices are
    those it is given, ``cuda:0``, or ``auto`` for several; otherwise ``threads`` torch threads) under ``.jobs``,
    and reserves a private staging folder and the log path.
    """
    for sub in ("logs", ".staging", ".jobs", "failed"):
        (output_dir / sub).mkdir(parents=True, exist_ok=True)
    _set_aside_incomplete(output_dir, job.name)
    staging = output_dir / ".staging" / f"{job.name}.{uuid.uuid4().hex[:8]}"
    payload = job_payload(job, output_dir, staging, extra)
    if gpus:
        payload["config"] = {**payload["config"], "device": "auto" if gpus > 1 else "cuda:0"}
    elif threads:
        payload["threads"] = threads
    fd, job_file = tempfile.mkstemp(prefix=f"{job.name}.", suffix=".json", dir=output_dir / ".jobs")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    return Path(job_file), staging, output_dir / "logs" / f"{job.name}.log"


def worker_env(gpu_devices: list[str] | None = None, threads: int | None = None, base: dict | None = None) -> dict:
    """The environment of a worker process: the repository importable, its GPUs or its CPU threads."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    if gpu_devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_devices)
    elif threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def worker_command(job_file: Path, python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "evaluation.worker", str(job_file)]


def _launch(job: Job, devices: list[str], on_gpu: bool, output_dir: Path, extra: dict, threads: int | None):
    job_file, staging, log = prepare_job(job, output_dir, extra, gpus=len(devices) if on_gpu else 0, threads=threads)
    env = worker_env(devices if on_gpu else None, None if on_gpu else threads)
    with open(log, "w") as log_file:
        log_file.write(f"# {job.describe()}\n# devices: {','.join(devices)}\n")
        log_file.flush()
        process = subprocess.Popen(
            worker_command(job_file), stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
        )
    logger.info("started %s on %s", job.name, ",".join(devices))
    return _Running(job, process, devices, log, staging, job_file, time.time())


def record_result(report: SweepReport, job: Job, code: int, log: Path, output_dir: Path, seconds: float) -> None:
    """Count a finished worker as done (complete results folder) or failed (traceback kept in ``failed/``)."""
    name = job.name
    failed_file = output_dir / "failed" / f"{name}.txt"
    if code == 0 and is_finished(output_dir / name):
        report.done.append(name)
        failed_file.unlink(missing_ok=True)
        logger.info("finished %s in %.0f s", name, seconds)
        return
    tail = _tail(log)
    report.failed[name] = tail
    failed_file.parent.mkdir(exist_ok=True)
    failed_file.write_text(f"{job.describe()}\nexit status {code}; full log: {log}\n\n{tail}\n")
    logger.error("FAILED %s (exit %s after %.0f s), the sweep goes on; log %s\n%s", name, code, seconds, log, tail)


def _finish(run: _Running, code: int, output_dir: Path, report: SweepReport) -> None:
    record_result(report, run.job, code, run.log, output_dir, time.time() - run.t0)


def sweep_lock(output_dir: Path) -> FileLock:
    """The lock that makes one sweep per results folder (whatever the launcher)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(output_dir / ".sweep.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise RuntimeError(f"another sweep is running on {output_dir}; wait for it or use another output folder")
    return lock


__all__ = [
    "RESULT_FILES",
    "SweepReport",
    "gpu_ids",
    "prepare_job",
    "record_result",
    "run_sweep",
    "sweep_lock",
    "worker_command",
    "worker_env",
]
