"""Slow subprocess tests, started in the background when the session starts, run at the lowest priority, so that they
use the cores the in-process tests leave idle instead of following them.

A test module declares a job with :func:`job` (a function of pytest's ``tmp_path_factory`` returning a :class:`Job`:
a command, its environment, a working folder) and marks the tests that read it ``@pytest.mark.background("name")``.
When the session's first test starts, the conftest starts the jobs of the selected tests: the jobs of a lane one
after another (the longest first: :func:`job`'s ``order``) in a thread of this process, lanes side by side (each job
a child process whose output goes to files; a job that mostly waits on the network and the disk, such as a fresh
venv's installs, has a lane of its own). A test marked with a job waits for it (``Jobs.finished``) and checks what it
wrote. The tests marked with a job are moved to the end of the session (:func:`move_to_end`): by then their jobs have
run beside everything else. Used by both suites (the main one's conftest and the vLLM plugin's)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "background"

_DECLARED: dict[str, Callable] = {}  # job name -> its factory
_ORDER: dict[str, int] = {}  # job name -> its place in the queue (then the order modules declared them)
_LANE: dict[str, str] = {}  # job name -> its lane (the jobs of one lane run one after another)
_SESSION: list = []  # the session's Jobs, for the terminal summary


@dataclass
class Job:
    """A command run in the background: ``command`` in ``cwd`` with ``env``; its standard output and error are kept
    in two files of ``folder`` (a temporary folder of its own by default)."""

    command: list[str]
    cwd: Path
    env: dict = field(default_factory=lambda: dict(os.environ))
    folder: Path | None = None
    timeout: float = 1800
    nice: int = 19  # the job's priority (19, the lowest: it takes the cores the tests leave idle; see _niced)
    returncode: int | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # user and system time of the job and of the children it waited for
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    process: subprocess.Popen | None = field(default=None, repr=False)

    def _read(self, name: str) -> str:
        path = self.folder / name if self.folder else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    @property
    def stdout(self) -> str:
        return self._read("stdout.log")

    @property
    def stderr(self) -> str:
        return self._read("stderr.log")

    def output(self) -> str:
        return self.stdout + self.stderr


def job(name: str, order: int = 100, lane: str = "main"):
    """Declare the background job ``name``: the decorated function makes it from ``tmp_path_factory``. The jobs of a
    lane run one at a time by ``order`` (the longest first: it sets when the session can end), then in the order they
    were declared; lanes run side by side."""

    def declare(factory: Callable) -> Callable:
        _DECLARED[name] = factory
        _ORDER[name] = order
        _LANE[name] = lane
        return factory

    return declare


def _queue() -> list[str]:
    return sorted(_DECLARED, key=lambda name: (_ORDER[name], list(_DECLARED).index(name)))


def _niced(increment: int) -> Callable[[], None]:
    """The job's process niced by ``increment`` (19 by default, the lowest priority: it takes the cores the tests
    leave idle and slows them little; the tests' engines spin on their cores, and two of them at one priority share
    two cores badly). A job that is one long chain of steps on one core (the plugin's first run) gets 10: the idle
    cycles go to it before the other jobs, which can still use both cores once the in-process tests end.

    The job stays in the test session's Linux session: with autogroup scheduling (``kernel.sched_autogroup_enabled``,
    the default of most distributions) every session is a scheduling group of its own, groups share the cores
    equally and a nice value only orders the processes of its group, so a niced job in a session of its own took a
    whole core from the 2-thread test process (whose OpenMP threads then waited for each other: its tests ran 5 to 10
    times slower)."""
    return lambda: os.nice(increment)


def _run(jobs: list[tuple[str, Job]]) -> None:
    for name, current in jobs:
        start = time.perf_counter()
        if current.timeout <= 0:  # the session ended first
            current.error = f"{name} was not run: the session ended before it started"
            current.done.set()
            continue
        try:
            with open(current.folder / "stdout.log", "w") as out, open(current.folder / "stderr.log", "w") as err:
                # a process group of its own (in the session: see _niced): the job and everything it starts are
                # stopped together
                # OpenMP threads of a niced job sleep while they wait for each other instead of spinning: starved of
                # a core, a spinning thread burns the share its process gets (the same threads, the same results)
                env = {"OMP_WAIT_POLICY": "PASSIVE", **current.env}
                process = current.process = subprocess.Popen(
                    current.command,
                    cwd=current.cwd,
                    env=env,
                    stdout=out,
                    stderr=err,
                    preexec_fn=_niced(current.nice),
                    process_group=0,
                )
                if not _wait(process, current):
                    _kill(process)
                    _wait(process, current)
                    current.error = f"{name} ran past its {current.timeout:.0f} s and was killed"
        except Exception as error:  # noqa: BLE001 - reported by the test that waits for it
            current.error = f"{name} could not run: {error!r}"
        current.seconds = time.perf_counter() - start
        current.done.set()


def _wait(process: subprocess.Popen, current: Job) -> bool:
    """Wait for the job's process until its time is up: whether it ended (its return code and the CPU time it and
    the children it waited for used are then kept)."""
    deadline = time.monotonic() + current.timeout
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            current.returncode = process.returncode = os.waitstatus_to_exitcode(status)
            current.cpu_seconds = usage.ru_utime + usage.ru_stime
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _kill(process: subprocess.Popen) -> None:
    """The job's process and everything it started (its process group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Jobs:
    """The session's background jobs: started in a thread, waited for by name."""

    def __init__(self):
        self.jobs: dict[str, Job] = {}
        self.threads: list[threading.Thread] = []

    def start(self, names: list[str], tmp_path_factory) -> None:
        for name in names:
            made = _DECLARED[name](tmp_path_factory)
            made.folder = made.folder or tmp_path_factory.mktemp(f"background-{name}")
            self.jobs[name] = made
        lanes: dict[str, list[tuple[str, Job]]] = {}
        for name, made in self.jobs.items():
            lanes.setdefault(_LANE[name], []).append((name, made))
        self.threads = [threading.Thread(target=_run, args=(queue,), daemon=True) for queue in lanes.values()]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """At the session's end: the jobs still running (their tests failed, or were not reached) are killed, their
        children with them, and the jobs not started yet never start."""
        for current in self.jobs.values():
            current.timeout = 0  # a job not started yet ends at once
            if current.process is not None and current.process.poll() is None:
                _kill(current.process)

    def summary(self) -> list[str]:
        """One line per job: its time and how it ended (for the session's terminal summary)."""
        lines = []
        for name, current in self.jobs.items():
            if not current.done.is_set():
                state = "stopped with the session"
            elif current.error:
                state = current.error
            else:
                state = f"exit {current.returncode}"
            lines.append(f"{name}: {current.seconds:.1f} s, {current.cpu_seconds:.1f} CPU-s ({state})")
        return lines

    def finished(self, name: str) -> Job:
        """The job ``name`` once it has ended (its return code, output and time)."""
        current = self.jobs[name]
        current.done.wait()
        return current


