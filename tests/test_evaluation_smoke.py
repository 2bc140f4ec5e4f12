"""
The smoke sweep end to end: `bash evaluation/evaluate.sh` with a tiny preset, the real SmolLM2, kvpress's
own runner from its downloaded sdist, and our presses. Checks the results folders (kvpress's layout and
names), the parsed metrics, the aggregate tables, resume on a second run, and failure isolation.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
PRESET = {
    "models": ["embedded"],
    "datasets": [
        {
            "dataset": "ruler_offline",
            "data_dir": "384",
            "generate": {
                "context_length": 384,
                "n_samples": 1,
                "tasks": ["niah_single_2", "niah_multikey_1"],
                "seed": 0,
                "max_new_tokens": {"niah": 16},
            },
        },
    ],
    # kvpress's runner rejects duo_attention without head_compression_ratio: a configuration that fails
    "presses": ["no_press", "duo_attention", "critical_snapkv", "critical_adakv_snapkv"],
    "compression_ratios": [0.5],
    "device": "cpu",
    "model_kwargs": {"attn_implementation": "sdpa", "dtype": "float32"},
}
GOOD = [
    f"ruler_offline__384__{MODEL}__no_press__0.00",
    f"ruler_offline__384__{MODEL}__critical_snapkv__0.50",
    f"ruler_offline__384__{MODEL}__critical_adakv_snapkv__0.50",
]
FAILING = f"ruler_offline__384__{MODEL}__duo_attention__0.50"


def sweep(preset: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHON=sys.executable)
    command = ["bash", str(REPO / "evaluation" / "evaluate.sh"), "--preset", str(preset), "--output-dir", str(output)]
    command += ["--workers", "2", "--threads", "1", *extra]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smoke")
    preset = folder / "tiny.yaml"
    preset.write_text(yaml.safe_dump(PRESET))
    output = folder / "results"
    result = sweep(preset, output)
    return preset, output, result


@pytest.mark.slow
def test_dry_run_lists_jobs_in_kvpress_naming(first_run, tmp_path):
    preset, _, _ = first_run
    result = sweep(preset, tmp_path / "dry", "--dry-run")
    assert result.returncode == 0, result.stderr
    for name in GOOD + [FAILING]:
        assert name in result.stdout
    assert not any((tmp_path / "dry").glob("ruler_offline__*"))


@pytest.mark.slow
def test_sweep_produces_kvpress_results_and_isolates_failures(first_run):
    _, output, result = first_run
    log = result.stdout + result.stderr
    assert result.returncode == 1, log  # a configuration failed...
    for name in GOOD:  # ...and the others ran anyway, in kvpress's layout
        folder = output / name
        assert {p.name for p in folder.iterdir()} == {"predictions.csv", "metrics.json", "config.yaml"}, log
        metrics = json.loads((folder / "metrics.json").read_text())
        assert set(metrics) == {"niah_single_2", "niah_multikey_1"}
        assert all(0 <= m["string_match"] <= 100 for m in metrics.values())
        predictions = pd.read_csv(folder / "predictions.csv")
        assert len(predictions) == 2 and predictions["predicted_answer"].notna().all()
    assert [p.name for p in (output / "failed").iterdir()] == [f"{FAILING}.txt"]
    failure = (output / "failed" / f"{FAILING}.txt").read_text()
    assert "Traceback" in failure and "head_compression_ratio" in failure
    assert f"FAILED {FAILING}" in result.stderr
    assert not (output / FAILING).exists()
    assert not any((output / ".staging").iterdir())


@pytest.mark.slow
def test_press_reprs_are_complete_in_config(first_run):
    _, output, _ = first_run
    config = yaml.safe_load((output / GOOD[1] / "config.yaml").read_text())
    assert config["press_name"] == "critical_snapkv" and config["compression_ratio"] == 0.5
    assert config["model"] == MODEL and config["dataset"] == "ruler_offline" and config["data_dir"] == "384"
    assert config["output_dir"] == str(output)  # the published folder, not the staging one
    command = config["press_init_command"]
    assert command.startswith("CriticalKVPress(") and "press=SnapKVPress(compression_ratio=0.5, window_size=" in command
    for field in ("epsilon=", "first_stage_ratio=", "norm='l1'", "backend="):
        assert field in command
    ada = yaml.safe_load((output / GOOD[2] / "config.yaml").read_text())["press_init_command"]
    assert ada.startswith("CriticalAdaKVPress(") and "press=SnapKVPress(compression_ratio=0.5" in ada
    assert "alpha_safeguard=" in ada


@pytest.mark.slow
def test_aggregate_tables_from_the_sweep(first_run):
    _, output, _ = first_run
    summary = pd.read_csv(output / "summary" / "summary.csv")
    assert set(summary["press"]) == {"no_press", "critical_snapkv", "critical_adakv_snapkv"}
    full = summary.loc[summary.press == "no_press", "average"].item()
    metrics = json.loads((output / GOOD[0] / "metrics.json").read_text())
    assert full == pytest.approx(sum(m["string_match"] for m in metrics.values()) / 2)
    missing = pd.read_csv(output / "summary" / "missing.csv")
    assert missing["name"].tolist() == [FAILING] and "failed" in missing["reason"].item()
    tables = (output / "summary" / "tables.md").read_text()
    scores_part, missing_part = tables.split("## Missing")
    assert "ruler_offline/384" in scores_part and "critical_snapkv" in scores_part
    assert "duo_attention" not in scores_part and FAILING in missing_part
    assert any((output / "summary" / "plots").glob("*.png"))


@pytest.mark.slow
def test_second_run_resumes(first_run):
    preset, output, _ = first_run
    stamps = {name: (output / name / "metrics.json").stat().st_mtime_ns for name in GOOD}
    result = sweep(preset, output)
    assert result.returncode == 1  # the failing configuration is retried (and fails again)
    assert "3 finished configuration(s) skipped" in result.stderr
    assert f"FAILED {FAILING}" in result.stderr
    assert stamps == {name: (output / name / "metrics.json").stat().st_mtime_ns for name in GOOD}
