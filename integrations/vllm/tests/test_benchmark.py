"""The plugin's benchmarks run end to end (tiny sizes) and write their tables (background jobs: tests/background.py).

Their ``--quick`` runs check the scripts' logic, not their numbers: they serve the session's tiny Llama (two layers of
random weights, SmolLM2's tokenizer and chat template), not SmolLM2 (measured alone on the 2-core EPYC: the serving
script 22 CPU-s instead of 121, the quality script 18 instead of 85). What the presses keep on the trained model is
checked entry for entry by the exactness tests; ``make bench-vllm`` and ``make bench-vllm-quality`` measure it."""

import os
import sys

import background
import pytest
from conftest import REPO, fp8_on_this_cpu, tiny_llama

pytestmark = pytest.mark.slow


def script_job(tmp_path_factory, name: str, *args: str) -> background.Job:
    folder = tmp_path_factory.mktemp(name)
    # every core: niced, the job takes what the in-process tests leave; once they end, both cores (as
    # `make bench-vllm` runs it)
    model = tiny_llama()
    env = dict(os.environ, KVPRESS_CRITICAL_VLLM_MODEL=model, OMP_NUM_THREADS=str(os.cpu_count()))
    command = [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args, "--out-dir", str(folder)]
    return background.Job(command, cwd=folder, env=env, timeout=1800)  # niced: it may wait long for an idle core


@background.job("bench-vllm", lane="bench")  # a second lane: the jobs left when the in-process tests end use both cores
def bench_vllm_job(tmp_path_factory) -> background.Job:
    return script_job(tmp_path_factory, "bench_vllm", "--quick", "--ratios", "0,0.75", "--chunk-sizes", "0,128",
                      "--compression-interval", "40", "--target-size", "48", "--window-size", "32",
                      "--lone-prompt", "150", "--workload", "chats", "--prefix-caching")  # fmt: skip


# where vLLM can, the quality job serves every row again over an fp8_e5m2 KV cache: the engine run of that format
# (every press and schedule, uniform and head-wise; test_fp8.py's engine checks e4m3 entry for entry)
FP8 = fp8_on_this_cpu() is None


@background.job("bench-vllm-quality", lane="bench")
def bench_vllm_quality_job(tmp_path_factory) -> background.Job:
    return script_job(
        tmp_path_factory, "bench_vllm_quality", "--quick", "--presses", "critical_snapkv,critical_adakv_snapkv",
        "--chunk-size", "128", "--compression-interval", "40", "--target-size", "48", "--window-size", "32",
        "--ignore-eos", "--max-new", "48", *(("--kv-cache-dtype", "fp8_e5m2") if FP8 else ()),
    )  # fmt: skip


@pytest.mark.background("bench-vllm")
def test_bench_vllm_quick_writes_its_table(background_job):
    assert background_job.returncode == 0, (background_job.error, background_job.output()[-4000:])
    table = (background_job.cwd / "vllm_chats_prefix_cache_cpu.md").read_text()
    assert "| vLLM |" in table and "| critical_snapkv 0.75 |" in table and "| critical_adakv_snapkv 0.75 |" in table
    assert "| critical_snapkv 0.75 chunk 128 |" in table and "| critical_adakv_snapkv 0.75 chunk" not in table
    assert "| critical_snapkv 0.75 chunk 128 decode 40/48 |" in table
    assert "| critical_snapkv 0.0 decode 40/48 |" in table and "| critical_snapkv 0.0 |" not in table
    assert "| critical_adakv_snapkv 0.75 decode" not in table and "| critical_adakv_snapkv 0.0" not in table
    # stock vLLM, 2 decoding-only rows at ratio 0, 4 uniform rows and the head-wise row at 0.75: a header and 8 rows
    assert (background_job.cwd / "vllm_chats_prefix_cache_cpu.csv").read_text().count("\n") == 9
    # two chats of two turns, the second resending the first: stock vLLM's prefix cache serves the history
    assert "2 chats of 2 turns" in table and "prefix caching on" in table
    header = next(line for line in table.splitlines() if line.startswith("| engine / press ratio |")).split("|")
    stock = next(line for line in table.splitlines() if line.startswith("| vLLM |")).split("|")
    assert int(stock[[cell.strip() for cell in header].index("prompt tokens reused")]) > 0


@pytest.mark.background("bench-vllm-quality")
def test_bench_vllm_quality_quick_writes_its_table(background_job):
    assert background_job.returncode == 0, (background_job.error, background_job.output()[-4000:])
    stem = "vllm_quality_schedules_fp8_e5m2_cpu" if FP8 else "vllm_quality_schedules_cpu"
    table = (background_job.cwd / f"{stem}.md").read_text()
    assert "| uncompressed | 0.00 | 1.000 |" in table  # the reference agrees with itself
    assert "(vs critical_snapkv) |" in table  # the head-wise press against its uniform one
    assert "| critical_adakv_snapkv chunk" not in table and "| critical_adakv_snapkv decode" not in table
    assert "| critical_snapkv decode 40/48 | 0.00 |" in table  # only the generation compressed
    for schedule in ("chunk 128", "decode 40/48", "chunk 128 decode 40/48"):
        assert f"| critical_snapkv {schedule} | 0.50 |" in table
    assert table.count("(vs critical_snapkv after the prompt)") == 3 and table.count("(vs uncompressed)") == 1
    # uncompressed, the decoding-only row, 2 presses at 0.5 and the uniform one's 3 schedules: a header and 7 rows,
    # and the same 7 over the fp8_e5m2 cache, each against its float twin
    assert (background_job.cwd / f"{stem}.csv").read_text().count("\n") == (15 if FP8 else 8)
    if FP8:
        assert "| uncompressed fp8_e5m2 | 0.00 |" in table and table.count("on the float cache)") == 7
        assert "| critical_snapkv chunk 128 decode 40/48 fp8_e5m2 | 0.50 |" in table
