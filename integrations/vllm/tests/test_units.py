"""The plugin's pieces without an engine: options, eviction arithmetic, the shifted view, reading the paged cache."""

from types import SimpleNamespace

import pytest
import torch
from kvpress_critical_vllm.attention import LearnedBlockLayout, check_round_trip, shifted_view
from kvpress_critical_vllm.budget import eviction
from kvpress_critical_vllm.options import CompressionOptions, OptionsError, engine_options, resolve_options


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


def test_requests_override_engine_options_nested_and_flat():
    engine = engine_options({"kvpress_critical": {"press": "snapkv", "compression_ratio": 0.5}})
    assert resolve_options(engine, None) is engine
    nested = resolve_options(engine, {"kvpress_critical": {"compression_ratio": 0.75, "press": "critical_knorm"}})
    assert (nested.press, nested.compression_ratio, nested.window_size) == ("critical_knorm", 0.75, 64)
    flat = resolve_options(engine, {"kvpress_critical.compression_ratio": 0.0, "unrelated": 1})
    assert flat.compression_ratio == 0.0 and flat.press == "snapkv"
    with pytest.raises(OptionsError, match="unknown option"):
        resolve_options(engine, {"kvpress_critical.ratio": 0.5})
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
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    # the implementation reads the engine's model dtype when built (for encoder attention)
    engine = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: engine)
    impl = CPUAttentionBackendImpl(
        num_heads=2 * num_kv_heads, head_size=head_size, scale=head_size**-0.5, num_kv_heads=num_kv_heads,
        alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
    )  # fmt: skip
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
