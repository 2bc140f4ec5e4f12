"""Real memory: the evicted blocks go back to vLLM's pool at once, and the scheduler fills them with more requests."""

import pytest
from conftest import BLOCK_SIZE, make_llm, run_to_end, scheduler_of

pytestmark = pytest.mark.slow


def real_blocks(scheduler, request_id: str) -> list:
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return [block for block in manager.req_to_blocks[request_id] if not block.is_null]


def test_blocks_are_freed_as_computed(engine, prompt_ids):
    from vllm import SamplingParams

    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    free = pool.get_num_free_blocks()
    prompt = prompt_ids[:777]  # budget int(777 * 0.5) = 388: 12 whole blocks (384 positions) evicted, 393 kept
    engine.llm_engine.add_request("blocks", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
    # the prompt in one step (25 blocks), compacted after the forward pass; the workers' report frees the 12 blocks
    # of positions 0..383 before the step ends
    engine.llm_engine.step()
    (request_id,) = [rid for rid in scheduler.requests if rid.startswith("blocks-")]
    blocks = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[request_id]
    assert [block.is_null for block in blocks] == [True] * 12 + [False] * 13
    assert free - pool.get_num_free_blocks() == 13
    record = scheduler.kvpress_records[request_id]
    assert (record.prompt_tokens, record.kept_per_head, record.blocks_freed, record.blocks_before) == (777, 393, 12, 25)
    while engine.llm_engine.has_unfinished_requests():
        engine.llm_engine.step()
    assert pool.get_num_free_blocks() == free  # everything back, the null placeholders included


def test_a_pool_holds_more_requests_at_once():
    """96 blocks, 20 requests of 512 prompt tokens (16 blocks) and 32 new ones: peak concurrency per ratio."""
    from conftest import REPO, model_path
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    token_bytes = 30 * 2 * 3 * 64 * 4  # SmolLM2's K and V per token in float32
    llm = make_llm(
        {"press": "critical_snapkv", "compression_ratio": 0.0},
        kv_cache_memory_bytes=97 * BLOCK_SIZE * token_bytes,
        max_model_len=1024,
    )
    scheduler = scheduler_of(llm)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 96
    ids = AutoTokenizer.from_pretrained(model_path())((REPO / "LICENSE").read_text())["input_ids"]
    peaks = {}
    for ratio in (0.0, 0.75):
        params = SamplingParams(
            max_tokens=32, ignore_eos=True, extra_args={"kvpress_critical": {"compression_ratio": ratio}}
        )
        for i in range(20):
            llm.llm_engine.add_request(f"{ratio}-{i}", {"prompt_token_ids": ids[11 * i : 11 * i + 512]}, params)
        _, peak = run_to_end(llm)
        peaks[ratio] = peak
    print("peak requests at once:", peaks)
    # ideally 1 / (1 - r) = 4x; the 32 new tokens are not compressed and the next prompt is admitted whole
    assert peaks[0.75] >= 0.65 * peaks[0.0] / (1 - 0.75), peaks
