"""A hybrid model: the plugin compresses the full-attention layers and leaves the sliding-window layers to vLLM.

The model is SmolLM2 with two sliding-window layers (128 tokens) beside each full-attention one (``layer_types``, as
Gemma 3 and gpt-oss alternate them): vLLM keeps three KV-cache groups (two of sliding-window layers, one of
full-attention layers), and the plugin evicts from the full-attention group only. One batch of requests with their own
options (uniform and head-wise presses, after the prompt, after every chunk, while decoding, one uncompressed) runs on
the shared ``hybrid`` engine; each answer must equal transformers' (Ministral: Llama's layers with ``layer_types``)
keeping the same entries in the full-attention layers and the whole sliding window in the others. The blocks a
compaction frees are the full-attention group's, and vLLM's prefix cache (on in this engine) reuses the untouched
blocks of uncompressed requests, never a block a compaction rewrote.
"""

import pytest
from conftest import (
    HYBRID_WINDOW,
    hybrid_layer_types,
    hybrid_smollm2,
    results_of,
    scheduler_of,
    serve,
    shared_engine,
)
from reference import (
    greedy_after_eviction,
    greedy_mismatches,
    greedy_with_compactions,
    greedy_with_head_masks,
    load_reference_model,
)
from selections import press_selection, same_entries
from workload import BLOCK_SIZE

pytestmark = pytest.mark.slow  # one more engine (the hybrid model) and its references: the complete tier

LAYERS = 30  # SmolLM2's
FULL = {
    f"model.layers.{i}.self_attn.attn" for i, kind in enumerate(hybrid_layer_types(LAYERS)) if kind == "full_attention"
}


@pytest.fixture(scope="module")
def hybrid_reference():
    return load_reference_model(hybrid_smollm2()[1])


def test_the_engine_compresses_one_group_of_the_three(hybrid_engine):
    scheduler = scheduler_of(hybrid_engine)
    groups = scheduler.kv_cache_config.kv_cache_groups
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    assert sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec", "SlidingWindowSpec"]
    assert set(groups[scheduler.kvpress_group].layer_names) == FULL


def test_only_the_full_attention_layers_keep_a_selection(hybrid_batch):
    for result in hybrid_batch.values():
        if result.row.kind == "uncompressed":
            assert result.kept is None
            continue
        assert set(result.kept) == FULL, result.row.name
    for result in results_of(hybrid_batch, "uniform"):
        n, ratio = len(result.prompt), result.row.options.get("compression_ratio", 0.5)
        expected = n - (n - int(n * (1 - ratio))) // BLOCK_SIZE * BLOCK_SIZE
        assert {len(heads[0]) for heads in result.kept.values()} == {expected}, result.row.name


def test_the_kept_entries_are_the_press_selection(hybrid_batch, hybrid_reference):
    """The uniform and head-wise rows kept, in each full-attention layer, what the press selects on transformers'
    prefill (the plugin's rule on the reference's queries, keys and values), near-ties of two float32 sums aside."""
    agreement = {}
    for kind in ("uniform", "head_wise"):
        for result in results_of(hybrid_batch, kind):
            expected = press_selection(hybrid_reference, result.prompt, result.kept, result.row.options)
            agreement[result.row.name] = same_entries(result.kept, expected)
    print("kept entries shared with the press's selection on transformers' prefill:", agreement)
    assert all(value >= 0.99 for value in agreement.values()), agreement


@pytest.mark.parametrize("kind", ["uniform", "uncompressed"])
def test_greedy_output_equals_transformers_keeping_the_same_full_attention_entries(
    hybrid_batch, hybrid_reference, kind
):
    for result in results_of(hybrid_batch, kind):
        args = (greedy_after_eviction, hybrid_reference, result.prompt, result.kept)
        assert not greedy_mismatches(result.tokens, *args, max_new_tokens=result.row.max_tokens), result.row.name


def test_head_wise_output_equals_transformers_masking_the_same_entries(hybrid_batch, hybrid_reference):
    (result,) = results_of(hybrid_batch, "head_wise")
    args = (greedy_with_head_masks, hybrid_reference, result.prompt, result.kept)
    assert not greedy_mismatches(result.tokens, *args, max_new_tokens=result.row.max_tokens)


@pytest.mark.parametrize("kind", ["chunked", "decoding"])
def test_compactions_replayed_in_transformers_give_the_same_tokens(hybrid_batch, hybrid_reference, kind):
    (result,) = results_of(hybrid_batch, kind)
    assert len(result.stages) > 1  # several compactions: after each chunk, or while decoding
    assert all(set(stage["kept"]) == FULL for stage in result.stages)
    args = (greedy_with_compactions, hybrid_reference, result.prompt, result.stages)
    assert not greedy_mismatches(result.tokens, *args, max_new_tokens=result.row.max_tokens)


def test_compression_changes_the_answers(hybrid_batch, hybrid_reference):
    """The reference is sensitive to what the full-attention layers drop: the whole cache answers otherwise for some
    compressed request."""
    results = [r for r in hybrid_batch.values() if r.row.kind != "uncompressed"]
    assert any(
        greedy_mismatches(
            r.tokens, greedy_after_eviction, hybrid_reference, r.prompt, None, max_new_tokens=r.row.max_tokens
        )
        for r in results
    )


