"""Eviction on an fp8 KV cache: the plugin compresses the entries vLLM's CPU attention stores as e4m3 codes.

One batch of requests with their own options (uniform and head-wise presses, after the prompt, after every chunk,
while decoding, one uncompressed) runs on the shared ``fp8`` engine (``kv_cache_dtype="fp8"``); each answer is checked
step by step against transformers keeping the same entries with every key and value rounded as the cache stores them
(``reference.fp8_cache``: vLLM's quantizer, checked code for code in ``test_fp8_units.py``), the reference following
the engine's tokens (:data:`NEAR_TIE` says why not token for token). The selections themselves are checked entry for
entry, and the compactions' bytes code for code, in ``test_fp8_units.py``; the pool of the default engine's bytes
holds four times its blocks.
"""

import pytest
import torch
from conftest import ENGINES, fp8_on_this_cpu, pool_of, results_of, scheduler_of
from reference import (
    fp8_cache,
    greedy_after_eviction,
    greedy_with_compactions,
    greedy_with_head_masks,
    margins_along,
)
from workload import BLOCK_SIZE

pytestmark = [
    pytest.mark.slow,  # one more engine (the fp8 cache) and its references: the complete tier
    pytest.mark.skipif(fp8_on_this_cpu() is not None, reason=str(fp8_on_this_cpu())),
]

E4M3 = torch.float8_e4m3fn  # kv_cache_dtype="fp8"
# The engine and transformers compute each key and value in float32 with different summation orders (about 1e-7
# apart); where one lies on an fp8 code boundary the two caches round it to neighbouring codes (an eighth of its
# value apart), a few elements in a long answer, which can flip a later near-tie of the greedy choice. So every step of
# an answer is checked with the reference following the engine's tokens: the engine's token must be the reference's
# greedy one or within NEAR_TIE (in logits) of it, rarely (measured: at most 1 step of 32 and 4 of 160 off, by at most
# 0.21); a
# wrong selection, scale or misread code costs whole logits at many steps.
NEAR_TIE = 0.5


def reference_of(result, model) -> tuple:
    """The reference of a batch row over ``model``, as ``(greedy function, its arguments)``."""
    if result.row.kind in ("uniform", "uncompressed"):
        return greedy_after_eviction, model, result.prompt, result.kept
    if result.row.kind == "head_wise":
        return greedy_with_head_masks, model, result.prompt, result.kept
    return greedy_with_compactions, model, result.prompt, result.stages


@pytest.fixture(scope="module")
def margins(fp8_batch, reference_model) -> dict[str, dict[str, list[float]]]:
    """Per row of the batch, the margins of the engine's answer against the fp8 reference (``"fp8"``) and against the
    float one keeping the same entries unrounded (``"float"``)."""
    found = {"fp8": {}, "float": {}}
    for result in fp8_batch.values():
        found["float"][result.row.name] = margins_along(result.tokens, *reference_of(result, reference_model))
        with fp8_cache(reference_model, E4M3) as model:
            found["fp8"][result.row.name] = margins_along(result.tokens, *reference_of(result, model))
    return found


def check(result, margins) -> None:
    """Every step of the engine's answer is the fp8 reference's greedy token or within :data:`NEAR_TIE` of it, and at
    most one step in ten is not the greedy one."""
    steps = margins["fp8"][result.row.name]
    off = [(step, round(margin, 3)) for step, margin in enumerate(steps) if margin > 0]
    print(f"{result.row.name}: {'not ' if off else ''}the same tokens; steps off greedy: {off}")
    assert max(steps) <= NEAR_TIE and len(off) <= max(1, len(steps) // 10), (result.row.name, off)


def test_the_pool_holds_four_times_the_blocks_in_the_same_bytes(fp8_engine):
    scheduler = scheduler_of(fp8_engine)
    assert ENGINES["fp8"]["kv_cache_memory_bytes"] == pool_of(320)
    # float32 entries (4 bytes) replaced by one-byte codes: 4 * 321 blocks, vLLM's null block among them
    assert scheduler.kv_cache_manager.block_pool.num_gpu_blocks == 4 * 321
    worker_codes = fp8_engine.collective_rpc("kvpress_critical_kv_codes")[0]
    assert set(worker_codes.values()) == {("fp8", 1.0, 1.0)} and len(worker_codes) == 30


@pytest.mark.parametrize("kind", ["uniform", "uncompressed"])
def test_greedy_output_equals_transformers_over_the_same_fp8_entries(fp8_batch, margins, kind):
    for result in results_of(fp8_batch, kind):
        if kind == "uniform":
            n, ratio = len(result.prompt), result.row.options.get("compression_ratio", 0.5)
            expected = n - (n - int(n * (1 - ratio))) // BLOCK_SIZE * BLOCK_SIZE
            assert {len(heads[0]) for heads in result.kept.values()} == {expected}, result.row.name
        check(result, margins)


def test_head_wise_output_equals_transformers_masking_the_same_fp8_entries(fp8_batch, margins):
    results = results_of(fp8_batch, "head_wise")
    assert len(results) == 2
    for result in results:
        counts = {len(head) for heads in result.kept.values() for head in heads}
        assert len(counts) > 1, result.row.name  # budgets differ across heads: the head-wise layout's own blocks
        check(result, margins)


@pytest.mark.parametrize("kind", ["chunked", "decoding"])
def test_compactions_replayed_over_fp8_entries_give_the_same_tokens(fp8_batch, margins, kind):
    (result,) = results_of(fp8_batch, kind)
    assert len(result.stages) > 1  # several compactions: after each chunk, or while decoding
    check(result, margins)


def test_the_engine_follows_the_rounded_reference_far_closer_than_the_float_one(margins):
    """The checks above are not blind to the rounding: over the whole batch, the engine's answers cost a small
    fraction of the margins they cost against the float reference (the same entries, not rounded)."""
    rounded = sum(sum(steps) for steps in margins["fp8"].values())
    unrounded = sum(sum(steps) for steps in margins["float"].values())
    print(f"summed margins over the batch: {rounded:.3f} against the fp8 reference, {unrounded:.3f} the float one")
    assert rounded < unrounded / 3
