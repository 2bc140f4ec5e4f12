"""Fail closed: the scheduler frees blocks only for compactions the workers confirm; a failure ends one request at
most, never the engine (nor stalls it: longer than the pool, a request that falls back to its whole cache and cannot
fit the pool ends with an error, and the requests behind it are admitted); a builder without the worker's state
refuses to build.

Failures are injected in the session's in-process engine (its worker runs in this process): a selection that raises
(the request must run uncompressed, with all its blocks, and answer as an uncompressed request does), and a write that
raises midway through a request's layers (that request alone ends with an error; the request beside it and the next
ones are answered as usual).
"""

import pytest
from conftest import scheduler_of, serve, worker_of


def run(llm, requests):
    """``{name: (finish_reason, tokens)}`` of ``[(name, prompt ids, SamplingParams)]`` run together to the end."""
    served = serve(llm, {name: (prompt, params) for name, prompt, params in requests})
    return {name: (served.finish[name], served.tokens[name]) for name in served.tokens}


def greedy(max_tokens, ratio=None):
    from vllm import SamplingParams

    extra = None if ratio is None else {"kvpress_critical": {"compression_ratio": ratio}}
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=extra)


@pytest.mark.parametrize("stage", ["layer_scores", "select"])  # the scores (read back, SnapKV's attention), the ranks
def test_a_failed_selection_leaves_the_request_whole_and_its_blocks_held(
    engine, prompt_ids, monkeypatch, caplog, stage
):
    import kvpress_critical_vllm.compaction as compaction

    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    prompt = prompt_ids[:777]
    expected = run(engine, [("whole", prompt, greedy(16, ratio=0.0))])["whole"]

    def failing(*args, **kwargs):
        raise RuntimeError("injected selection failure")

    monkeypatch.setattr(compaction, stage, failing)
    free = pool.get_num_free_blocks()
    engine.llm_engine.add_request("fails", {"prompt_token_ids": prompt}, greedy(16))
    engine.llm_engine.step()  # the prompt: 25 blocks; the selection fails, nothing is written or freed
    (request_id,) = [rid for rid in scheduler.requests if rid.startswith("fails-")]
    assert free - pool.get_num_free_blocks() == 25
    assert request_id not in scheduler.kvpress_records and scheduler.kvpress_tracked_requests == 0
    finished = {}
    while engine.llm_engine.has_unfinished_requests():
        for output in engine.llm_engine.step():
            if output.finished:
                finished[output.request_id] = (output.outputs[0].finish_reason, list(output.outputs[0].token_ids))
    assert finished["fails"] == expected  # an uncompressed request's answer
    assert pool.get_num_free_blocks() == free
    assert "stays uncompressed: its selection failed" in caplog.text
    monkeypatch.undo()
    again = serve(engine, {"again": (prompt, greedy(4))})
    assert again.finish["again"] == "length" and "again" in again.records  # the engine goes on, compressing


def test_a_compaction_broken_midway_ends_that_request_alone(engine, prompt_ids, monkeypatch):
    worker = worker_of(engine)
    layout = worker.kvpress_state.layout
    neighbour_prompt, victim_prompt = prompt_ids[1000:1400], prompt_ids[:777]
    expected = run(engine, [("neighbour", neighbour_prompt, greedy(24, ratio=0.0))])["neighbour"]
    writes = []
    write = layout.write

    def failing_write(*args, **kwargs):
        writes.append(1)
        if len(writes) == 7:  # the third layer of the victim's compaction (three KV heads a layer)
            raise RuntimeError("injected write failure")
        return write(*args, **kwargs)

    monkeypatch.setattr(layout, "write", failing_write)
    from vllm import SamplingParams

    engine.llm_engine.add_request("neighbour", {"prompt_token_ids": neighbour_prompt}, greedy(24, ratio=0.0))
    engine.llm_engine.step()  # the neighbour's prompt first: it decodes while the victim's compaction breaks
    engine.llm_engine.add_request("victim", {"prompt_token_ids": victim_prompt}, SamplingParams(max_tokens=16))
    finished = {}
    while engine.llm_engine.has_unfinished_requests():
        for output in engine.llm_engine.step():
            if output.finished:
                finished[output.request_id] = (output.outputs[0].finish_reason, list(output.outputs[0].token_ids))
    assert finished["victim"][0] == "error"
    assert finished["neighbour"] == expected
    monkeypatch.undo()
    assert run(engine, [("after", victim_prompt, greedy(4))])["after"][0] == "length"
    # workers learn which requests finished with the next step (as vLLM's runner does for its own request state)
    run(engine, [("probe", victim_prompt[:8], greedy(1, ratio=0.0))])
    assert scheduler_of(engine).kvpress_tracked_requests == 0 and worker.kvpress_state.tracked_requests == 0