def test_blocks_are_freed_from_the_full_attention_group_only(prompt_ids):
    """A 777-token request at ratio 0.5: its full-attention group frees the 12 evicted blocks (positions 0..383) after
    the prompt; each sliding-window group holds only the blocks of its window, as vLLM's manager frees them, before
    and after the compaction; the pool gets every block back at the end."""
    from kvpress_critical_vllm.vllm_compat import managers, real_blocks_held
    from vllm import SamplingParams

    llm = shared_engine("hybrid")
    scheduler = scheduler_of(llm)
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    trace = []

    def held(scheduler, ids):
        rid = ids["hybrid-blocks"]
        if rid in scheduler.requests:
            computed = scheduler.requests[rid].num_computed_tokens
            counts = [real_blocks_held(scheduler, rid, group) for group in range(len(managers(scheduler)))]
            trace.append((computed, counts))

    options = {"press": "critical_knorm", "compression_ratio": 0.5}
    params = SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"kvpress_critical": options})
    served = serve(llm, {"hybrid-blocks": (prompt_ids[:777], params)}, held)
    record = served.records["hybrid-blocks"]
    assert (record.prompt_tokens, record.kept_per_head, record.blocks_freed, record.blocks_before) == (777, 393, 12, 25)
    full = scheduler.kvpress_group
    window_blocks = -(-(HYBRID_WINDOW - 1) // BLOCK_SIZE) + 1  # the window's, one more where it starts mid-block
    for computed, counts in trace:
        assert counts[full] == -(-computed // BLOCK_SIZE) - 12, trace  # the evicted blocks are gone from the start
        sliding = [count for group, count in enumerate(counts) if group != full]
        # the prompt's step allocates all of it; vLLM frees what left the window at the next allocation
        assert sliding == [25, 25] if computed == 777 else all(c <= window_blocks + 1 for c in sliding), trace
    assert pool.get_num_free_blocks() == free


def test_the_prefix_cache_beside_a_hybrid_model_never_serves_a_rewritten_block(prompt_ids, hybrid_reference):
    """vLLM's prefix cache on, a compressed request, then two uncompressed ones with the same prompt: neither takes a
    hit on a block the compaction rewrote, both answer as the whole cache does, and the third reuses the second's
    blocks. (The second takes no hit: the full-attention group keeps hashes below the first kept position only, and
    vLLM's sliding-window groups hash the blocks of the window at a prompt's end only, so no length has both.)"""
    from vllm import SamplingParams

    llm = shared_engine("hybrid")
    prompt = prompt_ids[300:900]
    compressed = SamplingParams(
        max_tokens=8, temperature=0, extra_args={"kvpress_critical": {"press": "critical_snapkv"}}
    )
    whole = SamplingParams(max_tokens=16, temperature=0, extra_args={"kvpress_critical": {"compression_ratio": 0.0}})
    (first,) = llm.generate([{"prompt_token_ids": prompt}], compressed)
    (second,) = llm.generate([{"prompt_token_ids": prompt}], whole)
    (third,) = llm.generate([{"prompt_token_ids": prompt}], whole)
    assert first.num_cached_tokens == 0  # a compressed request takes no hit
    evicted = (len(prompt) - int(len(prompt) * 0.5)) // BLOCK_SIZE * BLOCK_SIZE
    assert second.num_cached_tokens <= evicted  # never a block from the first kept position on
    assert third.num_cached_tokens == len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    expected = greedy_after_eviction(hybrid_reference, prompt, None, 16)
    assert list(second.outputs[0].token_ids) == expected
    assert list(third.outputs[0].token_ids) == expected


def test_preempted_requests_on_a_hybrid_model_give_the_tokens_they_give_unpreempted(prompt_ids):
    """Sixteen requests of 600-token prompts generating 120 tokens outgrow the hybrid engine's pool as they generate
    (483 blocks; a request held whole ends with 23 full-attention blocks and its two windows): vLLM preempts the
    latest admitted; the compressed ones among them (uniform, after every chunk, head-wise, while decoding) are
    recomputed and compacted again, and give the tokens they give afterwards without the crowd."""
    from vllm import SamplingParams

    llm = shared_engine("hybrid")
    compressed = {
        "uniform": {"press": "critical_snapkv"},
        "chunked": {"press": "critical_knorm", "compression_chunk_size": 192},
        "head_wise": {"press": "critical_adakv_snapkv"},
        "decoding": {"press": "snapkv", "compression_ratio": 0.0, "window_size": 32, "compression_interval": 48,
                     "target_size": 384},
    }  # fmt: skip
    # the compressed requests last: vLLM preempts the latest-admitted requests first
    kinds = [*range(12), *compressed]
    options = [compressed.get(kind, {"compression_ratio": 0.0}) for kind in kinds]

    def params(option):
        return SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, extra_args={"kvpress_critical": option})

    prompts = [prompt_ids[37 * i : 37 * i + 600] for i in range(len(options))]
    together = serve(llm, {f"hybrid-crowd-{i}": (p, params(o)) for i, (p, o) in enumerate(zip(prompts, options))})
    last = {kind: i for i, kind in enumerate(kinds) if kind in compressed}
    records = {kind: together.records[f"hybrid-crowd-{i}"] for kind, i in last.items()}
    assert any(record.preemptions > 0 for record in records.values()), "the crowd was meant to preempt a compressed one"
    alone = serve(llm, {f"hybrid-alone-{i}": (prompts[i], params(options[i])) for i in last.values()})  # they fit
    for kind, i in last.items():
        assert alone.records[f"hybrid-alone-{i}"].preemptions == 0
        assert together.tokens[f"hybrid-crowd-{i}"] == alone.tokens[f"hybrid-alone-{i}"], kind
