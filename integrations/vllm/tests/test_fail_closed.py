"""Fail closed: the scheduler frees blocks only for compactions the workers confirm; a failure ends one request at
most, never the engine; a builder without the worker's state refuses to build.

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
    import kvpress_critical_vllm.worker_state as worker_state

    scheduler = scheduler_of(engine)
    pool = scheduler.kv_cache_manager.block_pool
    prompt = prompt_ids[:777]
    expected = run(engine, [("whole", prompt, greedy(16, ratio=0.0))])["whole"]

    def failing(*args, **kwargs):
        raise RuntimeError("injected selection failure")

    monkeypatch.setattr(worker_state, stage, failing)
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


def test_a_builder_without_the_worker_state_refuses(engine):
    from kvpress_critical_vllm.worker_state import PluginStateError

    builder = worker_of(engine).model_runner.attn_groups[0][0].metadata_builders[0]
    state = builder.kvpress_state
    builder.kvpress_state = None
    try:
        with pytest.raises(PluginStateError, match="was not given the worker's state"):
            builder.build(0, None)
    finally:
        builder.kvpress_state = state
