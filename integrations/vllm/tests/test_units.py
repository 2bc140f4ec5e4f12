"""The plugin's pieces without an engine: options, eviction arithmetic, the shifted view, reading the paged cache."""

import json
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from kvpress_critical_vllm.budget import (
    Schedule,
    blocks_held_at_most,
    check_hold,
    chunk_ends,
    eviction,
    hold_bound,
    schedule,
)
from kvpress_critical_vllm.layouts import LearnedBlockLayout, check_round_trip
from kvpress_critical_vllm.options import CompressionOptions, OptionsError, engine_options, resolve_options
from kvpress_critical_vllm.vllm_compat import shifted_view


@pytest.mark.parametrize("n_prompt", [33, 64, 65, 300, 777, 1024, 2047])
@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_eviction_frees_whole_blocks_and_keeps_at_least_the_budget(n_prompt, ratio, block_size):
    options = CompressionOptions(press="critical_knorm", compression_ratio=ratio)
    plan = eviction(options, n_prompt, block_size)
    assert plan.budget == max(1, int(n_prompt * (1 - ratio)))
    assert plan.evicted % block_size == 0
    assert plan.budget <= plan.kept < plan.budget + block_size
    assert plan.blocks_freed == plan.evicted // block_size


def test_eviction_is_inactive_when_nothing_can_be_freed():
    snapkv = CompressionOptions(press="snapkv", compression_ratio=0.9, window_size=64)
    assert not eviction(snapkv, 64, 16).active  # the whole prompt is SnapKV's window
    assert eviction(snapkv, 65, 16).active
    assert not eviction(CompressionOptions(compression_ratio=0.0), 4096, 16).active
    assert not eviction(CompressionOptions(compression_ratio=0.2), 100, 32).active  # 20 entries: no whole block


@pytest.mark.parametrize("n_prompt", [300, 777, 1100, 2047, 5000])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("compression_chunk_size", [65, 128, 256, 1000])
@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_schedule_bounds_what_a_request_holds(n_prompt, ratio, compression_chunk_size, block_size):
    options = CompressionOptions(
        press="critical_snapkv", compression_ratio=ratio, compression_chunk_size=compression_chunk_size
    )
    stages, reason = schedule(options, n_prompt, block_size)
    one_shot = eviction(options, n_prompt, block_size)
    ends = chunk_ends(options, n_prompt)
    assert ends[-1] == n_prompt and all(b - a > options.window_size for a, b in zip([0] + ends, ends))
    assert all(b - a == compression_chunk_size for a, b in zip([0] + ends[:-2], ends[:-1]))  # every chunk but the last
    if not one_shot.active:
        assert stages == () and reason
        return
    assert reason == "" and stages[-1].seen in ends
    # in the end as many positions evicted as one compaction of the whole prompt evicts (a last chunk that frees no
    # block is not compacted: the chunks before evicted them already)
    assert stages[-1].evicted == one_shot.evicted
    start = 0
    for i, stage in enumerate(stages):
        assert (stage.start, stage.index, stage.count) == (start, i + 1, len(stages))
        assert stage.seen in ends and stage.evicted % block_size == 0 and stage.evicted > stage.start
        assert stage.budget == max(1, int(stage.seen * (1 - ratio)))
        assert stage.budget <= stage.kept < stage.budget + block_size
        start = stage.evicted
    # what a request holds while a chunk runs: what the compactions before left, and the chunk
    held, previous = [], (0, 0)
    for end in ends:
        held.append(end - previous[1])
        done = [s for s in stages if s.seen == end]
        if done:
            previous = (end, done[0].evicted)
    for end, entries in zip(ends, held):
        before = max((s for s in stages if s.seen < end), key=lambda s: s.seen, default=None)
        bound = (before.kept if before else 0) + (end - (before.seen if before else 0))
        assert entries == bound
        if before is not None:
            assert entries < before.budget + block_size + (end - before.seen)


def test_chunked_schedule_merges_a_last_chunk_shorter_than_the_window():
    options = CompressionOptions(press="snapkv", compression_ratio=0.5, compression_chunk_size=256, window_size=64)
    assert chunk_ends(options, 256 * 3 + 64) == [256, 512, 832]
    assert chunk_ends(options, 256 * 3 + 65) == [256, 512, 768, 833]
    assert chunk_ends(options, 200) == [200]
    assert chunk_ends(CompressionOptions(press="knorm", compression_ratio=0.5, compression_chunk_size=100), 250) == [
        100,
        200,
        250,
    ]
    # a chunk that frees no whole block is not compacted: the next one scores what it held
    stages, _ = schedule(CompressionOptions(press="knorm", compression_ratio=0.1, compression_chunk_size=100), 1000, 32)
    assert [s.seen for s in stages] == [400, 700, 1000]
    assert [s.evicted for s in stages] == [32, 64, 96]


def test_chunk_size_is_checked():
    with pytest.raises(OptionsError, match="compression_chunk_size=64 is not allowed: more than window_size=64"):
        resolve_options(CompressionOptions(compression_ratio=0.5), {"kvpress_critical": {"compression_chunk_size": 64}})
    with pytest.raises(OptionsError, match="is not supported: the head-wise layout"):
        resolve_options(
            CompressionOptions(compression_ratio=0.5),
            {"kvpress_critical": {"press": "critical_adakv_snapkv", "compression_chunk_size": 512}},
        )
    for bad in (-1, 1.5, True, "512", 2**30):
        with pytest.raises(OptionsError, match="compression_chunk_size"):
            engine_options({"kvpress_critical": {"compression_ratio": 0.5, "compression_chunk_size": bad}})
    knorm = resolve_options(
        CompressionOptions(compression_ratio=0.5),
        {"kvpress_critical.press": "knorm", "kvpress_critical.compression_chunk_size": 8},
    )
    assert knorm.compression_chunk_size == 8  # no window to fill


