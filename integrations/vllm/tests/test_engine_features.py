"""Engine features with the plugin: vLLM's chunked prefill, async scheduling in a separate engine process,
preemption, tensor parallelism.

Each runs requests of the mixed batch (or of its kinds) and must give what the shared engine gives them (one step per
prompt chunk the plugin asks for, in-process, synchronous scheduling): the same greedy tokens, and with chunked
prefill the same kept entries (a request's window queries then come from several steps). The engine processes (async
scheduling, TP=2) run as background jobs (tests/background.py) while the in-process tests run.
"""

import json
import os
import sys
from pathlib import Path

import background
import pytest
from conftest import ENGINES, engine_kwargs, run_batch, serve, shared_engine, tiny_llama, token_ids
from selections import same_entries
from workload import HYBRID_ROWS, ROWS, rows_of

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def engine_process_job(folder: Path, **job) -> background.Job:
    """``engine_process.py`` on ``job`` (an engine in its own processes, unless the job's ``env`` sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as a background job writing into ``folder``."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **job.pop("env", {})}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps(job))
    command = [sys.executable, str(HERE / "engine_process.py"), str(folder / "job.json")]
    return background.Job(command, cwd=folder, env=env, timeout=1800)  # niced: it may wait long for an idle core


def result_of(finished: background.Job) -> dict:
    assert finished.returncode == 0, (finished.error, finished.output()[-4000:])
    return json.loads((finished.cwd / "job.json.out").read_text())


def job_requests(rows) -> list[dict]:
    return [{"options": row.options, "max_tokens": row.max_tokens, "ignore_eos": row.ignore_eos} for row in rows]


def test_chunked_prefill_keeps_the_same_entries_and_tokens(mixed_batch, prompt_ids):
    """128-token steps (vLLM's chunked prefill, max_num_batched_tokens=128): the uniform and head-wise rows of prompts
    of 150 to 550 tokens, whose last steps are shorter than SnapKV's 64-query window."""
    rows = rows_of("uniform") + rows_of("head_wise")
    chunked = run_batch(shared_engine("chunked_prefill"), rows, prompt_ids)
    report = []
    for result in chunked:
        one = mixed_batch[result.row.name]
        report.append((result.row.name, same_entries(one.kept, result.kept), one.tokens == result.tokens))
    print("chunked prefill vs one step (row, same entries, same tokens):", report)
    assert all(agreement >= 0.999 and same for _, agreement, same in report), report


# a request of every kind of the mixed batch
ASYNC_ROWS = [next(row for row in ROWS if row.kind == kind) for kind in dict.fromkeys(row.kind for row in ROWS)]


# longer than the pool (the "bounded" engine: max_model_len 2048 in 16 blocks): a prompt 2.3 times the pool, compacted
# after every chunk, and two requests compressed while decoding, which the pool cannot all hold at once
BOUNDED_REQUESTS = [
    {"start": 0, "length": 1200, "max_tokens": 32},
    {"start": 300, "length": 250, "max_tokens": 150},
    {"start": 600, "length": 300, "max_tokens": 150},
] + [  # and four compressed while decoding only, which outgrow the pool together as they generate: vLLM preempts
    {"start": 61 * i, "length": 128, "max_tokens": 40, "options": {
        "window_size": 32, "compression_chunk_size": 0, "compression_ratio": 0.0, "compression_interval": 36,
        "target_size": 64,
    }} for i in range(4)
]  # fmt: skip


def bounded_prompts(ids: list[int]) -> list[list[int]]:
    return [ids[r["start"] : r["start"] + r["length"]] for r in BOUNDED_REQUESTS]


def engine_job(name: str, async_scheduling: bool, prompts, requests, ids) -> dict:
    config = dict(ENGINES[name])
    if callable(config.get("model")):  # a model folder the tests make
        config["model"] = config["model"]()
    engine = engine_kwargs(**{key: value for key, value in config.items() if key != "plugin"})
    return dict(engine=engine, plugin=config["plugin"], prompts=prompts, requests=requests,
                async_scheduling=async_scheduling)  # fmt: skip


# a lane of its own: behind the first run (niced, it waits long for a core) it ended 109 s after the in-process tests
@background.job("async-scheduling", lane="async")
def async_scheduling_job(tmp_path_factory) -> background.Job:
    """One engine process, four configurations in turn: the default engine's (a request of every kind of the mixed
    batch), the bounded engine's (longer than the pool), the hybrid engine's (its batch: every schedule on a model
    with sliding-window layers beside full-attention ones), then the prefix-cache engine's (a document's questions
    sent at once, sharing its compressed prefix: async scheduling directs a compaction before the one before it is
    confirmed)."""
    ids = token_ids()
    rows = [row.prompt(ids) for row in ASYNC_ROWS]
    bounded = [
        {"max_tokens": r["max_tokens"], "ignore_eos": True, "options": r.get("options", {})} for r in BOUNDED_REQUESTS
    ]
    job = engine_job("default", True, rows, job_requests(ASYNC_ROWS), ids)
    job["then"] = {**engine_job("bounded", True, bounded_prompts(ids), bounded, ids), "count_preemptions": True}
    hybrid = [row.prompt(ids) for row in HYBRID_ROWS]
    job["then"]["then"] = engine_job("hybrid", True, hybrid, job_requests(HYBRID_ROWS), ids)
    prompts, requests = shared_document_batch(ids)
    job["then"]["then"]["then"] = engine_job("prefix_cache", True, prompts, requests, ids)
    return engine_process_job(tmp_path_factory.mktemp("async-scheduling"), **job)


def shared_document_batch(ids: list[int]) -> tuple[list[list[int]], list[dict]]:
    """A 640-token document asked three questions compressed after every 128-token chunk and one uncompressed, all at
    once (the async engine's prefix-cache batch)."""
    document = ids[100:740]
    prompts = [document + ids[800 + 100 * i : 880 + 100 * i] for i in range(4)]
    chunked = {"max_tokens": 12, "ignore_eos": True, "options": {"compression_chunk_size": 128}}
    whole = {"max_tokens": 12, "ignore_eos": True, "options": {"compression_ratio": 0.0}}
    return prompts, [chunked, chunked, chunked, whole]


@pytest.mark.background("async-scheduling")
def test_async_scheduling_in_an_engine_process(mixed_batch, background_job):
    """vLLM's GPU default (engine core in its own process, async scheduling) on a request of every kind of the mixed
    batch: the same tokens and compactions as the synchronous engine, nothing tracked once it is done."""
    from selections import plan_of

    result = result_of(background_job)
    assert "CriticalKVAsyncScheduler" in result["scheduler"]
    compactions = sum(len(plan_of(r.options, r.length, r.length + r.max_tokens - 1)) for r in ASYNC_ROWS)
    assert result["compacted"] == [compactions] and result["tracked"] == [0]
    assert result["tokens"] == [mixed_batch[row.name].tokens for row in ASYNC_ROWS]


@pytest.mark.background("async-scheduling")
def test_async_scheduling_longer_than_the_pool(bounded_engine, prompt_ids, background_job):
    """Async scheduling allocates a step's blocks before the previous step's compaction frees its own: admission
    counts the extra chunk (as the bound does), and requests longer than the pool, held to their bounds, and requests
    compressed while decoding that vLLM preempts (recomputed with the same compactions) give the synchronous engine's
    tokens, compactions included, with nothing tracked after."""
    from vllm import SamplingParams

    result = result_of(background_job)["then"]
    assert "CriticalKVAsyncScheduler" in result["scheduler"] and result["tracked"] == [0]
    assert result["preemptions"] > 0, "the async engine was meant to preempt"
    params = [
        SamplingParams(
            max_tokens=r["max_tokens"], temperature=0, ignore_eos=True,
            extra_args={"kvpress_critical": r.get("options", {})},
        )
        for r in BOUNDED_REQUESTS
    ]  # fmt: skip
    before = bounded_engine.collective_rpc("kvpress_critical_compacted")[0]
    requests = {f"bounded-sync-{i}": (p, q) for i, (p, q) in enumerate(zip(bounded_prompts(prompt_ids), params))}
    served = serve(bounded_engine, requests)
    assert result["tokens"] == [served.tokens[name] for name in requests]
    assert result["compacted"] == [bounded_engine.collective_rpc("kvpress_critical_compacted")[0] - before]


@pytest.mark.background("async-scheduling")
def test_async_scheduling_on_a_hybrid_model(hybrid_batch, background_job):
    """The hybrid engine's batch (uniform and head-wise presses, after every chunk, while decoding, uncompressed; the
    full-attention group compressed beside two sliding-window groups) with async scheduling: the synchronous engine's
    tokens, nothing tracked after."""
    result = result_of(background_job)["then"]["then"]
    assert "CriticalKVAsyncScheduler" in result["scheduler"] and result["tracked"] == [0]
    assert result["tokens"] == [hybrid_batch[row.name].tokens for row in HYBRID_ROWS]


@pytest.mark.background("async-scheduling")
def test_async_scheduling_shares_a_compressed_prefix(engine, prompt_ids, background_job):
    """A document's questions sent at once to the prefix-cache engine with async scheduling: the second and third
    compressed questions wait for the first to keep the document's compressed state and start from it (640 tokens),
    although each of its compactions is directed before the one before it is confirmed; the uncompressed question
    shares the first's blocks as they are prefilled. Every answer is the one of the engine without prefix caching."""
    from vllm import SamplingParams

    result = result_of(background_job)["then"]["then"]["then"]
    assert "CriticalKVAsyncScheduler" in result["scheduler"] and result["tracked"] == [0]
    prompts, requests = shared_document_batch(prompt_ids)
    params = [
        SamplingParams(
            max_tokens=r["max_tokens"], temperature=0, ignore_eos=True, extra_args={"kvpress_critical": r["options"]}
        )
        for r in requests
    ]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert result["tokens"] == [list(o.outputs[0].token_ids) for o in outputs]
    assert result["cached"][:3] == [0, 640, 640] and result["cached"][3] > 0


TP_REQUESTS = [
    {"options": {}},
    {"options": {"compression_chunk_size": 256}},
    {"options": {"compression_interval": 48, "target_size": 128, "window_size": 32}, "max_tokens": 120,
     "ignore_eos": True},
]  # fmt: skip
# the TP=2 engine is the shared "tiny" engine's configuration on two ranks: that engine is the one-rank comparison
TP_PLUGIN = ENGINES["tiny"]["plugin"]
TP_POOL = ENGINES["tiny"]["kv_cache_memory_bytes"]


def tp_prompts(ids: list[int]) -> list[list[int]]:
    return [ids[:600], ids[200:1000], ids[100:700]]


# in the benchmark scripts' lane, after them: the two lanes then end together (measured in CI: the first run and
# the async-scheduling engine 727 s, the scripts 675 s, so the tensor-parallel job after either left one core idle)
@background.job("tensor-parallel", lane="bench")
def tensor_parallel_job(tmp_path_factory) -> background.Job:
    engine = engine_kwargs(model=tiny_llama(), kv_cache_memory_bytes=TP_POOL, tensor_parallel_size=2)
    return engine_process_job(
        tmp_path_factory.mktemp("tensor-parallel"), engine=engine, plugin=TP_PLUGIN, prompts=tp_prompts(token_ids()),
        requests=TP_REQUESTS, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per rank
    )  # fmt: skip


@pytest.mark.background("tensor-parallel")
def test_tensor_parallel_ranks_select_their_own_heads(tiny_engine, prompt_ids, background_job):
    """TP=2 on two CPU processes: each rank selects its KV head with its shard of o_proj, as one rank (the shared tiny
    engine) selects it, for a request compressed after its prompt, one after every prompt chunk and one while decoding
    (a tiny Llama: TP=2 needs an even number of KV heads, SmolLM2 has 3)."""
    from engine_process import serve_job

    job = dict(plugin=TP_PLUGIN, prompts=tp_prompts(prompt_ids), requests=TP_REQUESTS)
    before = tiny_engine.collective_rpc("kvpress_critical_compacted")[0]
    one = serve_job(tiny_engine, job)
    compacted = one["compacted"][0] - before  # the shared engine's count includes the requests of earlier tests
    two = result_of(background_job)
    assert compacted >= 3 + 1 and two["compacted"] == [compacted] * 2 and two["tracked"] == [0, 0]
    for prompt in range(len(TP_REQUESTS)):
        for layer, heads in one["selections"][0][prompt].items():
            assert [two["selections"][rank][prompt][layer][0] for rank in (0, 1)] == heads
    assert two["tokens"] == one["tokens"]
