"""benchmarks/gpu_check.sh, walked on CPU (DRY_RUN=1): every step runs, the wheel set prepared for an offline GPU node
installs with --no-index into a clean target for the node's Python (3.12), and the results are the script's six files.

The wheel set is the one `make install` prepares in .whl/ (benchmarks/gpu_wheels.sh): nothing is downloaded while the
tests run (without it the tests fail and say so). The dry run is a background job (tests/background.py)."""

import json
import os
import sys
from pathlib import Path

import background
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheels():
    prepared = ROOT / ".whl"
    if not list(prepared.glob("*.whl")):
        pytest.fail("no wheel set in .whl/: `make install` prepares it (benchmarks/gpu_wheels.sh)")
    return prepared


def test_wheel_set(wheels):
    names = sorted(p.name.split("-")[0].lower() for p in wheels.glob("*.whl"))
    assert {"kvpress", "transformers", "tokenizers", "fire", "datasets"} <= set(names)
    assert len(names) == len(set(names)), "two versions of one package stop the whole install"
    assert sum(p.stat().st_size for p in wheels.glob("*.whl")) < 40 * 2**20


@background.job("gpu-check-dry-run", order=1)
def dry_run_job(tmp_path_factory) -> background.Job:
    results = tmp_path_factory.mktemp("gpu-check") / "out"
    env = dict(os.environ, DRY_RUN="1", PY=sys.executable, WHEELS=str(ROOT / ".whl"), BUDGET_S="600")
    env.pop("TRITON_INTERPRET", None)  # the script sets it for its own steps
    return background.Job(["bash", "benchmarks/gpu_check.sh", str(results)], cwd=ROOT, env=env, timeout=600)


@pytest.mark.background("gpu-check-dry-run")
def test_dry_run_walks_every_step(wheels, background_job):
    results = Path(background_job.command[-1])
    log = background_job.output()
    assert background_job.returncode == 0, (background_job.error, log[-3000:])
    steps = [line.split("\t") for line in (results / "steps.tsv").read_text().splitlines()]
    names = [s[0] for s in steps]
    assert names[:5] == ["preflight", "wheels", "build", "smoke", "bench_llama_16bit"]
    assert "tests" in names and "spills" in names
    assert all(rc == "0" for _, rc, _ in steps), steps
    files = sorted(p.name for p in results.iterdir())
    assert set(files) == {"gpu_check.log", "steps.tsv", "smoke.jsonl", "tables.md", "raw.tar", "tests.xml"}, files
    smoke = [json.loads(line) for line in (results / "smoke.jsonl").read_text().splitlines()]
    checked = [r for r in smoke if r.get("op") == "projected_value_norm"]
    assert checked and all(r["ok"] for r in checked)
    assert "installed distributions: 9" in log
    assert "L1: fused backends" in (results / "tables.md").read_text()
