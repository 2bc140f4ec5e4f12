"""Compression while decoding (``compression_interval``, ``target_size``): the engine runs kvpress's ``DecodingPress``
schedule.

Requests of the session's engine, each with its own options (alone, after the prompt's compression, after every
prompt chunk; SnapKV, key norms, StreamingLLM), generating 160 tokens. Checked:

- exactness: the engine's greedy tokens equal transformers' decoding with the same compactions replayed
  (``reference.greedy_with_compactions``, fed with the kept positions the engine reports after each compaction);
- selection: the kept entries equal this project's ``DecodingCompressor`` on kvpress's ``DecodingPress`` schedule
  (``CompactCachePress(DecodingPress(press, interval, target))`` in transformers, run in kvpress's environment on the
  engine's tokens) keeping the plugin's block-aligned counts;
- memory: three generations of 800 tokens that together need 2.9 times the pool run at once, every request holding
  at every step no more blocks than its schedule's bound;
- preemption and async scheduling: the same tokens as the synchronous, unpreempted engine.
"""

import pytest
from conftest import BLOCK_SIZE, engine_kwargs, internal_id, make_llm, model_path, run_to_end, scheduler_of
from reference import greedy_with_compactions, load_reference_model
from test_chunked import real_blocks
from test_engine_features import engine_process
from test_selection import compare_selections, press_selections

pytestmark = pytest.mark.slow

DECODE_TOKENS = 160
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4  # SmolLM2's K and V per token in float32
# (prompt length, the request's options)
REQUESTS = (
    (400, {"press": "critical_snapkv", "compression_ratio": 0.0, "window_size": 32, "compression_interval": 48,
           "target_size": 160}),
    (700, {"press": "snapkv", "compression_ratio": 0.5, "window_size": 32, "compression_interval": 48,
           "target_size": 160}),
    (900, {"press": "critical_knorm", "compression_ratio": 0.5, "chunk_size": 256, "compression_interval": 40,
           "target_size": 200}),
    (500, {"press": "streaming_llm", "compression_ratio": 0.0, "compression_interval": 40, "target_size": 128}),
)  # fmt: skip
NAMES = [f"{options['press']}-{n}" for n, options in REQUESTS]


def params(options: dict, max_tokens: int = DECODE_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args={"kvpress_critical": options}
    )


def plan_options(options: dict):
    """The plugin's options for this dict over the defaults."""
    from dataclasses import replace

    from kvpress_critical_vllm.options import CompressionOptions

    return replace(CompressionOptions(), **options)


def plan_of(options: dict, n_prompt: int, n_tokens: int):
    """The request's compactions up to ``n_tokens`` tokens seen (the budget module's, for the engine's options)."""
    from kvpress_critical_vllm.budget import Schedule

    return Schedule(plan_options(options), n_prompt, BLOCK_SIZE).upto(n_tokens)


@pytest.fixture(scope="module")
def decoding_batch(engine, prompt_ids):
    prompts = [prompt_ids[53 * i : 53 * i + n] for i, (n, _) in enumerate(REQUESTS)]
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], [params(o) for _, o in REQUESTS])
    engine.collective_rpc("kvpress_critical_selections")  # forgotten: the stage selections hold the same
    stages = engine.collective_rpc("kvpress_critical_stage_selections")[0]
    return prompts, outputs, [stages[internal_id(stages, output.request_id)] for output in outputs]


@pytest.fixture(scope="module")
def reference_model():
    return load_reference_model(model_path())


@pytest.mark.parametrize("index", range(len(REQUESTS)), ids=NAMES)
def test_greedy_output_equals_transformers_with_the_same_compactions(decoding_batch, reference_model, index):
    prompts, outputs, stages = decoding_batch
    prompt, options = prompts[index], REQUESTS[index][1]
    # the last generated token is sampled, never computed: the last compaction is at most one token before the end
    plan = plan_of(options, len(prompt), len(prompt) + DECODE_TOKENS - 1)
    assert sum(stage.phase == "decoding" for stage in plan) >= 3
    assert [stage["seen"] for stage in stages[index]] == [p.seen for p in plan]
    for stage, expected in zip(stages[index], plan):
        assert {len(heads[0]) for heads in stage["kept"].values()} == {expected.kept}
    got = list(outputs[index].outputs[0].token_ids)
    assert got == greedy_with_compactions(reference_model, prompt, stages[index], DECODE_TOKENS)