def start_session(names: list[str], tmp_path_factory) -> Jobs:
    """The test session's jobs ``names``, started (and listed with their times in its terminal summary)."""
    jobs = Jobs()
    _SESSION[:] = [jobs]
    jobs.start(names, tmp_path_factory)
    return jobs


def selected(items) -> list[str]:
    """The jobs the selected tests read, in the order their modules declared them."""
    wanted = {marker.args[0] for item in items for marker in item.iter_markers(MARKER)}
    unknown = wanted - _DECLARED.keys()
    if unknown:
        raise ValueError(f"tests marked with undeclared background jobs: {sorted(unknown)}")
    return [name for name in _queue() if name in wanted]


def move_to_end(items) -> None:
    """The tests that read a background job run last, in the order of their jobs."""
    order = {name: i for i, name in enumerate(_queue())}

    def key(item):
        markers = list(item.iter_markers(MARKER))
        return order[markers[0].args[0]] if markers else -1

    marked = sorted((item for item in items if key(item) >= 0), key=key)
    items[:] = [item for item in items if key(item) < 0] + marked


def report(terminalreporter) -> None:
    """The session's background jobs, their times and how they ended, in pytest's terminal summary."""
    if _SESSION and _SESSION[0].jobs:
        terminalreporter.section("background jobs")
        for line in _SESSION[0].summary():
            terminalreporter.write_line(line)
        own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        terminalreporter.write_line(
            f"CPU time of the session: {own.ru_utime + own.ru_stime:.0f} s in pytest's process, "
            f"{children.ru_utime + children.ru_stime:.0f} s in its subprocesses (the jobs included)"
        )
