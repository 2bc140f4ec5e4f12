import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from pathlib import Path  # noqa: E402

import background  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402  (does not import triton)
import yaml  # noqa: E402

# Triton reads TRITON_INTERPRET when it is imported (its standard library, tl.sum included, is decorated then), so
# without a GPU the interpreter is switched on here, before transformers/kvpress import triton: the Triton backend
# is then tested on CPU tensors through the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()
torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded default model, float32, sdpa."""
    from kvpress_critical.default_model import load_default_model

    return load_default_model()


@pytest.fixture(scope="session")
def smollm2_pipeline(smollm2):
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    from transformers import pipeline

    model, tokenizer = smollm2
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


_BACKGROUND: list[str] = []  # the background jobs of the selected tests (background.py)


def pytest_addoption(parser):
    parser.addoption(
        "--full-grid",
        action="store_true",
        help="run the full products of the test grids, not only their covering arrays (tests/covering.py)",
    )


@pytest.hookimpl(trylast=True)  # after -m and -k deselected: only the jobs of the tests that run
def pytest_collection_modifyitems(config, items):
    """Cases of a grid outside its covering array (marked ``full_grid``) run only with ``--full-grid``; the tests
    that read a background job run last (background.py)."""
    if not (config.getoption("--full-grid") or "full_grid" in (config.getoption("markexpr") or "")):
        dropped = [item for item in items if item.get_closest_marker("full_grid")]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item.get_closest_marker("full_grid") is None]
    background.move_to_end(items)
    _BACKGROUND[:] = background.selected(items)


@pytest.fixture(scope="session", autouse=True)
def background_jobs(tmp_path_factory):
    """The selected tests' background jobs, started with the session's first test; those still running when the
    session ends are stopped."""
    jobs = background.start_session(_BACKGROUND, tmp_path_factory)
    yield jobs
    jobs.stop()


def pytest_terminal_summary(terminalreporter):
    background.report(terminalreporter)


@pytest.fixture
def background_job(request, background_jobs) -> background.Job:
    """The background job of the test's ``background`` marker, once it has ended."""
    return background_jobs.finished(request.node.get_closest_marker(background.MARKER).args[0])


@background.job("smoke-sweep", order=0)
def smoke_sweep_job(tmp_path_factory) -> background.Job:
    """The evaluation tests' smoke preset (``helpers.SMOKE_PRESET``) run with the local launcher."""
    from helpers import SMOKE_PRESET, evaluate_command

    folder = tmp_path_factory.mktemp("smoke")
    preset = folder / "tiny.yaml"
    preset.write_text(yaml.safe_dump(SMOKE_PRESET))
    command, env, cwd = evaluate_command(
        "--preset", str(preset), "--output-dir", str(folder / "results"), "--workers", "2", "--threads", "1"
    )
    return background.Job(command, cwd=cwd, env=env, timeout=900)


@pytest.fixture(scope="session")
def smoke_sweep(background_jobs):
    """
    ``(preset file, results folder, completed process)``: the smoke sweep (a background job of the tests marked
    ``background("smoke-sweep")``); test_evaluation_smoke checks its results, test_cluster_launchers compares the Ray
    and SLURM launchers with them.
    """
    import types

    job = background_jobs.finished("smoke-sweep")
    preset = next(arg for arg in job.command if arg.endswith("tiny.yaml"))
    output = job.command[job.command.index("--output-dir") + 1]
    result = types.SimpleNamespace(returncode=job.returncode, stdout=job.stdout, stderr=job.stderr)
    return Path(preset), Path(output), result
