"""Compression while decoding (``compression_interval``, ``target_size``): the engine runs kvpress's ``DecodingPress``
schedule.

The decoding rows of the mixed batch, each with its own options (alone, after the prompt's compression, after every
prompt chunk; SnapKV, key norms, StreamingLLM), generating 160 tokens. Checked:

- exactness: the engine's greedy tokens equal transformers' decoding with the same compactions replayed
  (``reference.greedy_with_compactions``, fed with the kept positions the engine reports after each compaction);
- selection: the kept entries equal this project's ``DecodingCompressor`` on kvpress's ``DecodingPress`` schedule
  (``CompactCachePress(DecodingPress(press, interval, target))`` in transformers, run in kvpress's environment on the
  engine's tokens) keeping the plugin's block-aligned counts;
- memory: ten generations of 160 tokens that together need 1.4 times the pool run at once, every request holding
  at every step no more blocks than its schedule's bound; a prompt and a generation longer than the pool are served
  by an engine whose max_model_len is longer than its pool;
- preemption: the same tokens as the unpreempted engine (async scheduling: ``test_engine_features.py``).
"""

import pytest
from conftest import first_fast, real_blocks, results_of, scheduler_of, serve
from reference import greedy_mismatches, greedy_with_compactions
from selections import compare_selections, plan_of, plan_options
from workload import BLOCK_SIZE, rows_of

NAMES = [row.name for row in rows_of("decoding")]


def params(options: dict, max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args={"kvpress_critical": options}
    )


@pytest.mark.parametrize("name", first_fast(NAMES))
def test_greedy_output_equals_transformers_with_the_same_compactions(mixed_batch, reference_model, name):
    result = mixed_batch[name]
    prompt, options, n_new = result.prompt, result.row.options, result.row.max_tokens
    # the last generated token is sampled, never computed: the last compaction is at most one token before the end
    plan = plan_of(options, len(prompt), len(prompt) + n_new - 1)
    assert sum(stage.phase == "decoding" for stage in plan) >= 3
    assert [stage["seen"] for stage in result.stages] == [p.seen for p in plan]
    for stage, expected in zip(result.stages, plan):
        assert {len(heads[0]) for heads in stage["kept"].values()} == {expected.kept}
    assert not greedy_mismatches(
        result.tokens, greedy_with_compactions, reference_model, prompt, result.stages, max_new_tokens=n_new
    )


@pytest.mark.slow  # the transformers presses run in kvpress's environment: the complete tier
def test_plugin_keeps_what_the_decoding_press_keeps(mixed_batch, reference_selections):
    report, agreement = [], {}
    for result in results_of(mixed_batch, "decoding"):
        name, last = result.row.name, result.stages[-1]
        expected = reference_selections[name]
        assert str(last["seen"]) in expected, (name, last["seen"], list(expected))
        lines, shares = compare_selections([name], [last["kept"]], [expected[str(last["seen"])]])
        report += lines
        agreement.update(shares)
    print("plugin vs DecodingPress, after the last compaction:", "; ".join(report))
    # near-ties swapped by float rounding in one compaction change what later ones score (as with chunks)
    assert all(value >= 0.995 for value in agreement.values()), report


