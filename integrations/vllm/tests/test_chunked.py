"""Compression after every prompt chunk (``chunk_size``): the engine runs ``ChunkedPrefillPress``'s schedule.

Requests of the session's engine with ``chunk_size`` 256 (per request): their prompts are prefilled in chunks of 256
tokens and compacted after each one. Checked:

- exactness: the engine's greedy tokens equal transformers' prefilling the same chunks at their positions, each over
  the cache the engine kept after the chunk before (``reference.greedy_with_compactions``, fed with the kept
  positions the engine reports after each compaction);
- selection: the kept entries equal ``ChunkedPrefillPress(press, chunk_size)`` (this project's transformers press,
  run in kvpress's environment) keeping the plugin's block-aligned counts;
- memory: at every step of a traced run a request holds no more blocks than the schedule's bound (what the
  compactions before left, and the chunk), and a pool runs at once requests whose prompts it could not hold whole;
- preemption and async scheduling: the same tokens as the synchronous, unpreempted engine.
"""

import pytest
from conftest import BLOCK_SIZE, NEW_TOKENS, engine_kwargs, internal_id, make_llm, model_path, run_to_end, scheduler_of
from reference import greedy_with_compactions, load_reference_model
from test_engine_features import engine_process
from test_selection import compare_selections, press_selections

pytestmark = pytest.mark.slow

CHUNK = 256
CHUNKED = ("critical_snapkv", "snapkv", "critical_knorm", "streaming_llm")
LENGTHS = (1100, 900, 1300, 777)


def chunked_params(press: str, max_tokens: int = NEW_TOKENS, **extra):
    from vllm import SamplingParams

    options = {"press": press, "chunk_size": CHUNK}
    return SamplingParams(max_tokens=max_tokens, temperature=0, extra_args={"kvpress_critical": options}, **extra)


def plan_of(press: str, n_prompt: int):
    from kvpress_critical_vllm.budget import schedule
    from kvpress_critical_vllm.options import CompressionOptions

    stages, _ = schedule(CompressionOptions(press=press, compression_ratio=0.5, chunk_size=CHUNK), n_prompt, BLOCK_SIZE)
    return stages


@pytest.fixture(scope="module")
def chunked_batch(engine, prompt_ids):
    prompts = [prompt_ids[41 * i : 41 * i + length] for i, length in enumerate(LENGTHS)]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], [chunked_params(p) for p in CHUNKED])
    engine.collective_rpc("kvpress_critical_selections")  # forgotten: the stage selections hold the same
    stages = engine.collective_rpc("kvpress_critical_stage_selections")[0]
    return prompts, outputs, [stages[internal_id(stages, output.request_id)] for output in outputs]


@pytest.fixture(scope="module")
def reference_model():
    return load_reference_model(model_path())


@pytest.mark.parametrize("index", range(len(CHUNKED)), ids=[f"{p}-{n}" for p, n in zip(CHUNKED, LENGTHS)])
def test_greedy_output_equals_transformers_prefilling_the_same_chunks(chunked_batch, reference_model, index):
    prompts, outputs, stages = chunked_batch
    prompt, press = prompts[index], CHUNKED[index]
    plan = plan_of(press, len(prompt))
    assert len(plan) >= 3
    assert [stage["seen"] for stage in stages[index]] == [p.seen for p in plan]
    for stage, expected in zip(stages[index], plan):
        assert {len(heads[0]) for heads in stage["kept"].values()} == {expected.kept}
    got = list(outputs[index].outputs[0].token_ids)
    assert got == greedy_with_compactions(reference_model, prompt, stages[index], NEW_TOKENS)


def test_plugin_keeps_what_chunked_prefill_press_keeps(chunked_batch):
    from kvpress_critical_vllm.options import CompressionOptions

    prompts, _, stages = chunked_batch
    defaults = CompressionOptions().as_dict()
    requests = []
    for press, prompt in zip(CHUNKED, prompts):
        kept_after = {str(stage.seen): stage.kept for stage in plan_of(press, len(prompt))}
        requests.append({**defaults, "press": press, "prompt_ids": prompt, "compression_ratio": 0.5,
                         "chunk_size": CHUNK, "kept_after": kept_after})  # fmt: skip
    reference = press_selections(requests)
    plugin = []
    for prompt, request_stages in zip(prompts, stages):
        # the prompt's tokens after the last compaction (a last chunk that freed no block) are all kept
        tail = list(range(request_stages[-1]["seen"], len(prompt)))
        plugin.append({name: [heads + tail for heads in layer] for name, layer in request_stages[-1]["kept"].items()})
    report, agreement = compare_selections(CHUNKED, plugin, reference)
    print("plugin vs ChunkedPrefillPress:", "; ".join(report))
    # a near-tie swapped by float rounding in one chunk changes what later chunks score, so the bar is lower than
    # for one compaction (99.9 %)
    assert all(value >= 0.995 for value in agreement.values()), report


def real_blocks(scheduler, request_id: str) -> int:
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return sum(not block.is_null for block in manager.req_to_blocks.get(request_id, ()))