def test_plugin_keeps_what_the_decoding_press_keeps(decoding_batch):
    from kvpress_critical_vllm.options import CompressionOptions

    prompts, outputs, stages = decoding_batch
    defaults = CompressionOptions().as_dict()
    requests, plugin = [], []
    for (_, options), prompt, output, request_stages in zip(REQUESTS, prompts, outputs, stages):
        plan = plan_of(options, len(prompt), len(prompt) + DECODE_TOKENS - 1)
        prompt_plan = [s for s in plan if s.phase == "prompt"]
        requests.append({
            **defaults, **options, "prompt_ids": prompt, "tokens": list(output.outputs[0].token_ids)[:-1],
            "kept_after": {str(s.seen): s.kept for s in prompt_plan},
            "kept_at": {str(s.seen): s.kept for s in plan if s.phase == "decoding"},
        })  # fmt: skip
        plugin.append(request_stages[-1])
    reference = press_selections(requests)
    report, agreement = [], {}
    for name, last, expected in zip(NAMES, plugin, reference):
        assert str(last["seen"]) in expected, (name, last["seen"], list(expected))
        lines, shares = compare_selections([name], [last["kept"]], [expected[str(last["seen"])]])
        report += lines
        agreement.update(shares)
    print("plugin vs DecodingPress, after the last compaction:", "; ".join(report))
    # near-ties swapped by float rounding in one compaction change what later ones score (as with chunks)
    assert all(value >= 0.995 for value in agreement.values()), report


