"""The sweep on a cluster: a real local Ray cluster (CPU workers), and SLURM job arrays run index by index by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from helpers import REPO, SMOKE_FAILING, SMOKE_GOOD, evaluate

# the shared smoke sweep (conftest's smoke_sweep) is the local launcher's reference; the launchers run three of its
# configurations: the full cache, CriticalKV and the one made to fail
GOOD, FAILING = SMOKE_GOOD[:2], SMOKE_FAILING
PRESSES = "no_press,critical_snapkv,duo_attention"

# Ray runs its tasks niced: not beside another test worker; the local launcher's reference is the smoke sweep
pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.background("smoke-sweep")]


def predictions(folder: Path) -> pd.DataFrame:
    frame = pd.read_csv(folder / "predictions.csv")
    return frame[sorted(frame.columns)].sort_values(list(sorted(frame.columns))).reset_index(drop=True)


def test_ray_launcher(smoke_sweep, tmp_path):
    pytest.importorskip("ray", reason="ray is in the cluster extra: pip install -e '.[cluster]'")
    preset, local_results, _ = smoke_sweep
    out = tmp_path / "results"
    presses = "critical_snapkv,duo_attention"  # one that runs, one that fails (fewer configurations: Ray is slow)
    first = evaluate(
        "--preset", str(preset), "--output-dir", str(out), "--presses", presses, "--launcher", "ray", "--threads", "1"
    )
    log = first.stdout + first.stderr
    assert first.returncode == 1, log[-3000:]  # one configuration failed; the sweep went on
    for name in GOOD[1:]:  # the other published, identical to the local launcher's result
        assert (out / name / "metrics.json").is_file(), log[-3000:]
        pd.testing.assert_frame_equal(predictions(out / name), predictions(local_results / name))
        assert json.loads((out / name / "metrics.json").read_text()) == json.loads(
            (local_results / name / "metrics.json").read_text()
        )
    assert not (out / FAILING).exists() and (out / "failed" / f"{FAILING}.txt").is_file()
    assert "duo_attention_on_the_fly" in (out / "failed" / f"{FAILING}.txt").read_text()
    assert (out / "summary" / "summary.csv").is_file()
    assert not list((out / ".staging").iterdir()) and not list((out / ".jobs").iterdir())
    # a second run resumes: the finished configurations are not run again, and with nothing pending (the failing
    # press left out) no Ray cluster is started
    stamps = {name: (out / name / "predictions.csv").stat().st_mtime_ns for name in GOOD[1:]}
    second = evaluate(
        "--preset",
        str(preset),
        "--output-dir",
        str(out),
        "--launcher",
        "ray",
        "--threads",
        "1",
        "--presses",
        "critical_snapkv",
    )
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "1 finished configuration(s) skipped" in second.stdout + second.stderr
    assert "nothing pending: Ray is not started" in second.stdout + second.stderr
    assert {name: (out / name / "predictions.csv").stat().st_mtime_ns for name in GOOD[1:]} == stamps


def test_slurm_array_for_the_paper_preset(tmp_path):
    out = tmp_path / "paper"
    result = evaluate(
        "--preset",
        "paper",
        "--output-dir",
        str(out),
        "--launcher",
        "slurm",
        "--no-submit",
        "--partition",
        "gpu",
        "--time",
        "08:00:00",
        "--account",
        "lab",
        "--max-parallel",
        "16",
        "--datasets",
        "ruler:4096",
        "--models",
        "meta-llama/Llama-3.1-8B-Instruct",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    scripts = list((out / "slurm").glob("sweep-*.sh"))
    manifests = list((out / "slurm").glob("sweep-*.json"))
    assert len(scripts) == 1 and len(manifests) == 1
    script = scripts[0].read_text()
    manifest = json.loads(manifests[0].read_text())
    n = len(manifest["configurations"])
    assert n == 1 + 6 * 4  # no_press + 6 presses x 4 ratios on one model and dataset
    for line in (
        "#SBATCH --array=0-24%16",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=08:00:00",
        "#SBATCH --account=lab",
        "#SBATCH --gres=gpu:1",
        "-m evaluation.slurm run",
    ):
        assert line in script, line
    assert [c["index"] for c in manifest["configurations"]] == list(range(n))
    names = [c["name"] for c in manifest["configurations"]]
    assert "ruler__4096__meta-llama--Llama-3.1-8B-Instruct__critical_adakv_snapkv__0.60" in names
    first = manifest["configurations"][0]
    assert first["payload"]["config"]["device"] == "cuda:0" and first["gpus"] == 1
    assert "sbatch" in result.stdout


def test_slurm_task_by_hand_and_status(smoke_sweep, tmp_path):
    preset, local_results, _ = smoke_sweep
    out = tmp_path / "results"
    args = ("--preset", str(preset), "--output-dir", str(out), "--presses", PRESSES, "--launcher", "slurm")
    written = evaluate(*args, "--no-submit")
    assert written.returncode == 0, written.stderr[-3000:]
    manifest = next((out / "slurm").glob("sweep-*.json"))
    entries = json.loads(manifest.read_text())["configurations"]
    assert entries[0]["payload"].get("threads") and entries[0]["payload"]["config"]["device"] == "cpu"  # CPU preset
    index = {e["name"]: e["index"] for e in entries}
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        SLURM_ARRAY_TASK_ID=str(index[GOOD[1]]),
        SLURM_ARRAY_JOB_ID="4242",
        PYTHONPATH=str(REPO),
    )
    task = subprocess.run(
        [sys.executable, "-m", "evaluation.slurm", "run", str(manifest)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert task.returncode == 0, task.stderr[-3000:]
    published = [p.name for p in out.iterdir() if (p / "config.yaml").is_file()]
    assert published == [GOOD[1]]  # that configuration only, the same as the local launcher's
    pd.testing.assert_frame_equal(predictions(out / GOOD[1]), predictions(local_results / GOOD[1]))
    env["SLURM_ARRAY_TASK_ID"] = str(index[FAILING])
    failing = subprocess.run(
        [sys.executable, "-m", "evaluation.slurm", "run", str(manifest)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert failing.returncode == 1 and (out / "failed" / f"{FAILING}.txt").is_file()
    status = evaluate(*args, "--status")
    text = status.stdout
    assert "1 finished, 1 failed, 1 missing" in text, text
    assert f"failed:  {FAILING}" in text and f"missing: {GOOD[0]}" in text
    # a resubmission writes an array of what is missing or failed only
    again = evaluate(*args, "--no-submit")
    newest = max((out / "slurm").glob("sweep-*.json"), key=lambda p: p.stat().st_mtime_ns)
    assert again.returncode == 0
    assert sorted(e["name"] for e in json.loads(newest.read_text())["configurations"]) == sorted([GOOD[0], FAILING])
