"""Head-wise budgets inside vLLM: CriticalAdaKV and AdaKV over SnapKV, with the blocks a uniform press frees.

The head-wise rows of the mixed batch (per-request presses, prompts of different lengths whose last ``N mod 32``
tokens share a block with the new tokens, 32 greedy tokens each, decoding in the same steps as uniform, chunked,
decoding and uncompressed rows). Checked:

- exactness: the engine's tokens equal transformers' with each layer's KV heads attending only to the entries the
  engine reports they kept (kvpress's masking of head-wise presses, written out in ``reference.py``);
- selection: the kept entries equal this project's transformers presses (``CriticalAdaKVPress(SnapKVPress(...))``,
  kvpress's ``AdaKVPress(SnapKVPress(...))``) for the same budget, run in kvpress's environment;
- budgets are uneven across heads (a test that fails if every head kept the same count);
- blocks: a head-wise request frees exactly the blocks the uniform press frees at the same ratio (a fixed pool runs as
  many head-wise requests at once as uniform ones: ``test_blocks.py``).

Chunked prefill and async scheduling run the same rows in ``test_engine_features.py``, preemption in
``test_preemption.py``.
"""

import pytest
from conftest import first_fast, results_of, serve
from reference import greedy_mismatches, greedy_with_head_masks
from selections import compare_results
from workload import NEW_TOKENS, rows_of

NAMES = [row.name for row in rows_of("head_wise")]


@pytest.mark.parametrize("name", first_fast(NAMES))
def test_greedy_output_equals_transformers_with_each_heads_entries(mixed_batch, reference_model, name):
    result = mixed_batch[name]
    layers = result.kept
    assert len(layers) == 30
    n_prompt = len(result.prompt)
    budget = n_prompt - (n_prompt - int(n_prompt * 0.5)) // 32 * 32  # the uniform press's block-aligned count
    for heads in layers.values():
        assert sum(len(positions) for positions in heads) == budget * len(heads)  # the layer's total, shared
        last = set(range(n_prompt // 32 * 32, n_prompt))
        assert all(last <= set(positions) for positions in heads)  # the last partial block: kept by every head
    assert not greedy_mismatches(
        result.tokens, greedy_with_head_masks, reference_model, result.prompt, layers, max_new_tokens=NEW_TOKENS
    )


def test_budgets_are_uneven_across_heads(mixed_batch):
    kept = [result.kept for result in results_of(mixed_batch, "head_wise")]
    spreads = [max(map(len, heads)) - min(map(len, heads)) for layers in kept for heads in layers.values()]
    assert sum(spread > 0 for spread in spreads) > 0.5 * len(spreads), spreads


@pytest.mark.slow  # the transformers presses run in kvpress's environment: the complete tier
def test_head_wise_selection_equals_the_transformers_presses(mixed_batch, reference_selections):
    report, agreement = compare_results(results_of(mixed_batch, "head_wise"), reference_selections)
    print("plugin vs transformers head-wise presses:", "; ".join(report))
    assert all(value >= 0.999 for value in agreement.values()), report


def test_a_head_wise_request_frees_the_uniform_press_blocks(engine, prompt_ids):
    from vllm import SamplingParams

    prompt = prompt_ids[:777]
    freed = {}
    for press in ("critical_snapkv", "critical_adakv_snapkv"):
        params = SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"kvpress_critical": {"press": press}})
        record = serve(engine, {f"frees-{press}": (prompt, params)}).records[f"frees-{press}"]
        freed[press] = (record.blocks_freed, record.kept_per_head)
        if press == "critical_adakv_snapkv":
            assert record.kept_min < record.kept_per_head < record.kept_max
    assert freed["critical_snapkv"] == freed["critical_adakv_snapkv"] == (12, 393)


def test_head_wise_presses_refuse_tensor_parallelism():
    """Tensor parallelism splits a layer's heads (and each block) over ranks whose shares of a shared budget differ:
    head-wise presses refuse it, engine-wide at start-up and per request in the caller."""
    from kvpress_critical_vllm.options import CompressionOptions, OptionsError, check_layout, resolve_options

    with pytest.raises(OptionsError, match="tensor parallelism"):
        check_layout(CompressionOptions(press="critical_adakv_snapkv"), 32, "engine", tensor_parallel_size=2)
    engine = CompressionOptions(compression_ratio=0.5)
    with pytest.raises(OptionsError, match="tensor_parallel_size=1"):
        resolve_options(engine, {"kvpress_critical.press": "adakv_snapkv"}, 32, tensor_parallel_size=2)
    assert resolve_options(engine, {"kvpress_critical.press": "critical_snapkv"}, 32, tensor_parallel_size=2)
    with pytest.raises(OptionsError, match="window_size=16 must be at least block_size - 1 = 31"):
        resolve_options(engine, {"kvpress_critical": {"press": "adakv_snapkv", "window_size": 16}}, 32)