@pytest.mark.slow
def test_long_generations_run_at_once_in_bounded_memory(small_pool_engine, prompt_ids):
    """A pool of 64 blocks (2048 tokens): ten requests of 128 prompt tokens generating 160 each (9 blocks each
    uncompressed, 1.4 times the pool together) run at once, compressed every 48 tokens back to 64 per head."""
    options = {"compression_ratio": 0.0, "compression_interval": 48, "target_size": 64, "window_size": 32}
    plan = plan_of(options, 128, 288)
    before_first, after_first = [0], [0]

    def check(scheduler, ids):
        for request in scheduler.running:
            computed = request.num_computed_tokens
            done = [stage for stage in plan if stage.seen <= computed]
            evicted = done[-1].evicted if done else 0
            held = real_blocks(scheduler, request.request_id)
            assert held <= -(-computed // BLOCK_SIZE) - evicted // BLOCK_SIZE, (request.request_id, computed, held)
            (after_first if done else before_first).append(held)

    requests = {f"long{i}": (prompt_ids[70 * i : 70 * i + 128], params(options, 160)) for i in range(10)}
    served = serve(small_pool_engine, requests, check)
    # before its first compaction a request holds its prompt and one interval; after it, at most the target, one
    # interval and the block rounding
    bound = -(-(64 + BLOCK_SIZE - 1 + 48) // BLOCK_SIZE)
    first, worst = max(before_first), max(after_first)
    print(f"requests at once {served.peak}, blocks held at most {first} then {worst} (bound {bound}, uncompressed 9)")
    assert {name: len(tokens) for name, tokens in served.tokens.items()} == dict.fromkeys(requests, 160)
    assert served.peak == 10 and first <= -(-(128 + 48) // BLOCK_SIZE) and worst <= bound
    assert all(record.preemptions == 0 and record.compaction == len(plan) for record in served.records.values())


@pytest.mark.slow
def test_a_prompt_and_a_generation_longer_than_the_pool_are_served(bounded_engine, prompt_ids):
    """A pool of 16 blocks (512 tokens) and a max_model_len of 2048: with compression_chunk_size, compression_interval
    and target_size engine-wide a request holds at most ``hold_bound`` blocks, which vLLM's start-up check reads. A
    1200-token prompt (2.3 times the pool) and a 640-token generation (1.25 times the pool by itself) are served,
    every request within the bound at every step; a request whose own options would hold more than the pool is refused
    when it is made, one that fits the pool whole is served whatever its options."""
    from conftest import ENGINES
    from kvpress_critical_vllm.budget import blocks_held_at_most, hold_bound
    from vllm.exceptions import VLLMValidationError

    llm, options = bounded_engine, ENGINES["bounded"]["plugin"]
    scheduler = scheduler_of(llm)
    bound = hold_bound(plan_options(options), 2048, BLOCK_SIZE)
    assert scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.max_blocks_held == bound
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 16 and bound <= 16 < 2048 // BLOCK_SIZE
    # 1232 tokens held whole: more than the pool
    with pytest.raises(VLLMValidationError, match="compression_chunk_size"):
        llm.generate([{"prompt_token_ids": prompt_ids[:1200]}], [params({"compression_chunk_size": 0}, 32)])
    # the check reads the request's own length: 300 + 8 tokens held whole fit the pool, whatever the options
    (short,) = llm.generate([{"prompt_token_ids": prompt_ids[:300]}], [params({"compression_ratio": 0}, 8)])
    assert len(short.outputs[0].token_ids) == 8
    lengths = {"long-prompt": (prompt_ids[:1200], 32), "long-generation": (prompt_ids[300:500], 640)}
    plans = {name: plan_of(options, len(prompt), len(prompt) + n) for name, (prompt, n) in lengths.items()}
    most = dict.fromkeys(plans, 0)

    def check(scheduler, ids):
        names = {rid: name for name, rid in ids.items()}
        for request in scheduler.running:
            computed, name = request.num_computed_tokens, names[request.request_id]
            held = real_blocks(scheduler, request.request_id)
            traced = blocks_held_at_most([s for s in plans[name] if s.seen <= computed], computed, BLOCK_SIZE)
            assert held <= min(traced, bound), (name, computed, held, traced, bound)
            most[name] = max(most[name], held)

    served = serve(llm, {name: (prompt, params({}, n)) for name, (prompt, n) in lengths.items()}, check)
    print(f"bound {bound} blocks of a 16-block pool; held at most {most}")
    assert {name: len(tokens) for name, tokens in served.tokens.items()} == {n: k for n, (_, k) in lengths.items()}
    assert all(record.preemptions == 0 for record in served.records.values())
    # min_kept: a prompt no longer than it is served whole (the tokens of ratio 0, never compacted), a longer one keeps
    # at least min_kept entries per head at every compaction, within the pool's bound
    floor = serve(
        llm,
        {
            "floor-short": (prompt_ids[:216], params({"min_kept": 256}, 8)),
            "floor-whole": (prompt_ids[:216], params({"compression_ratio": 0}, 8)),
            "floor-long": (prompt_ids[:1200], params({"min_kept": 128}, 8)),
        },
    )
    assert floor.tokens["floor-short"] == floor.tokens["floor-whole"] and "floor-short" not in floor.records
    stages = plan_of({**options, "min_kept": 128}, 1200)
    assert all(stage.kept >= 128 for stage in stages) and 128 <= stages[-1].kept < 128 + BLOCK_SIZE
    assert plan_of(options, 1200)[-1].kept < 128  # without the floor, fewer
    record = floor.records["floor-long"]
    assert record.compactions == len(stages) and record.kept_per_head == stages[-1].kept