def test_a_failed_head_wise_attention_ends_its_requests_alone(engine, prompt_ids, monkeypatch, caplog):
    """The head-wise kernel raises in the first step after a head-wise request's compaction: that request ends with an
    error (no token of the failed step returned), the uniform request beside it answers as it does alone, and the next
    head-wise request is served."""
    from vllm import SamplingParams

    import kvpress_critical.ops.paged_ragged_attention as paged

    def head_wise(max_tokens):
        options = {"kvpress_critical": {"press": "critical_adakv_snapkv"}}
        return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, extra_args=options)

    neighbour = prompt_ids[500:900]
    expected = run(engine, [("hw-neighbour", neighbour, greedy(12))])["hw-neighbour"]
    attention, calls = paged.paged_ragged_attention, []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected head-wise kernel failure")

    monkeypatch.setattr(paged, "paged_ragged_attention", failing)
    got = run(engine, [("hw-victim", prompt_ids[:450], head_wise(12)), ("hw-neighbour-again", neighbour, greedy(12))])
    assert calls, "the head-wise kernel was never called"
    # the prompt's step sampled its first token before the compaction; the first decoding step failed: no token of it
    assert got["hw-victim"][0] == "error" and len(got["hw-victim"][1]) == 1
    assert got["hw-neighbour-again"] == expected
    assert "the head-wise attention failed in layer" in caplog.text
    monkeypatch.setattr(paged, "paged_ragged_attention", attention)
    assert run(engine, [("hw-after", prompt_ids[:450], head_wise(4))])["hw-after"][0] == "length"


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["selection_raises", "no_report", "step_past_the_stop"])
def test_longer_than_the_pool_a_request_that_falls_back_ends_alone_and_the_others_are_served(
    bounded_engine, prompt_ids, monkeypatch, caplog, fault
):
    """The bounded engine (max_model_len 2048, a pool of 16 blocks, every request compacted after each 128-token chunk):
    a 560-token victim that falls back to its whole cache (its selection raises at its first compaction; the report
    of a step where it alone is compacted is lost; a step runs past its compaction at 512) could never fit the pool
    again (18 blocks with its 8 new tokens): it ends with an error, its blocks back, and two requests beside it are
    served as they are alone."""
    import kvpress_critical_vllm.scheduler as scheduler_module
    import kvpress_critical_vllm.worker as worker_module
    from kvpress_critical_vllm.compaction import Compactor

    others = {f"{fault}-other{i}": (prompt_ids[300 * i : 300 * i + 300], greedy(8)) for i in (1, 2)}
    expected = serve(bounded_engine, dict(others)).tokens
    others = {f"{name}-again": request for name, request in others.items()}
    victim = f"{fault}-victim"
    if fault == "selection_raises":
        select = Compactor.select

        def failing_select(self, job, scores):
            if job.directive.request_id.startswith(victim):
                raise RuntimeError("injected selection failure")
            return select(self, job, scores)

        monkeypatch.setattr(Compactor, "select", failing_select)
    elif fault == "no_report":
        with_report, dropped = worker_module.with_report, []

        def without_report(output, report):
            if not dropped and report.compacted and all(rid.startswith(victim) for rid in report.compacted):
                dropped.append(report)
                return output  # the report of a step that compacted the victim alone is lost
            return with_report(output, report)

        monkeypatch.setattr(worker_module, "with_report", without_report)
    else:
        next_end, plan_request, victims = scheduler_module.Tracked.next_end, None, []

        def no_stop_at_512(self, computed, limit):
            end = next_end(self, computed, limit)
            return None if end == 512 and any(self is tracked for tracked in victims) else end

        plan_request = scheduler_module.CompressingSchedulerMixin._plan_request

        def planned(self, request):
            plan_request(self, request)
            if request.request_id.startswith(victim):
                victims.append(self._kvpress[request.request_id])

        monkeypatch.setattr(scheduler_module.Tracked, "next_end", no_stop_at_512)
        monkeypatch.setattr(scheduler_module.CompressingSchedulerMixin, "_plan_request", planned)
    served = serve(bounded_engine, {victim: (prompt_ids[:560], greedy(8)), **others})
    assert served.finish[victim] == "error", (served.finish, caplog.text[-3000:])
    assert {name.removesuffix("-again"): served.tokens[name] for name in others} == expected
    assert all(served.finish[name] == "length" for name in others)
    assert f"request {served.ids[victim]} ends with an error" in caplog.text
    assert "(18 blocks) do not fit the KV pool's 16 blocks" in caplog.text
    if fault == "no_report":
        assert dropped, "no step compacted the victim alone"


def test_a_builder_without_the_worker_state_refuses(engine):
    from kvpress_critical_vllm.protocol import PluginStateError

    builder = worker_of(engine).model_runner.attn_groups[0][0].metadata_builders[0]
    state = builder.kvpress_state
    builder.kvpress_state = None
    try:
        with pytest.raises(PluginStateError, match="was not given the worker's state"):
            builder.build(0, None)
    finally:
        builder.kvpress_state = state