def test_long_generations_run_at_once_in_bounded_memory(prompt_ids):
    """A pool of 32 blocks (1024 tokens): three requests of 200 prompt tokens generating 800 each (31 blocks each
    uncompressed, 2.9 times the pool together) run at once, compressed every 96 tokens back to 128 per head."""
    options = {"compression_interval": 96, "target_size": 128, "window_size": 32}
    llm = make_llm({"press": "critical_snapkv", "compression_ratio": 0.0, **options},
                   kv_cache_memory_bytes=33 * BLOCK_SIZE * TOKEN_BYTES, max_model_len=1024)  # fmt: skip
    scheduler = scheduler_of(llm)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 32
    prompts = [prompt_ids[70 * i : 70 * i + 200] for i in range(3)]
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(f"long{i}", {"prompt_token_ids": prompt}, params({}, 800))
    ids = {rid.rpartition("-")[0]: rid for rid in scheduler.requests}
    plan = plan_of({"compression_ratio": 0.0, **options}, 200, 1000)
    tokens, peak, worst, first = {}, 0, 0, 0
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                tokens[output.request_id] = len(output.outputs[0].token_ids)
        peak = max(peak, len(scheduler.running))
        for request in scheduler.running:
            computed = request.num_computed_tokens
            done = [stage for stage in plan if stage.seen <= computed]
            evicted = done[-1].evicted if done else 0
            held = real_blocks(scheduler, request.request_id)
            assert held <= -(-computed // BLOCK_SIZE) - evicted // BLOCK_SIZE, (request.request_id, computed, held)
            if done:
                worst = max(worst, held)
            else:
                first = max(first, held)
    # before its first compaction a request holds its prompt and one interval; after it, at most the target, one
    # interval and the block rounding
    bound = -(-(128 + BLOCK_SIZE - 1 + 96) // BLOCK_SIZE)
    print(f"requests at once {peak}, blocks held at most {first} then {worst} (bound {bound}, uncompressed 32)")
    assert tokens == {f"long{i}": 800 for i in range(3)} and peak == 3
    assert first <= -(-(200 + 96) // BLOCK_SIZE) and worst <= bound
    assert all(scheduler.kvpress_records[ids[f"long{i}"]].preemptions == 0 for i in range(3))
    assert all(scheduler.kvpress_records[ids[f"long{i}"]].compaction == len(plan) for i in range(3))


def test_a_prompt_and_a_generation_longer_than_the_pool_are_served(prompt_ids):
    """A pool of 32 blocks (1024 tokens) and a max_model_len of 3072: with chunk_size, compression_interval and
    target_size engine-wide a request holds at most ``hold_bound`` blocks, which vLLM's start-up check reads. A
    2400-token prompt (2.3 times the pool) and a 1600-token generation (1.6 times the pool by itself) are
    served, every request within the bound at every step; a request whose own options would hold its prompt whole
    is refused when it is made."""
    from kvpress_critical_vllm.budget import blocks_held_at_most, hold_bound
    from vllm.exceptions import VLLMValidationError

    options = {"compression_ratio": 0.9, "chunk_size": 256, "compression_interval": 128, "target_size": 256,
               "window_size": 32}  # fmt: skip
    llm = make_llm({"press": "critical_snapkv", **options}, kv_cache_memory_bytes=33 * BLOCK_SIZE * TOKEN_BYTES,
                   max_model_len=3072)  # fmt: skip
    scheduler = scheduler_of(llm)
    bound = hold_bound(plan_options(options), 3072, BLOCK_SIZE)
    assert scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.max_blocks_held == bound
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 32 and bound <= 32 < 3072 // BLOCK_SIZE
    with pytest.raises(VLLMValidationError, match="chunk_size"):
        llm.generate([{"prompt_token_ids": prompt_ids[:100]}], [params({"chunk_size": 0}, 8)])
    long_prompt = (prompt_ids * 2)[:2400]
    requests = {"long-prompt": (long_prompt, 64), "long-generation": (prompt_ids[300:500], 1600)}
    for name, (prompt, new_tokens) in requests.items():
        llm.llm_engine.add_request(name, {"prompt_token_ids": prompt}, params({}, new_tokens))
    ids = {rid.rpartition("-")[0]: rid for rid in scheduler.requests}
    plans = {ids[name]: plan_of(options, len(prompt), len(prompt) + n) for name, (prompt, n) in requests.items()}
    tokens, most = {}, dict.fromkeys(plans, 0)
    while llm.llm_engine.has_unfinished_requests():
        for output in llm.llm_engine.step():
            if output.finished:
                tokens[output.request_id] = len(output.outputs[0].token_ids)
        for request in scheduler.running:
            computed, plan = request.num_computed_tokens, plans[request.request_id]
            held = real_blocks(scheduler, request.request_id)
            traced = blocks_held_at_most([s for s in plan if s.seen <= computed], computed, BLOCK_SIZE)
            assert held <= min(traced, bound), (request.request_id, computed, held, traced, bound)
            most[request.request_id] = max(most[request.request_id], held)
    print(f"bound {bound} blocks of a 32-block pool; held at most {most}")
    assert tokens == {name: n for name, (_, n) in requests.items()}
    assert all(scheduler.kvpress_records[rid].preemptions == 0 for rid in plans)


def test_a_preempted_request_is_compacted_again_while_recomputed(engine, prompt_ids):
    """A pool of 32 blocks for two requests of 500 prompt tokens (16 blocks each) that grow 5 blocks per interval:
    one is preempted at once, recomputed from its first token (stopping at each decoding compaction) and compacted
    again."""
    options = {"compression_ratio": 0.0, "window_size": 32, "compression_interval": 160, "target_size": 256}
    prompts = [prompt_ids[90 * i : 90 * i + 500] for i in range(2)]
    expected = [list(o.outputs[0].token_ids) for o in engine.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      [params(options, 400)] * 2)]  # fmt: skip
    llm = make_llm({"press": "critical_snapkv", **options}, kv_cache_memory_bytes=33 * BLOCK_SIZE * TOKEN_BYTES,
                   max_model_len=1024)  # fmt: skip
    scheduler = scheduler_of(llm)
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(f"d{i}", {"prompt_token_ids": prompt}, params({}, 400))
    tokens, _ = run_to_end(llm)
    records = scheduler.kvpress_records
    assert any(r.preemptions > 0 for r in records.values()), "the pool was meant to force a preemption"
    plan = plan_of(options, 500, 899)
    assert all((r.compaction, r.blocks_freed) == (len(plan), plan[-1].evicted // 32) for r in records.values())
    assert [tokens[f"d{i}"] for i in range(2)] == expected


def test_async_scheduling_in_an_engine_process(decoding_batch, tmp_path):
    """vLLM's GPU default (engine core in its own process, async scheduling): the synchronous engine's tokens."""
    prompts, outputs, _ = decoding_batch
    result = engine_process(
        tmp_path, engine=engine_kwargs(), plugin={"press": "critical_snapkv", "compression_ratio": 0.5},
        prompts=prompts, requests=[options for _, options in REQUESTS], max_tokens=DECODE_TOKENS, ignore_eos=True,
        async_scheduling=True,
    )  # fmt: skip
    assert "CriticalKVAsyncScheduler" in result["scheduler"]
    compactions = sum(len(plan_of(o, len(p), len(p) + DECODE_TOKENS - 1)) for (_, o), p in zip(REQUESTS, prompts))
    assert result["compacted"] == [compactions]
    assert result["tokens"] == [list(o.outputs[0].token_ids) for o in outputs]
