"""Engine features with the plugin: chunked prefill, async scheduling in a separate engine process, preemption.

Each runs the same prompts as the session's engine (one chunk, in-process, synchronous scheduling) and must give the
same greedy tokens; chunked prefill must also keep the same entries (its window queries come from several chunks).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import NEW_TOKENS, PRESSES, engine_kwargs, internal_id, make_llm, run_to_end, scheduler_of

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def engine_process(tmp_path, **job) -> dict:
    """Run ``engine_process.py`` on ``job`` (an engine in its own processes) and return what it wrote."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", **job.pop("env", {}))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    command = [sys.executable, str(HERE / "engine_process.py"), str(path)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((tmp_path / "job.json.out").read_text())


def same_entries(a: dict, b: dict) -> float:
    """Fraction of kept entries two selections (``{layer: [[positions] per head]}``) share."""
    common = total = 0
    for name, heads in a.items():
        for x, y in zip(heads, b[name]):
            common += len(set(x) & set(y))
            total += len(x)
    return common / total


def run_batch(llm, prompts):
    from vllm import SamplingParams

    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, extra_args={"kvpress_critical": {"press": press}})
        for press in PRESSES
    ]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_chunked_prefill_equals_one_chunk(batch):
    """128-token chunks: prompts of 300 and 777 tokens end with chunks shorter than SnapKV's 64-query window."""
    prompts, outputs, selections = batch
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.5, "record_selections": True},
        max_num_batched_tokens=128,
        max_num_seqs=8,
    )
    chunked = run_batch(llm, prompts)
    chunked_selections = llm.collective_rpc("kvpress_critical_selections")[0]
    report = []
    for press, one, several in zip(PRESSES, outputs, chunked):
        a = selections[internal_id(selections, one.request_id)]
        b = chunked_selections[internal_id(chunked_selections, several.request_id)]
        report.append((press, same_entries(a, b), list(one.outputs[0].token_ids) == list(several.outputs[0].token_ids)))
    print("chunked vs one chunk (press, same entries, same tokens):", report)
    assert all(agreement >= 0.999 and same for _, agreement, same in report), report


def test_async_scheduling_in_an_engine_process(batch, tmp_path):
    """vLLM's GPU default: engine core in its own process, async scheduling; the synchronous engine's tokens."""
    prompts, outputs, _ = batch
    plugin = {"press": "critical_snapkv", "compression_ratio": 0.5}
    result = engine_process(tmp_path, engine=engine_kwargs(), plugin=plugin, prompts=prompts, presses=list(PRESSES),
                            async_scheduling=True)  # fmt: skip
    assert "CriticalKVAsyncScheduler" in result["scheduler"]
    assert result["compacted"] == [len(prompts)]
    assert result["tokens"] == [list(o.outputs[0].token_ids) for o in outputs]


def test_preempted_request_is_compressed_again_and_gives_the_same_tokens(engine, prompt_ids):
    """A pool of 36 blocks for three requests that grow to 15 blocks each: one is preempted and recomputed."""
    from vllm import SamplingParams

    prompts = [prompt_ids[100 * i : 100 * i + 320] for i in range(3)]
    params = SamplingParams(max_tokens=320, temperature=0, ignore_eos=True)
    expected = [
        list(o.outputs[0].token_ids) for o in engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]

    pool = 37 * 32 * 46080  # 36 blocks and the null block
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.5}, kv_cache_memory_bytes=pool, max_model_len=1024
    )
    scheduler = scheduler_of(llm)
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    tokens, _ = run_to_end(llm)
    records = scheduler.kvpress_records
    preempted = [r for r in records.values() if r.preemptions > 0]
    assert preempted, "the pool was meant to force a preemption"
    assert llm.collective_rpc("kvpress_critical_compacted") == [3 + len(preempted)]
    assert all(r.blocks_freed == 5 for r in records.values())
    assert [tokens[f"p{i}"] for i in range(3)] == expected


def test_tensor_parallel_ranks_select_their_own_heads(tiny_llama, prompt_ids, tmp_path):
    """TP=2 on two CPU processes: each rank selects its KV head with its shard of o_proj, as one rank selects it."""
    prompts = [prompt_ids[:600], prompt_ids[200:1000]]
    plugin = {"press": "critical_snapkv", "compression_ratio": 0.5, "record_selections": True}
    engine = engine_kwargs(model=tiny_llama, kv_cache_memory_bytes=64 * 2**20)
    one = engine_process(tmp_path / "tp1", engine=engine, plugin=plugin, prompts=prompts)
    two = engine_process(
        tmp_path / "tp2", engine={**engine, "tensor_parallel_size": 2}, plugin=plugin, prompts=prompts,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per rank (the CPU worker cannot bind two otherwise)
    )  # fmt: skip
    assert two["compacted"] == [2, 2]
    for prompt in range(len(prompts)):
        for layer, heads in one["selections"][0][prompt].items():
            assert [two["selections"][rank][prompt][layer][0] for rank in (0, 1)] == heads
    assert two["tokens"] == one["tokens"]
