"""
The sweep on a Ray cluster: ``bash evaluation/evaluate.sh --launcher ray [--ray-address ADDRESS]``.

One Ray task per pending configuration, running exactly what the local launcher runs (the same worker process,
``python -m evaluation.worker JOB.json``, with the same payload, log, resume, atomic publication and failure
record), so results are identical; the results folder must be on a filesystem every node sees. Ray schedules the
tasks on its nodes with ``num_gpus`` per task (``--gpus-per-job``, times the model's ``gpus``; 0 for CPU presets)
and ``num_cpus`` (the torch threads of a CPU job).

- Connection: ``--ray-address`` or ``$RAY_ADDRESS`` (an existing cluster), else a local one started for the sweep.
- Retries are for infrastructure failures only: a task whose worker process or node dies is retried
  (``max_retries``), a configuration that fails (non-zero exit, its traceback in ``failed/<name>.txt``) is not.
- Progress: a tqdm bar advanced as configurations finish.
- Ctrl-C / SIGTERM cancels every task still pending or running (their worker processes are killed); a worker
  publishes its results folder with one atomic rename at its very end, so nothing half-published is left, and
  their staging folders are removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from evaluation.presets import Job
from evaluation.sweep import (
    REPO_ROOT,
    SweepReport,
    pending_jobs,
    prepare_job,
    record_result,
    sweep_lock,
    worker_command,
    worker_env,
)

logger = logging.getLogger(__name__)


def _die_with_parent() -> None:  # pragma: no cover (runs in the child between fork and exec)
    """Linux: the worker process gets SIGKILL if its Ray task's process dies (a cancelled task leaves no orphan)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _run_configuration(job_file: str, log: str, describe: str, repo: str, threads: int | None) -> int:
    """The body of one Ray task: the worker process, as the local launcher starts it (on whichever node)."""
    env = worker_env(None, threads)  # Ray sets CUDA_VISIBLE_DEVICES for the GPUs it gave the task
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    devices = env.get("CUDA_VISIBLE_DEVICES", "cpu")
    with open(log, "w") as log_file:
        log_file.write(f"# {describe}\n# ray node {os.uname().nodename}, devices: {devices}\n")
        log_file.flush()
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        return subprocess.run(
            worker_command(Path(job_file), sys.executable),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=repo,
            preexec_fn=preexec,
        ).returncode


def run_ray_sweep(
    jobs: list[Job],
    output_dir: str | os.PathLike,
    worker_extra: dict | None = None,
    address: str | None = None,
    gpus_per_job: float = 1,
    threads_per_job: int | None = None,
    max_retries: int = 2,
    init_kwargs: dict | None = None,
) -> SweepReport:
    """
    Run ``jobs`` as Ray tasks and return what happened (the same report as the local launcher).

    Parameters
    ----------
    address : str, optional
        Ray cluster address (default ``$RAY_ADDRESS``, else a new local cluster).
    gpus_per_job : float
        GPUs of one task, times the model's ``gpus`` (0 for CPU presets).
    threads_per_job : int, optional
        torch threads (and Ray ``num_cpus``) of a CPU task.
    """
    import ray

    output_dir = Path(output_dir).resolve()
    lock = sweep_lock(output_dir)
    started_here = False
    try:
        report = SweepReport()
        pending = pending_jobs(jobs, output_dir, report)
        if not pending:  # a finished sweep needs no cluster (starting a local one takes seconds to minutes)
            logger.info("nothing pending: Ray is not started")
            return report
        if not ray.is_initialized():
            ray.init(address=address or os.environ.get("RAY_ADDRESS"), log_to_driver=False, **(init_kwargs or {}))
            started_here = True
        extra = dict(worker_extra or {})
        return _run(ray, pending, report, output_dir, extra, gpus_per_job, threads_per_job, max_retries)
    finally:
        if started_here:
            ray.shutdown()
        lock.release()


def _run(
    ray, pending, report: SweepReport, output_dir: Path, extra: dict, gpus_per_job, threads_per_job, max_retries
) -> SweepReport:
    task = ray.remote(max_retries=max_retries, retry_exceptions=False)(_run_configuration)
    refs = {}
    for job in pending:
        gpus = gpus_per_job * job.model.gpus if gpus_per_job else 0
        threads = None if gpus else threads_per_job
        job_file, staging, log = prepare_job(
            job, output_dir, extra, gpus=int(gpus) if gpus >= 1 else 0, threads=threads
        )
        options = {"num_gpus": gpus, "num_cpus": threads or 1}
        ref = task.options(**options).remote(str(job_file), str(log), job.describe(), str(REPO_ROOT), threads)
        refs[ref] = (job, job_file, staging, log, time.time())
    logger.info("%d configurations submitted to Ray (%s)", len(refs), ray.cluster_resources())
    bar = tqdm(total=len(refs), desc="sweep (ray)", unit="run", dynamic_ncols=True)
    try:
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            for ref in done:
                job, job_file, staging, log, t0 = refs.pop(ref)
                try:
                    code = ray.get(ref)
                except Exception as e:  # the task itself failed (its node or worker died past the retries)
                    with open(log, "a") as f:
                        f.write(f"\n# the Ray task failed: {type(e).__name__}: {e}\n")
                    code = -1
                shutil.rmtree(staging, ignore_errors=True)
                job_file.unlink(missing_ok=True)
                record_result(report, job, code, log, output_dir, time.time() - t0)
                bar.update(1)
                bar.set_postfix(done=len(report.done), failed=len(report.failed))
    finally:
        bar.close()
        for ref, (job, job_file, staging, _, _) in refs.items():  # interrupted: cancel, clean, run again next time
            ray.cancel(ref, force=True)
            shutil.rmtree(staging, ignore_errors=True)
            job_file.unlink(missing_ok=True)
            logger.warning("cancelled %s (not finished, will run again next time)", job.name)
    return report


__all__ = ["run_ray_sweep"]
