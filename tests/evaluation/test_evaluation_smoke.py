"""
The smoke sweep end to end: `bash evaluation/evaluate.sh` with a tiny preset, the real SmolLM2, kvpress's
own runner from its sdist, and our presses (the sweep runs once per session: conftest's smoke_sweep). Checks
the results folders (kvpress's layout and names), the parsed metrics, the aggregate tables, resume on a second run,
and failure isolation.
"""

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers import SMOKE_FAILING, SMOKE_GOOD, SMOKE_MODEL, evaluate

GOOD, FAILING = SMOKE_GOOD, SMOKE_FAILING
pytestmark = [pytest.mark.slow, pytest.mark.background("smoke-sweep")]


def sweep(preset: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    return evaluate("--preset", str(preset), "--output-dir", str(output), "--workers", "2", "--threads", "1", *extra)


def test_dry_run_lists_jobs_in_kvpress_naming(smoke_sweep, tmp_path):
    preset, _, _ = smoke_sweep
    result = sweep(preset, tmp_path / "dry", "--dry-run")
    assert result.returncode == 0, result.stderr
    for name in GOOD + [FAILING]:
        assert name in result.stdout
    assert not any((tmp_path / "dry").glob("ruler_offline__*"))


def test_sweep_produces_kvpress_results_and_isolates_failures(smoke_sweep):
    _, output, result = smoke_sweep
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
    assert "duo_attention_on_the_fly" in failure  # DuoAttention has no published pattern for the embedded model
    assert f"FAILED {FAILING}" in result.stderr
    assert not (output / FAILING).exists()
    assert not any((output / ".staging").iterdir())


def test_press_reprs_are_complete_in_config(smoke_sweep):
    _, output, _ = smoke_sweep
    config = yaml.safe_load((output / GOOD[1] / "config.yaml").read_text())
    assert config["press_name"] == "critical_snapkv" and config["compression_ratio"] == 0.5
    assert config["model"] == SMOKE_MODEL and config["dataset"] == "ruler_offline" and config["data_dir"] == "384"
    assert config["output_dir"] == str(output)  # the published folder, not the staging one
    command = config["press_init_command"]
    assert command.startswith("CriticalKVPress(") and "press=SnapKVPress(compression_ratio=0.5, window_size=" in command
    for field in ("epsilon=", "first_stage_ratio=", "norm='l1'", "backend="):
        assert field in command
    ada = yaml.safe_load((output / GOOD[2] / "config.yaml").read_text())["press_init_command"]
    assert ada.startswith("CriticalAdaKVPress(") and "press=SnapKVPress(compression_ratio=0.5" in ada
    assert "alpha_safeguard=" in ada


def test_aggregate_tables_from_the_sweep(smoke_sweep):
    _, output, _ = smoke_sweep
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


def test_second_run_resumes(smoke_sweep):
    preset, output, _ = smoke_sweep
    stamps = {name: (output / name / "metrics.json").stat().st_mtime_ns for name in GOOD}
    result = sweep(preset, output)
    assert result.returncode == 1  # the failing configuration is retried (and fails again)
    assert "3 finished configuration(s) skipped" in result.stderr
    assert f"FAILED {FAILING}" in result.stderr
    assert stamps == {name: (output / name / "metrics.json").stat().st_mtime_ns for name in GOOD}
