"""A linear-attention hybrid: the plugin compresses the full-attention layers and leaves the linear-attention layers'
recurrent state to vLLM.

The model is the tiny random-weight Qwen3-Next of ``architectures.py``: Gated DeltaNet linear attention in three layers
of four, gated full attention in the fourth, in bfloat16 (vLLM's CPU build runs Gated DeltaNet in bfloat16 only).
vLLM keeps four KV-cache groups (three of linear-attention states, ``MambaSpec``; one of full-attention entries), and
the plugin evicts from the full-attention group only. The hybrid batch (``workload.LINEAR_ROWS``: uniform and
head-wise presses, after the prompt, after every chunk, while decoding, one uncompressed) runs with vLLM's prefix
cache on (its default here: linear-attention states cached at block boundaries, ``mamba_cache_mode`` "align").
Qwen3-Next mixes experts, and vLLM creates its expert-parallel group with a process's first engine (a dense model in
the suite's process), so the batch runs in an engine process of its own: a background job.

Each answer is checked step by step against transformers' Qwen3-Next keeping the engine's entries in the
full-attention layer (the linear-attention layers run their own recurrence): in bfloat16, the engine's and
transformers' sums differ in their last bits, so a near-tie may go either way; every step must be the reference's
greedy token or within :data:`NEAR_TIE` logits of it, and the reference that keeps every entry must disagree with
the compressed answers far more often (the check sees what the engine dropped).
"""

from pathlib import Path

import background
import pytest
import torch
from architectures import make_model
from conftest import ENGINE_OPTIONS, IDLE_POOL, engine_kwargs, job_results, model_path, token_ids
from reference import greedy_after_eviction, load_reference_model, margins_along, reference_of
from selections import press_selection, same_entries
from test_engine_features import engine_process_job, job_requests, result_of
from workload import BLOCK_SIZE, LINEAR_ROWS

pytestmark = pytest.mark.slow

FULL = {"model.layers.3.self_attn.attn"}  # the one full-attention layer of four
NEAR_TIE = 0.25  # logits: a few bfloat16 roundings of the logits
_MODEL: dict = {}


def qwen3_next(folder) -> str:
    if "path" not in _MODEL:
        _MODEL["path"] = make_model("qwen3_next", folder, Path(model_path()))
    return _MODEL["path"]