def test_a_wrong_type_says_what_to_send():
    """Strict types (a JSON client may send 256.0 or true): refused, the message saying what was sent and the fix."""
    with pytest.raises(OptionsError, match=r"compression_chunk_size=256\.0 is not allowed \(a float: pass 256\)"):
        engine_options({"kvpress_critical": {"compression_ratio": 0.5, "compression_chunk_size": 256.0}})
    with pytest.raises(OptionsError, match=r"compression_ratio=True is not allowed \(a boolean, not a number\)"):
        engine_options({"kvpress_critical": {"compression_ratio": True}})
    # no hint: not integral
    with pytest.raises(OptionsError, match=r"compression_chunk_size=1\.5 is not allowed: an integer"):
        engine_options({"kvpress_critical": {"compression_ratio": 0.5, "compression_chunk_size": 1.5}})


@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize("compression_chunk_size", [0, 256])
@pytest.mark.parametrize("interval, target", [(65, 100), (128, 512), (300, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decoding_schedule_holds_a_generation_to_its_target(
    ratio, compression_chunk_size, interval, target, block_size
):
    options = CompressionOptions(
        press="critical_snapkv", compression_ratio=ratio, compression_chunk_size=compression_chunk_size,
        compression_interval=interval, target_size=target,
    )  # fmt: skip
    n_prompt, n_tokens = 700, 700 + 4000
    plan = Schedule(options, n_prompt, block_size)
    prompt = list(schedule(options, n_prompt, block_size)[0])
    stages = plan.upto(n_tokens)
    assert stages[: len(prompt)] == prompt
    decoding = stages[len(prompt) :]
    assert decoding and all(s.phase == "decoding" for s in decoding)
    start = prompt[-1].evicted if prompt else 0
    for i, stage in enumerate(decoding):
        # kvpress's DecodingPress: after every `interval` generated tokens, back to target_size (here in whole blocks)
        assert (stage.seen - n_prompt) % interval == 0 and stage.start == start and stage.index == i + 1
        assert stage.evicted % block_size == 0 and stage.evicted > stage.start
        assert target <= stage.kept < target + block_size
        start = stage.evicted
    # an interval that frees no whole block is not compacted: the held entries then stay below target + one block
    points = range(n_prompt + interval, n_tokens + 1, interval)
    compacted = {s.seen for s in decoding}
    held = prompt[-1].kept if prompt else n_prompt
    for point in points:
        held += interval
        if point in compacted:
            held = next(s.kept for s in decoding if s.seen == point)
        else:
            assert held - target < block_size
    # after its first compaction while decoding, a generation of 4000 tokens never holds more than target_size, one
    # interval and one block per head (in blocks: one more where they straddle a block boundary)
    bound = -(-(target + block_size - 1 + interval) // block_size) + 1
    ends = [s.seen for s in decoding[1:]] + [n_tokens]
    for stage, end in zip(decoding, ends):
        assert -(-end // block_size) - stage.evicted // block_size <= bound
    first = decoding[0]
    assert blocks_held_at_most(tuple(stages), n_tokens, block_size) == max(
        blocks_held_at_most(tuple(stages[: len(prompt) + 1]), first.seen, block_size),
        max(-(-end // block_size) - stage.evicted // block_size for stage, end in zip(decoding, ends)),
    )
    # listed lazily, and the same however far it is asked
    assert Schedule(options, n_prompt, block_size).upto(n_tokens) == stages
    assert plan.after(n_tokens, n_tokens + 10 * interval) is not None and plan.stage(len(stages), n_tokens) is None


@pytest.mark.parametrize("ratio, compression_chunk_size, interval, target, min_kept", [
    (0.5, 256, 128, 256, 0), (0.75, 512, 65, 100, 0), (0.9, 128, 300, 64, 0), (0.25, 1000, 128, 512, 0),
    (0.9, 256, 128, 128, 256), (0.75, 128, 65, 300, 200),
])  # fmt: skip
@pytest.mark.parametrize("press", ["critical_snapkv", "knorm"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_hold_bound_holds_every_request_whatever_its_prompt(
    ratio, compression_chunk_size, interval, target, min_kept, press, block_size
):
    """What a request holds at most over its life (every chunk, every decoding interval, up to max_len tokens) for
    prompts of every length: never over hold_bound, which is at most the next allocation's margin over it."""
    max_len = 6000
    options = CompressionOptions(
        press=press, compression_ratio=ratio, compression_chunk_size=compression_chunk_size,
        compression_interval=interval, target_size=target, min_kept=min_kept,
    )  # fmt: skip
    bound = hold_bound(options, max_len, block_size)
    assert bound is not None and bound < -(-max_len // block_size)
    peaks = [
        blocks_held_at_most(tuple(Schedule(options, n_prompt, block_size).upto(max_len)), max_len, block_size)
        for n_prompt in range(block_size + 40, max_len, 97)
    ]
    margin = -(-(compression_chunk_size + (options.window_size if options.needs_queries else 0)) // block_size) + 1
    assert max(peaks) <= bound - margin
    # not looser than where a prompt's chunks fall (the worst case is a chunk ending near max_len) and the rounding
    assert bound - margin - max(peaks) <= margin + 1, (bound - margin, max(peaks))


@pytest.mark.parametrize("compression_chunk_size", [0, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_min_kept_leaves_short_prompts_whole_and_floors_every_compaction(compression_chunk_size, block_size):
    """``min_kept``: a prompt of at most ``min_kept`` tokens is not compacted (with its reason); a longer one keeps
    ``max(min_kept, int(N * (1 - ratio)))`` entries per head, in whole blocks, chunked or not; decoding goes back to
    ``max(target_size, min_kept)``; without it, nothing changes."""
    min_kept, ratio = 256, 0.9
    options = CompressionOptions(
        compression_ratio=ratio, window_size=32, compression_chunk_size=compression_chunk_size,
        compression_interval=64, target_size=96, min_kept=min_kept,
    )  # fmt: skip
    for n_prompt in (100, 216, 256):
        stages, reason = schedule(options, n_prompt, block_size)
        assert stages == () and f"not longer than min_kept ({min_kept})" in reason
        # the same prompt is compressed at the ratio alone
        assert schedule(replace(options, min_kept=0), n_prompt, block_size)[0]
    for n_prompt in (300, 777, 2600, 5000):
        budget = max(min_kept, int(n_prompt * (1 - ratio)))
        last = schedule(options, n_prompt, block_size)[0][-1]
        assert last.seen == n_prompt and last.budget == budget and budget <= last.kept < budget + block_size
        assert all(stage.kept >= min(min_kept, stage.seen) for stage in schedule(options, n_prompt, block_size)[0])
        decoding = [s for s in Schedule(options, n_prompt, block_size).upto(n_prompt + 2000) if s.phase == "decoding"]
        assert decoding and all(s.budget == min_kept and min_kept <= s.kept < min_kept + block_size for s in decoding)
    assert eviction(replace(options, min_kept=0), 2600, block_size).budget == int(2600 * (1 - ratio))


def test_hold_bound_needs_every_schedule():
    bounded = dict(compression_ratio=0.5, compression_chunk_size=256, compression_interval=128, target_size=256)
    assert hold_bound(CompressionOptions(**bounded), 8192, 32) is not None
    for unset in (
        {"compression_ratio": 0.0},
        {"compression_chunk_size": 0},
        {"compression_interval": 0, "target_size": 0},
    ):
        assert hold_bound(CompressionOptions(**{**bounded, **unset}), 8192, 32) is None
    assert hold_bound(CompressionOptions(**bounded), 700, 32) is None  # not less than the whole request


def test_a_request_that_could_outgrow_a_small_pool_is_refused():
    options = CompressionOptions(
        compression_ratio=0.9, compression_chunk_size=256, compression_interval=128, target_size=256, window_size=32
    )
    bound = hold_bound(options, 3072, 32)
    check_hold(options, 3072, 32, bound, "here")  # fits
    half = hold_bound(replace(options, compression_ratio=0.5), 3072, 32)
    # a whole request fits: nothing to bound
    check_hold(replace(options, compression_chunk_size=0), 1024, 32, 32, "here")
    cases = [
        (replace(options, compression_chunk_size=0), "compression_chunk_size", "its whole 3072 tokens (96 blocks)"),
        (replace(options, compression_interval=0, target_size=0), "compression_interval", "its whole 3072"),
        (replace(options, compression_ratio=0.0), "compression_ratio", "its whole 3072"),
        (replace(options, compression_ratio=0.5), "compression_ratio", f"up to {half} blocks"),
        (replace(options, target_size=900), "target_size", "up to"),
        (replace(options, min_kept=1000), "min_kept", "up to"),
        (replace(options, compression_chunk_size=1024), "compression_chunk_size", "up to"),
    ]
    for changed, option, held in cases:
        with pytest.raises(OptionsError, match=re.escape(held)) as error:
            check_hold(changed, 3072, 32, bound, "here")
        assert error.value.option == option, (changed, error.value.option)
        assert f"more than the KV pool's {bound} blocks" in str(error.value)


def test_decoding_options_are_checked():
    engine = CompressionOptions(compression_ratio=0.5)
    both = resolve_options(engine, {"kvpress_critical": {"compression_interval": 128, "target_size": 256}})
    assert both.decoding and both.compresses
    alone = resolve_options(
        CompressionOptions(), {"kvpress_critical": {"compression_interval": 128, "target_size": 64}}
    )
    assert alone.compression_ratio == 0 and alone.compresses
    cases = [
        ({"compression_interval": 128}, "needs both compression_interval and target_size; target_size is not set"),
        ({"target_size": 128}, "compression_interval is not set"),
        ({"compression_interval": 64, "target_size": 128}, "compression_interval=64 is not allowed: more than window"),
        ({"press": "streaming_llm", "compression_interval": 8, "target_size": 4}, "target_size=4 is not allowed"),
        ({"press": "critical_adakv_snapkv", "compression_interval": 128, "target_size": 256}, "head-wise layout"),
        ({"compression_interval": -1, "target_size": 1}, "compression_interval=-1 is not allowed"),
        ({"compression_interval": 100, "target_size": 2.5}, "target_size=2.5 is not allowed"),
        ({"min_kept": -1}, "min_kept=-1 is not allowed"),
        ({"min_kept": True}, "min_kept=True is not allowed"),
    ]
    for overrides, message in cases:
        with pytest.raises(OptionsError, match=re.escape(message)):
            resolve_options(engine, {"kvpress_critical": overrides})
    knorm = resolve_options(
        engine, {"kvpress_critical": {"press": "knorm", "compression_interval": 1, "target_size": 8}}
    )
    assert knorm.compression_interval == 1  # no window to fill


def test_requests_override_engine_options_nested_and_flat():
    engine = engine_options({"kvpress_critical": {"press": "snapkv", "compression_ratio": 0.5}})
    assert resolve_options(engine, None) is engine
    nested = resolve_options(engine, {"kvpress_critical": {"compression_ratio": 0.75, "press": "critical_knorm"}})
    assert (nested.press, nested.compression_ratio, nested.window_size) == ("critical_knorm", 0.75, 64)
    flat = resolve_options(engine, {"kvpress_critical.compression_ratio": 0.0, "unrelated": 1})
    assert flat.compression_ratio == 0.0 and flat.press == "snapkv"
    with pytest.raises(OptionsError, match="unknown option"):
        resolve_options(engine, {"kvpress_critical.ratio": 0.5})
    # the renamed options are refused with their new names, not read and not called unknown
    with pytest.raises(OptionsError, match="chunk_size is now compression_chunk_size") as refused:
        resolve_options(engine, {"kvpress_critical": {"chunk_size": 128}})
    assert refused.value.option == "chunk_size"
    with pytest.raises(OptionsError, match="attention_backend is now head_wise_kernel"):
        engine_options({"kvpress_critical": {"compression_ratio": 0.5, "attention_backend": "cpp"}})
    assert engine_options({"other_plugin": {}}) is None


def _metadata(seq_lens, table, upper=None):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    rows = len(seq_lens)
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=rows,
        num_actual_tokens=rows,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor(upper or seq_lens, dtype=torch.int32),
    )


def test_shifted_view_starts_each_row_after_its_evicted_blocks():
    table = [[1, 2, 3, 4, 0], [5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [0, 0, 0, 0, 0]]  # the last row pads
    cm = _metadata([100, 150, 70, 0], table)
    view = shifted_view(cm, torch.tensor([0, 64, 32]), block_size=32)
    assert view.seq_lens.tolist() == [100, 86, 38, 0]
    assert view.seq_lens_cpu_upper_bound.tolist() == [100, 86, 38, 0]
    assert view.max_seq_len == 100
    assert view.block_table_tensor[:3, :3].tolist() == [[1, 2, 3], [7, 8, 9], [11, 12, 0]]
    assert cm.seq_lens.tolist() == [100, 150, 70, 0]  # the runner's own metadata is left as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("block_size,head_size,num_kv_heads", [(32, 64, 3), (64, 128, 2), (32, 32, 1)])
def test_the_learned_layout_reads_what_cpu_attention_writes(
    monkeypatch, dtype, isa, block_size, head_size, num_kv_heads
):
    from conftest import cpu_attention_impl

    impl = cpu_attention_impl(monkeypatch, dtype, "auto", num_kv_heads, head_size)
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    kv_cache = torch.zeros(6, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    layout = LearnedBlockLayout.probe(impl, layer, kv_cache)
    check_round_trip(impl, layer, kv_cache, layout)  # random entries in two scratch blocks, read back exactly
    slots = torch.randperm(6 * block_size, generator=torch.Generator().manual_seed(1))[:100]
    keys = torch.randn(100, num_kv_heads, head_size).to(dtype)
    values = torch.randn(100, num_kv_heads, head_size).to(dtype)
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    got_keys, got_values = layout.read(kv_cache, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


# ---------------------------------------------------------------------------------------- the workers' step plan
def _worker_state(req_ids, computed):
    import numpy as np
    from kvpress_critical_vllm.worker_state import WorkerState

    batch = SimpleNamespace(
        num_reqs=len(req_ids), req_ids=list(req_ids), num_computed_tokens_cpu=np.array(computed, dtype=np.int32)
    )
    config = SimpleNamespace(additional_config={"kvpress_critical": {"compression_ratio": 0.5}})
    state = WorkerState(config, SimpleNamespace(input_batch=batch))
    state.block_size = 32
    return state


def _step(state, compact=(), save=()):
    from kvpress_critical_vllm.protocol import DIRECTIVES_ATTRIBUTE, Compact, StepDirectives

    options = CompressionOptions(compression_ratio=0.5)
    directives = StepDirectives(
        compact={rid: Compact(rid, options, eviction(options, n, bs)) for rid, n, bs in compact},
        save_queries={rid: 64 for rid in save},
    )
    output = SimpleNamespace(
        finished_req_ids=set(), scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set())
    )
    setattr(output, DIRECTIVES_ATTRIBUTE, directives)
    state.begin_step(output)


def test_the_step_plan_follows_the_directives_and_the_shifts():
    state = _worker_state(["a", "b", "c"], [0, 300, 100])
    state.shifts["b"] = 128
    _step(state, compact=[("a", 400, 32)], save=["c"])
    cm = _metadata([400, 301, 200], [[1] * 13, [2] * 13, [3] * 13])
    cm = cm.replace(query_start_loc_cpu=torch.tensor([0, 400, 401, 501], dtype=torch.int32), num_reqs=3)
    plan = state.plan_step(cm, 32)
    assert plan.shift.tolist() == [0, 128, 0]
    assert [(job.directive.request_id, job.query_start, job.query_end) for job in plan.jobs] == [("a", 0, 400)]
    assert [(save.request_id, save.query_start, save.query_end) for save in plan.saves] == [("c", 401, 501)]
    assert state.plan_step(cm, 32) is plan  # once per step, whatever the number of builders


@pytest.mark.parametrize(
    "case,message",
    [
        ("fewer rows", "covers 1 of the batch's 2 requests"),
        ("other block size", "block size 16"),
        ("directive off the prompt's end", "to be compacted after its 500-token prompt"),
        ("directive for a request not in the batch", "not in this step's batch"),
    ],
)
def test_the_step_plan_refuses_any_disagreement(case, message):
    from kvpress_critical_vllm.protocol import PluginStateError

    state = _worker_state(["a", "b"], [0, 0])
    compact = {
        "directive off the prompt's end": [("a", 500, 32)],
        "directive for a request not in the batch": [("z", 400, 32)],
    }
    _step(state, compact=compact.get(case, [("a", 400, 32)]))
    cm = _metadata([400, 10], [[1] * 13, [2] * 13])
    cm = cm.replace(query_start_loc_cpu=torch.tensor([0, 400, 410], dtype=torch.int32), num_reqs=2)
    if case == "fewer rows":
        cm = cm.replace(num_reqs=1)
    with pytest.raises(PluginStateError, match=message):
        state.plan_step(cm, 16 if case == "other block size" else 32)


def test_a_worker_forgets_finished_and_resumed_requests():
    from kvpress_critical_vllm.protocol import StepDirectives

    state = _worker_state(["a"], [0])
    state.shifts.update(a=64, b=32, c=96)
    state.queries["d"] = {}
    output = SimpleNamespace(
        finished_req_ids={"b"}, scheduled_new_reqs=[SimpleNamespace(req_id="d")],
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids={"c"}), kvpress_critical_directives=StepDirectives(),
    )  # fmt: skip
    state.begin_step(output)
    assert state.shifts == {"a": 64} and state.tracked_requests == 1


# --------------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    "overrides,option,allowed",
    [
        ({"compression_ratio": "0.5"}, "compression_ratio", "[0, 1)"),
        ({"compression_ratio": float("nan")}, "compression_ratio", "[0, 1)"),
        ({"compression_ratio": True}, "compression_ratio", "[0, 1)"),
        ({"window_size": 300}, "window_size", "[1, 256]"),
        ({"kernel_size": 33}, "kernel_size", "[1, 31]"),
        ({"backend": "cpp"}, "backend", "whole engine"),
        ({"max_window_size": 4096}, "max_window_size", "whole engine"),
        ({"press": "adakv_knorm"}, "press", "N mod block_size"),
    ],
)
def test_a_request_is_held_to_the_engines_bounds(overrides, option, allowed):
    engine = engine_options({"kvpress_critical": {"compression_ratio": 0.5}})
    with pytest.raises(OptionsError, match=re.escape(allowed)) as raised:
        resolve_options(engine, {"kvpress_critical": overrides})
    assert raised.value.option == option


def test_an_engine_may_widen_the_bounds_up_to_the_limits():
    engine = engine_options({"kvpress_critical": {"compression_ratio": 0.5, "max_window_size": 1024}})
    assert resolve_options(engine, {"kvpress_critical.window_size": 1000}).window_size == 1000
    with pytest.raises(OptionsError, match=r"max_window_size=5000 is not allowed: an integer in \[1, 4096\]"):
        engine_options({"kvpress_critical": {"compression_ratio": 0.5, "max_window_size": 5000}})


# ---------------------------------------------------------------------------------------------------- metrics
def test_the_metrics_collector_sums_engines_and_drops_dead_gauges(tmp_path, monkeypatch):
    import os

    from kvpress_critical_vllm.metrics import METRICS_DIR_ENV, MetricsWriter, PluginCollector

    monkeypatch.setenv(METRICS_DIR_ENV, str(tmp_path))
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="m"))
    writers = [MetricsWriter(config), MetricsWriter(config)]
    writers[0].compressed(prompt_tokens=100, entries_kept=90, blocks_freed=2)
    writers[1].compressed(prompt_tokens=50, entries_kept=30, blocks_freed=1)
    writers[1].uncompressed("short_prompt")
    writers[1].unhashed(4)
    writers[0].tracked(3, 2)
    for writer in writers:
        writer.flush(force=True)
    families = {family.name: family for family in PluginCollector(str(tmp_path)).collect()}
    value = {name: sum(sample.value for sample in family.samples) for name, family in families.items()}
    assert value["vllm:kvpress_critical_requests_compressed"] == 2
    assert value["vllm:kvpress_critical_blocks_freed"] == 3
    assert value["vllm:kvpress_critical_requests_uncompressed"] == 1
    assert value["vllm:kvpress_critical_blocks_unhashed"] == 4
    assert value["vllm:kvpress_critical_scheduler_tracked_requests"] == 3
    dead = json.loads(writers[0].path.read_text())
    dead["pid"] = 2**22 + 12345  # no such process: its gauges no longer count, its counters do
    writers[0].path.write_text(json.dumps(dead))
    families = {family.name: family for family in PluginCollector(str(tmp_path)).collect()}
    assert sum(s.value for s in families["vllm:kvpress_critical_scheduler_tracked_requests"].samples) == 0
    assert sum(s.value for s in families["vllm:kvpress_critical_requests_compressed"].samples) == 2
    assert os.getpid() == json.loads(writers[1].path.read_text())["pid"]


# ------------------------------------------------------------------------------------------- chunked selection
@pytest.mark.parametrize(
    "press",
    ["critical_snapkv", "snapkv", "critical_knorm", "critical_streaming_llm", "critical_adakv_snapkv", "adakv_snapkv"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scoring_a_few_kv_heads_at_a_time_keeps_the_same_entries(press, dtype):
    from kvpress_critical_vllm.presses import keep_mask

    generator = torch.Generator().manual_seed(0)
    n_prompt, num_kv_heads, group, head_size = 700, 4, 3, 32
    keys = torch.randn(n_prompt, num_kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(n_prompt, num_kv_heads, head_size, generator=generator).to(dtype)
    queries = torch.randn(64, num_kv_heads * group, head_size, generator=generator).to(dtype)
    o_proj = torch.randn(96, num_kv_heads * group * head_size, generator=generator).to(dtype)
    options = CompressionOptions(press=press, compression_ratio=0.5)

    def read(first, end):
        return keys[:, first:end], values[:, first:end]

    whole = keep_mask(options, read, num_kv_heads, 350, queries=queries, o_proj_weight=o_proj)
    counts = whole.sum(dim=1)
    assert int(counts.sum()) == 350 * num_kv_heads
    assert (len(set(counts.tolist())) > 1) == options.head_wise  # AdaKV's budgets differ across heads
    for chunk in (1, 3):
        assert torch.equal(keep_mask(options, read, num_kv_heads, 350, queries, o_proj, chunk=chunk), whole)


def test_the_compaction_memory_formula_bounds_a_chunk():
    from kvpress_critical_vllm.presses import CHUNK_BYTES, compaction_bytes, compaction_peak_bytes, heads_per_chunk

    options = CompressionOptions(compression_ratio=0.5, window_size=64)
    # Llama-3.1-8B in bfloat16 (8 KV heads of 128, groups of 4) at 128K tokens: one KV head at a time
    assert heads_per_chunk(options, 131072, 8, 4, 128, 2) == 1
    assert heads_per_chunk(options, 4096, 8, 4, 128, 2) == 8  # a short prompt: every head at once
    one_head = compaction_bytes(131072, 1, 4, 128, 2, 64)
    assert one_head > CHUNK_BYTES and 400 * 2**20 < one_head < 600 * 2**20
    uniform = compaction_peak_bytes(131072, 8, 4, 128, 2, 64, 32, head_wise=False)
    assert one_head < uniform < one_head + 250 * 2**20
    head_wise = compaction_peak_bytes(131072, 8, 4, 128, 2, 64, 32, head_wise=True)
    assert head_wise - uniform == 2 * 131072 * 7 * 128 * 2  # the layer's kept entries, read before they move


# ------------------------------------------------------------------------------------------ head-wise regions
def _nhd_cache(num_blocks, num_kv_heads, block_size, head_size):
    """A ``[blocks, H_kv, block_size, 2 d]`` view whose memory is slot-major, as flash-attn's NHD layout stores it."""
    memory = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_size)
    return memory.transpose(1, 2)


def test_region_views_read_each_block_in_memory_order_whatever_its_logical_order():
    from kvpress_critical_vllm.layouts import block_memory, region_views

    for kv_cache in (torch.randn(5, 3, 16, 8), _nhd_cache(5, 3, 16, 4)):
        keys, values = region_views(kv_cache)
        assert keys.shape == values.shape == (5, 48, 4)
        keys[2].fill_(7.0)
        values[2].fill_(-7.0)
        memory = block_memory(kv_cache)
        assert torch.equal(memory[2, : 48 * 4], torch.full((192,), 7.0))
        assert torch.equal(memory[2, 48 * 4 :], torch.full((192,), -7.0))
        assert kv_cache[2].abs().eq(7.0).all() and not kv_cache[1].abs().eq(7.0).any()  # one block, in place
    with pytest.raises(ValueError, match="dense in memory"):
        region_views(torch.randn(5, 3, 32, 8)[:, :, :16])


def _head_wise_job(n_prompt, ratio, block_size, num_blocks):
    from kvpress_critical_vllm.protocol import Compact
    from kvpress_critical_vllm.step_plan import Job

    options = CompressionOptions(press="critical_adakv_snapkv", compression_ratio=ratio, window_size=block_size - 1)
    evict = eviction(options, n_prompt, block_size)
    block_ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    return Job(Compact("a", options, evict), row=0, query_start=0, query_end=n_prompt, block_ids=block_ids)


@pytest.mark.parametrize("n_prompt,ratio", [(178, 0.4), (111, 0.9)])  # a region of 3 blocks; E == B: none
def test_a_head_wise_write_packs_each_heads_entries_into_the_region(n_prompt, ratio):
    from kvpress_critical_vllm.compaction import Compactor
    from kvpress_critical_vllm.layouts import SplitLayout, region_views, split_flash_attn

    block_size, num_kv_heads, head_size = 16, 3, 4
    compactor = Compactor(SplitLayout(split_flash_attn, head_size), o_proj={})
    job = _head_wise_job(n_prompt, ratio, block_size, num_blocks=16)
    evict = job.directive.eviction
    boundary = n_prompt // block_size * block_size
    kv_cache = _nhd_cache(16, num_kv_heads, block_size, head_size)
    before = kv_cache.clone()
    # uneven per-head counts summing to the uniform budget, the prompt's last partial block kept by every head
    counts = [evict.kept - 10, evict.kept, evict.kept + 10] if evict.evicted < boundary else [evict.kept] * 3
    kept = torch.zeros(num_kv_heads, n_prompt, dtype=torch.bool)
    kept[:, boundary:] = True
    for head, count in enumerate(counts):
        kept[head, torch.randperm(boundary)[: count - (n_prompt - boundary)]] = True
    compactor.write(job, {"layer": kept}, {"layer": SimpleNamespace(kv_cache=kv_cache)})
    slots = compactor.slots(job)
    expected_keys, expected_values = [], []
    for head in range(num_kv_heads):
        positions = kept[head, :boundary].nonzero().flatten()
        keys, values = compactor.layout.read(before, slots[positions], slice(head, head + 1))
        expected_keys.append(keys[:, 0])
        expected_values.append(values[:, 0])
    region = job.block_ids[evict.evicted // block_size : boundary // block_size]
    region_keys, region_values = region_views(kv_cache)
    assert torch.equal(region_keys[region].reshape(-1, head_size), torch.cat(expected_keys))
    assert torch.equal(region_values[region].reshape(-1, head_size), torch.cat(expected_values))
    others = torch.ones(16, dtype=torch.bool)
    others[region] = False
    assert torch.equal(kv_cache[others], before[others])  # the tail's block and every other block untouched


def test_attention_the_plugin_does_not_carry_refuses():
    from kvpress_critical_vllm.engine_config import EngineConfigError
    from kvpress_critical_vllm.worker import check_attention_impl

    with pytest.raises(EngineConfigError, match="ALiBi"):
        check_attention_impl("model.layers.0.self_attn.attn", SimpleNamespace(alibi_slopes=torch.ones(2)))
    check_attention_impl("model.layers.0.self_attn.attn", SimpleNamespace(alibi_slopes=None, logits_soft_cap=0))


def test_soft_caps_and_sinks_are_served_and_reach_the_head_wise_attention():
    """A layer with a logits soft cap or attention sinks passes the check; the head-wise attention takes them from
    vLLM's implementation (a cap of 0 or None: none)."""
    from kvpress_critical_vllm.head_wise_attention import softmax_terms
    from kvpress_critical_vllm.worker import check_attention_impl

    sinks = torch.tensor([0.5, -1.0])
    capped = SimpleNamespace(alibi_slopes=None, logits_soft_cap=30.0, sinks=None)
    sinking = SimpleNamespace(alibi_slopes=None, logits_soft_cap=0, sinks=sinks)
    for impl in (capped, sinking):
        check_attention_impl("model.layers.0.self_attn.attn", impl)
    assert softmax_terms(capped) == {"soft_cap": 30.0}
    assert softmax_terms(sinking)["sinks"] is sinks and "soft_cap" not in softmax_terms(sinking)
    assert softmax_terms(SimpleNamespace(logits_soft_cap=None, sinks=None)) == {}


def test_a_request_is_checked_against_its_engines_options_not_the_defaults():
    """Before the engine is known (SamplingParams), only each override's own range is checked: a decoding interval
    of 40 is valid on an engine whose window is 32 (the default window, 64, would refuse it); the engine's input
    processor then checks how the overrides go with the engine's own options."""
    from kvpress_critical_vllm.options import validate_request_overrides

    request = {"kvpress_critical": {"compression_interval": 40, "target_size": 64}}
    validate_request_overrides(request)
    narrow = CompressionOptions(compression_ratio=0.5, window_size=32)
    assert resolve_options(narrow, request).compression_interval == 40
    with pytest.raises(OptionsError, match="compression_interval=40 is not allowed: more than window_size=64"):
        resolve_options(CompressionOptions(compression_ratio=0.5), request)
    with pytest.raises(OptionsError, match="compression_chunk_size=-1"):  # a range is still checked before the engine
        validate_request_overrides({"kvpress_critical": {"compression_chunk_size": -1}})


def test_a_misspelt_prefix_is_warned_once_and_a_long_bad_value_is_not_echoed_whole(caplog):
    from kvpress_critical_vllm import options as module

    module._WARNED.discard("kvpress_critcal.compression_ratio")
    with caplog.at_level("WARNING", logger=module.__name__):
        for _ in range(3):  # one warning, not one per request
            assert module.request_overrides({"kvpress_critcal.compression_ratio": 0.5, "seed": 1}) == {}
    warned = [r.getMessage() for r in caplog.records if "kvpress_critcal" in r.getMessage()]
    assert len(warned) == 1 and "ignored" in warned[0], caplog.text
    assert not any("seed" in r.getMessage() for r in caplog.records)
    with pytest.raises(OptionsError) as error:
        module.validate_request_overrides({"kvpress_critical": {"press": "x" * 100_000}})
    assert len(str(error.value)) < 1000 and "100002 characters" in str(error.value)
    with pytest.raises(OptionsError) as error:
        module.validate_request_overrides({"kvpress_critical": {"y" * 100_000: 1}})
    assert len(str(error.value)) < 2000 and "100000 characters" in str(error.value)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 16])
def test_the_head_wise_probe_reaches_every_tile_of_query_rows(group):
    """The start-up probe's query lengths reach every query-row tile the Triton kernel can pick for this group (one
    decoding token, and any number of recomputed ones), in float32 and in 16-bit dtypes."""
    import torch
    from kvpress_critical_vllm.worker import head_wise_probe_lengths

    from kvpress_critical.ops.paged_ragged_attention.triton_backend import paged_constants

    for dtype in (torch.float32, torch.bfloat16):

        def tile(q_len):
            return paged_constants(dtype, dtype, group * q_len, 64)[0]["BLOCK_M"]

        served = {tile(q_len) for q_len in range(1, 513)}
        assert {tile(q_len) for q_len in head_wise_probe_lengths(group)} == served
        assert head_wise_probe_lengths(group)[0] == 1


def test_the_vllm_surface_the_plugin_relies_on_is_there():
    """Every vLLM name of ``vllm_compat.SURFACE`` against the installed vLLM: the classes and functions import, the
    methods take the parameters the plugin passes or overrides, the attributes exist (declared fields, class
    attributes, or assigned in a class's source). What this reports is what a vLLM upgrade must follow."""
    import inspect

    from kvpress_critical_vllm.vllm_compat import SURFACE, resolve

    missing = []
    for module, name, kind in SURFACE:
        try:
            if kind == "attribute":
                owner, attribute = name.rsplit(".", 1)
                cls = resolve(module, owner)
                declared = any(
                    attribute in getattr(k, "__annotations__", {}) or attribute in vars(k) for k in cls.__mro__
                )
                assigned = any(
                    f"self.{attribute} =" in inspect.getsource(k) or f"self.{attribute}:" in inspect.getsource(k)
                    for k in cls.__mro__
                    if k.__module__.startswith("vllm")
                )
                assert declared or assigned, "no such attribute"
            elif kind.startswith("method("):
                wanted = [p.strip() for p in kind[len("method(") : -1].split(",") if p.strip()]
                parameters = inspect.signature(inspect.unwrap(resolve(module, name))).parameters
                absent = [p for p in wanted if p not in parameters]
                assert not absent, f"no parameter(s) {absent} in {list(parameters)}"
            else:
                assert resolve(module, name) is not None
        except (ImportError, AttributeError, AssertionError) as error:
            missing.append(f"{module}.{name} ({kind}): {error}")
    assert not missing, "\n".join(missing)


# ---------------------------------------------------------------------------------------------- hybrid KV-cache groups
def _group(kind: str, window: int | None = None):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    shape = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    state = dict(block_size=32, shapes=((4, 4),), dtypes=(torch.float32,))
    spec = {
        "full": lambda: FullAttentionSpec(**shape, sliding_window=window),
        "sliding": lambda: SlidingWindowSpec(**shape, sliding_window=window),
        "mamba": lambda: MambaSpec(**state, mamba_type=MambaAttentionBackendEnum.MAMBA2),
        "linear": lambda: MambaSpec(**state, mamba_type=MambaAttentionBackendEnum.GDN_ATTN),
    }[kind]()
    return SimpleNamespace(kv_cache_spec=spec, layer_names=[f"{kind}.{window}"])


@pytest.mark.parametrize(
    "kinds,index",
    [(["full"], 0), (["sliding", "sliding", "full"], 2), (["full", "sliding"], 0), (["linear"] * 3 + ["full"], 3)],
)
def test_the_plugin_compresses_the_one_full_attention_group(kinds, index):
    from kvpress_critical_vllm.kv_spec import compressed_group

    groups = [_group(kind, 128 if kind == "sliding" else None) for kind in kinds]
    assert compressed_group(groups) == index


@pytest.mark.parametrize(
    "groups,mode,message",
    [
        ([("sliding", 128), ("sliding", 128)], {}, "every attention layer is sliding-window"),
        ([("full", None), ("mamba", None)], {}, "with MAMBA2 layers yet"),
        ([("linear", None), ("linear", None)], {}, "no layer is full attention"),
        ([("linear", None), ("full", None)], {"longer_than_pool": True}, "max_model_len longer than the KV pool"),
        ([("linear", None), ("full", None)], {"tensor_parallel_size": 2}, "over 2 tensor-parallel ranks"),
        ([("full", None), ("full", None), ("sliding", 64)], {}, "into 2 KV-cache groups"),
        ([("full", 128)], {}, "Unset disable_hybrid_kv_cache_manager"),
        ([("full", None), ("sliding", 64)], {"longer_than_pool": True}, "max_model_len longer than the KV pool"),
        ([("full", None), ("sliding", 64)], {"tensor_parallel_size": 2}, "over 2 tensor-parallel ranks"),
    ],
)
def test_kv_cache_groups_the_plugin_cannot_compress_refuse(groups, mode, message):
    from kvpress_critical_vllm.engine_config import EngineConfigError
    from kvpress_critical_vllm.kv_spec import compressed_group

    with pytest.raises(EngineConfigError, match=message):
        compressed_group([_group(kind, window) for kind, window in groups], **mode)
    if mode:  # the same groups in the default mode are served
        served = compressed_group([_group(kind, window) for kind, window in groups])
        assert groups[served][0] == "full"
    if mode.get("tensor_parallel_size"):  # a model of full-attention layers only is served over several ranks
        assert compressed_group([_group("full")], **mode) == 0


def test_a_sliding_window_group_holds_vllms_admission_cap_at_most():
    from kvpress_critical_vllm.kv_spec import companion_blocks

    config = SimpleNamespace(max_in_flight_tokens=64, model_config=SimpleNamespace(max_model_len=2048))
    groups = [_group("sliding", 128), _group("full"), _group("sliding", 128)]
    blocks = companion_blocks(groups, 1, config)
    cap = -(-(128 - 1 + 64) // 32) + 1  # vLLM's: the window, the tokens in flight, one block for an unaligned start
    assert [blocks(n) for n in (1, 32, 33, 100, 4096)] == [2, 2, 4, 2 * 4, 2 * cap]
    assert companion_blocks([_group("full")], 0, config)(4096) == 0


@pytest.mark.parametrize("mode,held", [("none", 1), ("align", 2)])
def test_a_linear_attention_group_holds_its_states_blocks(mode, held):
    """A linear-attention layer's state: one block a request, two where vLLM's prefix cache keeps states at block
    boundaries (``mamba_cache_mode`` "align"), whatever the request's length."""
    from kvpress_critical_vllm.kv_spec import companion_blocks

    config = SimpleNamespace(
        max_in_flight_tokens=64,
        model_config=SimpleNamespace(max_model_len=2048),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
    )
    blocks = companion_blocks([_group("linear"), _group("linear"), _group("full")], 2, config)
    assert [blocks(n) for n in (1, 32, 33, 4096)] == [2, 2, 2 * held, 2 * held]


def test_admission_counts_the_sliding_window_groups_beside_the_compressed_one():
    from kvpress_critical_vllm.pool_guard import PoolGuard
    from kvpress_critical_vllm.tracking import Tracked

    options = CompressionOptions(press="critical_knorm", compression_ratio=0.5, compression_chunk_size=128)
    request = SimpleNamespace(num_tokens=1024, num_prompt_tokens=1024)
    tracked = Tracked(options, Schedule(options, 1024, 32))
    alone = PoolGuard(32, 200, longer_than_pool=False, reserve_full_isl=True)
    beside = PoolGuard(32, 200, longer_than_pool=False, reserve_full_isl=True, companion_blocks=lambda n: 7)
    needed = next(free for free in range(200) if alone.admit(request, tracked, free, False)[0])
    assert beside.admit(request, tracked, needed + 7, False) == (True, False)
    assert beside.admit(request, tracked, needed + 6, False)[0] is False


def test_a_sliding_window_layer_in_the_compressed_group_refuses():
    from kvpress_critical_vllm.engine_config import EngineConfigError
    from kvpress_critical_vllm.worker import check_attention_impl

    for window in (127, (127, 0)):  # CPU_ATTN's, FLASH_ATTN's
        impl = SimpleNamespace(alibi_slopes=None, logits_soft_cap=0, sinks=None, sliding_window=window)
        with pytest.raises(EngineConfigError, match="sliding window"):
            check_attention_impl("model.layers.0.self_attn.attn", impl)
    for none in (None, -1, (-1, -1)):
        check_attention_impl(
            "l", SimpleNamespace(alibi_slopes=None, logits_soft_cap=0, sinks=None, sliding_window=none)
        )
