"""Real memory: the evicted blocks go back to vLLM's pool at once, and the scheduler fills them with more requests."""

import pytest
from conftest import scheduler_of, serve


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


@pytest.mark.slow
def test_a_pool_holds_more_requests_at_once_with_uniform_and_head_wise_presses(small_pool_engine, prompt_ids):
    """64 blocks, 20 requests of 256 prompt tokens (8 blocks) and 16 new ones: peak concurrency uncompressed, with a
    uniform press and with a head-wise one at ratio 0.75 (which frees the same blocks)."""
    from vllm import SamplingParams

    scheduler = scheduler_of(small_pool_engine)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64
    peaks = {}
    for press, ratio in (("critical_snapkv", 0.0), ("critical_snapkv", 0.75), ("critical_adakv_snapkv", 0.75)):
        options = {"press": press, "compression_ratio": ratio}
        params = SamplingParams(max_tokens=16, ignore_eos=True, extra_args={"kvpress_critical": options})
        requests = {f"more-{press}-{ratio}-{i}": (prompt_ids[29 * i : 29 * i + 256], params) for i in range(20)}
        peaks[press, ratio] = serve(small_pool_engine, requests).peak
    print("peak requests at once:", peaks)
    uncompressed, uniform, head_wise = peaks.values()
    # a compressed request holds its 64 kept entries (2 blocks) and a block of new tokens; the next one is admitted
    # when its whole prompt (8 blocks) is free: 1 + (64 - 8) // 3 = 19 at once, against 64 // 8 uncompressed
    assert uncompressed <= 64 // 8 and uniform >= 1 + (64 - 8) // 3 - 1 and uniform >= 2 * uncompressed, peaks
    assert abs(head_wise - uniform) <= 1, peaks


def allocation_peak(events) -> int:
    """The most bytes held at once by the CPU allocations of profiled ``events`` (each op's own allocations and the
    frees, in time order): what a region of code added to memory at its worst."""
    held = peak = 0
    for event in sorted(events, key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("press", ["critical_snapkv", "critical_adakv_snapkv"])
def test_a_compactions_memory_peak_is_within_its_formula(engine, prompt_ids, monkeypatch, press):
    """The CPU allocations of a 1500-token request's compaction (every layer scored, selected and written), profiled
    while it runs: their peak is at most what ``compaction_peak_bytes`` reserves for the prompt, and not far below."""
    from kvpress_critical_vllm.presses import compaction_peak_bytes
    from kvpress_critical_vllm.worker_state import WorkerState
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    finish_step, peaks = WorkerState.finish_step, []

    def profiled(self, attention_layers):
        if not (self._plan is not None and self._plan.jobs):
            return finish_step(self, attention_layers)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            finish_step(self, attention_layers)
        peaks.append(allocation_peak(profiler.events()))

    monkeypatch.setattr(WorkerState, "finish_step", profiled)
    n = 1500
    params = SamplingParams(max_tokens=1, extra_args={"kvpress_critical": {"press": press}})
    served = serve(engine, {f"peak-{press}": (prompt_ids[:n], params)})
    assert served.records[f"peak-{press}"].prompt_tokens == n and len(peaks) == 1
    # SmolLM2: 30 layers, 3 KV heads in groups of 3, head size 64, float32; SnapKV's window of 64
    formula = compaction_peak_bytes(n, 3, 3, 64, 4, 64, 30, head_wise="adakv" in press)
    print(f"{press}: compaction peak {peaks[0] / 2**20:.2f} MiB, formula {formula / 2**20:.2f} MiB")
    assert 0.25 * formula <= peaks[0] <= formula