def test_a_request_never_holds_more_than_the_schedules_bound(engine, prompt_ids):
    """Traced step by step (synchronous scheduling): blocks held while each chunk runs, and after the prompt."""
    from kvpress_critical_vllm.budget import blocks_held_at_most

    scheduler = scheduler_of(engine)
    prompt = prompt_ids[5 : 5 + 1500]
    plan = plan_of("critical_snapkv", len(prompt))
    engine.llm_engine.add_request("bounded", {"prompt_token_ids": prompt}, chunked_params("critical_snapkv", 64,
                                                                                         ignore_eos=True))  # fmt: skip
    (request_id,) = [rid for rid in scheduler.requests if rid.startswith("bounded-")]
    trace = []
    while engine.llm_engine.has_unfinished_requests():
        request = scheduler.requests[request_id]
        engine.llm_engine.step()
        if request.is_finished():
            break
        trace.append((request.num_computed_tokens, real_blocks(scheduler, request_id)))
    for computed, held in trace:
        before = [stage for stage in plan if stage.seen < computed]
        evicted = before[-1].evicted if before else 0
        # a step that ends at a compaction is traced after it: the blocks up to its eviction are gone
        done = [stage for stage in plan if stage.seen == computed]
        evicted = done[0].evicted if done else evicted
        assert held == -(-computed // BLOCK_SIZE) - evicted // BLOCK_SIZE, (computed, held)
    prefill_peak = max(held for computed, held in trace if computed <= len(prompt))
    budget = plan[-1].budget
    bound = -(-(budget + BLOCK_SIZE - 1 + CHUNK) // BLOCK_SIZE) + 1  # budget, one chunk, block rounding
    # the most it holds is during a compacting step, before that step's blocks go back (a trace after each step
    # sees the freed state): what admission reserves
    reserved, whole = blocks_held_at_most(plan, len(prompt), BLOCK_SIZE), -(-len(prompt) // BLOCK_SIZE)
    print(f"blocks: traced peak {prefill_peak}, reserved {reserved}, bound {bound}, whole prompt {whole}")
    assert prefill_peak <= reserved <= bound < whole
    assert scheduler.kvpress_records[request_id].compactions == len(plan)


def test_a_pool_runs_prompts_it_could_not_hold_whole():
    """64 blocks (2048 tokens): two 1900-token prompts (60 blocks each) run one after the other when compressed after
    the prompt (vLLM admits a request when its whole prompt fits), at once with chunk_size 256 (the plugin admits it
    when what it holds at most fits), ratio 0.75."""
    from conftest import REPO
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    token_bytes = 30 * 2 * 3 * 64 * 4  # SmolLM2's K and V per token in float32
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.75}, kv_cache_memory_bytes=65 * BLOCK_SIZE * token_bytes
    )
    scheduler = scheduler_of(llm)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64
    ids = AutoTokenizer.from_pretrained(model_path())((REPO / "LICENSE").read_text())["input_ids"]
    peaks = {}
    for chunk_size in (0, CHUNK):
        params = SamplingParams(
            max_tokens=16, ignore_eos=True, extra_args={"kvpress_critical": {"chunk_size": chunk_size}}
        )
        for i in range(2):
            llm.llm_engine.add_request(f"{chunk_size}-{i}", {"prompt_token_ids": ids[20 * i : 20 * i + 1900]}, params)
        _, peak = run_to_end(llm)
        peaks[chunk_size] = peak
    print("requests at once (chunk_size: peak):", peaks)
    assert peaks == {0: 1, CHUNK: 2}


def test_preempted_chunked_request_is_compressed_again_and_gives_the_same_tokens(engine, prompt_ids):
    """A pool of 36 blocks for three requests of 600 prompt tokens and 320 new ones: one is preempted, recomputed
    from its first token (its chunks stopping at the same positions) and compacted again."""
    prompts = [prompt_ids[100 * i : 100 * i + 600] for i in range(3)]
    params = chunked_params("critical_snapkv", 320, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      [params] * 3)]  # fmt: skip
    pool = 37 * 32 * 46080  # 36 blocks and the null block
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.5}, kv_cache_memory_bytes=pool, max_model_len=1024
    )
    scheduler = scheduler_of(llm)
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    tokens, _ = run_to_end(llm)
    records = scheduler.kvpress_records
    assert any(r.preemptions > 0 for r in records.values()), "the pool was meant to force a preemption"
    plan = plan_of("critical_snapkv", 600)
    assert all((r.compaction, r.blocks_freed) == (len(plan), plan[-1].evicted // 32) for r in records.values())
    assert [tokens[f"p{i}"] for i in range(3)] == expected


def test_async_scheduling_in_an_engine_process(chunked_batch, tmp_path):
    """vLLM's GPU default (engine core in its own process, async scheduling): the synchronous engine's tokens."""
    prompts, outputs, _ = chunked_batch
    plugin = {"press": "critical_snapkv", "compression_ratio": 0.5, "chunk_size": CHUNK}
    result = engine_process(tmp_path, engine=engine_kwargs(), plugin=plugin, prompts=prompts, presses=list(CHUNKED),
                            async_scheduling=True)  # fmt: skip
    assert "CriticalKVAsyncScheduler" in result["scheduler"]
    assert result["compacted"] == [sum(len(plan_of(p, len(x))) for p, x in zip(CHUNKED, prompts))]
    assert result["tokens"] == [list(o.outputs[0].token_ids) for o in outputs]
