"""The background jobs of both suites (background.py) run where their niceness counts, and stop with the session."""

import os
import sys
import time

import background
import pytest


def _start(tmp_path_factory, name: str, code: str, **job) -> background.Jobs:
    background.job(name, lane=name)(
        lambda factory: background.Job([sys.executable, "-c", code], cwd=factory.getbasetemp(), **job)
    )
    jobs = background.Jobs()
    jobs.start([name], tmp_path_factory)
    return jobs


@pytest.mark.parametrize("nice", [None, 10])
def test_a_job_runs_niced_in_the_tests_session_and_its_own_process_group(tmp_path_factory, nice):
    """In another session (its own autogroup) the nice value would not count against the tests' processes; a job is
    niced by 19 unless it says otherwise."""
    jobs = _start(
        tmp_path_factory, "probe-priority", "import os; print(os.getsid(0), os.getpgid(0), os.getpid(), os.nice(0))",
        **({} if nice is None else {"nice": nice}),
    )  # fmt: skip
    try:
        job = jobs.finished("probe-priority")
    finally:
        jobs.stop()
        background._DECLARED.pop("probe-priority")
    assert job.returncode == 0, job.output()
    session, group, pid, niced = map(int, job.stdout.split())
    assert session == os.getsid(0) and group == pid and niced == min(19, os.nice(0) + (nice or 19))
    assert job.folder is not None and "probe-priority" in "\n".join(jobs.summary())


def test_stopping_the_session_kills_a_job_and_what_it_started(tmp_path_factory):
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(child.pid, flush=True); time.sleep(600)"
    )
    jobs = _start(tmp_path_factory, "probe-stop", code)
    try:
        job = jobs.jobs["probe-stop"]
        deadline = time.monotonic() + 60
        while not job.stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(job.stdout.split()[0])
        jobs.stop()
        assert job.done.wait(60) and job.returncode == -9
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the job's child outlived the session"
    finally:
        jobs.stop()
        background._DECLARED.pop("probe-stop")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
