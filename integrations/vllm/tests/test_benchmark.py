"""The plugin's benchmarks run end to end (tiny sizes) and write their tables."""

import os
import subprocess
import sys

import pytest
from conftest import REPO, model_path

pytestmark = pytest.mark.slow


def test_bench_vllm_quick_writes_its_table(tmp_path):
    env = dict(os.environ, KVPRESS_CRITICAL_VLLM_MODEL=model_path())
    script = REPO / "benchmarks" / "bench_vllm.py"
    command = [sys.executable, str(script), "--quick", "--ratios", "0,0.75", "--chunk-sizes", "0,128",
               "--compression-interval", "72", "--target-size", "64", "--lone-prompt", "300", "--out-dir",
               str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    table = (tmp_path / "vllm_cpu.md").read_text()
    assert "| vLLM |" in table and "| critical_snapkv 0.75 |" in table and "| critical_adakv_snapkv 0.75 |" in table
    assert "| critical_snapkv 0.75 chunk 128 |" in table and "| critical_adakv_snapkv 0.75 chunk" not in table
    assert "| critical_snapkv 0.75 chunk 128 decode 72/64 |" in table
    assert "| critical_snapkv 0.0 decode 72/64 |" in table and "| critical_snapkv 0.0 |" not in table
    assert "| critical_adakv_snapkv 0.75 decode" not in table and "| critical_adakv_snapkv 0.0" not in table
    # stock vLLM, 2 decoding-only rows at ratio 0, 4 uniform rows and the head-wise row at 0.75: a header and 8 rows
    assert (tmp_path / "vllm_cpu.csv").read_text().count("\n") == 9


def test_bench_vllm_quality_quick_writes_its_table(tmp_path):
    env = dict(os.environ, KVPRESS_CRITICAL_VLLM_MODEL=model_path())
    script = REPO / "benchmarks" / "bench_vllm_quality.py"
    command = [sys.executable, str(script), "--quick", "--presses", "critical_snapkv,critical_adakv_snapkv,snapkv",
               "--chunk-size", "128", "--compression-interval", "72", "--target-size", "96", "--ignore-eos",
               "--max-new", "80", "--out-dir", str(tmp_path)]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    table = (tmp_path / "vllm_quality_schedules_cpu.md").read_text()
    assert "| uncompressed | 0.00 | 1.000 |" in table  # the reference agrees with itself
    assert "(vs critical_snapkv) |" in table  # the head-wise press against its uniform one
    assert "| critical_adakv_snapkv chunk" not in table and "| critical_adakv_snapkv decode" not in table
    for press in ("critical_snapkv", "snapkv"):
        assert f"| {press} decode 72/96 | 0.00 |" in table  # only the generation compressed
        for schedule in ("chunk 128", "decode 72/96", "chunk 128 decode 72/96"):
            assert f"| {press} {schedule} | 0.50 |" in table
    assert table.count("(vs critical_snapkv after the prompt)") == 3 and table.count("(vs uncompressed)") == 2
    # uncompressed, 2 decoding-only rows, 3 presses at 0.5 and 2 x 3 schedules: a header and 12 rows
    assert (tmp_path / "vllm_quality_schedules_cpu.csv").read_text().count("\n") == 13