@background.job("linear-attention", lane="models")
def linear_attention_job(tmp_path_factory) -> background.Job:
    """The hybrid batch on the tiny Qwen3-Next, in an engine process whose engine core runs in it (so that the job
    reports each request's record and the pool once the batch is done)."""
    ids = token_ids()
    path = qwen3_next(tmp_path_factory.mktemp("qwen3-next"))
    engine = engine_kwargs(model=path, dtype="bfloat16", enable_prefix_caching=True, kv_cache_memory_bytes=16 * 2**20)
    job = dict(
        engine=engine,
        plugin={**ENGINE_OPTIONS, "record_selections": True},
        prompts=[row.prompt(ids) for row in LINEAR_ROWS],
        requests=job_requests(LINEAR_ROWS),
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    return engine_process_job(tmp_path_factory.mktemp("linear-attention"), **job)


@pytest.fixture(scope="module")
def linear_job(background_jobs) -> dict:
    """What the job reported (``engine_process.py``), once it has ended."""
    return result_of(background_jobs.finished("linear-attention"))


@pytest.fixture(scope="module")
def linear_batch(linear_job) -> list:
    """The job's rows as it ran them (``conftest.Result``), in ``LINEAR_ROWS``' order."""
    return job_results(linear_job, LINEAR_ROWS, token_ids())


@pytest.fixture(scope="module")
def linear_reference():
    return load_reference_model(_MODEL["path"], dtype=torch.bfloat16)


@pytest.mark.background("linear-attention")
def test_the_engine_compresses_the_full_attention_group_and_ends_idle(linear_job, linear_batch):
    """Four KV-cache groups, three of linear-attention states; the plugin compresses the full-attention one, only its
    layer keeps selections; the engine ends idle (every block back, nothing tracked)."""
    job = linear_job
    assert sorted(job["groups"]) == ["FullAttentionSpec", "MambaSpec", "MambaSpec", "MambaSpec"]
    assert job["groups"][job["compressed_group"]] == "FullAttentionSpec"
    assert set(job["compressed_layers"]) == FULL
    for result, record in zip(linear_batch, job["records"]):
        if result.row.kind == "uncompressed":
            assert result.kept is None and record is None, result.row.name
        else:
            assert set(result.kept) == FULL, result.row.name
    assert job["pool"] == IDLE_POOL and job["tracked"] == [0]


@pytest.mark.background("linear-attention")
def test_the_blocks_freed_are_the_full_attention_groups(linear_job, linear_batch):
    """A uniform request keeps every KV head's budget rounded up to whole blocks and frees the evicted blocks of the
    full-attention group: its record counts that group's blocks alone (a linear-attention group's would add its
    state's blocks)."""
    for result, record in zip(linear_batch, linear_job["records"]):
        if result.row.kind != "uniform":
            continue
        n, ratio = len(result.prompt), result.row.options.get("compression_ratio", 0.5)
        evicted_blocks = (n - int(n * (1 - ratio))) // BLOCK_SIZE
        assert {len(heads) for heads in result.kept[next(iter(FULL))]} == {n - evicted_blocks * BLOCK_SIZE}
        assert (record["blocks_freed"], record["blocks_before"]) == (evicted_blocks, -(-n // BLOCK_SIZE)), (
            result.row.name
        )


@pytest.mark.background("linear-attention")
def test_answers_follow_transformers_keeping_the_same_full_attention_entries(linear_batch, linear_reference):
    """Every row (each schedule, uniform and head-wise, one uncompressed): every step is the bfloat16 reference's
    greedy token or a near-tie of it, at most one step in eight off; over the compressed rows, the reference keeping
    every entry disagrees with the engine at least three times as often."""
    off_kept = off_whole = 0
    report = {}
    for result in linear_batch:
        name, tokens = result.row.name, result.tokens
        assert len(tokens) == result.row.max_tokens, name
        kept = margins_along(tokens, *reference_of(result, linear_reference))
        whole = margins_along(tokens, greedy_after_eviction, linear_reference, result.prompt, None)
        off = [round(margin, 4) for margin in kept if margin > 0]
        report[name] = (off, sum(margin > 0 for margin in whole))
        assert max(kept) <= NEAR_TIE and len(off) <= max(1, len(tokens) // 8), (name, off)
        if result.row.kind != "uncompressed":
            off_kept, off_whole = off_kept + len(off), off_whole + report[name][1]
        if result.row.kind in ("chunked", "decoding"):
            assert len(result.stages) > 1 and all(set(stage["kept"]) == FULL for stage in result.stages), name
    print("steps off the reference keeping the engine's entries, and off the whole cache's:", report)
    assert off_whole >= 3 * max(off_kept, 1), report


@pytest.mark.background("linear-attention")
def test_the_kept_entries_are_the_press_selection(linear_batch, linear_reference):
    """The uniform and head-wise rows kept what the press selects on transformers' bfloat16 prefill (the plugin's rule
    on the reference's queries, keys and values): the same entries but for bfloat16 near-ties. Not the knorm row:
    Qwen3-Next normalises its keys (an RMSNorm per head), so their norms, knorm's scores, are equal within 0.2 % and
    the order bfloat16's rounding gives them is all that ranks them."""
    agreement = {}
    for result in linear_batch:
        if result.row.kind in ("uniform", "head_wise") and result.row.press != "knorm":
            expected = press_selection(linear_reference, result.prompt, result.kept, result.row.options)
            agreement[result.row.name] = same_entries(result.kept, expected)
    print("kept entries shared with the press's selection on transformers' prefill:", agreement)
    assert all(value >= 0.95 for value in agreement.values()), agreement
