"""fp8 KV caches without an engine: vLLM's CPU quantizer, the layout probe over codes, and compactions that score the
dequantized entries and move the codes unchanged.

vLLM's CPU attention stores fp8 codes on x86 with AVX-512 or AMX only; elsewhere these tests skip, saying why.
"""

from types import SimpleNamespace

import pytest
import torch
from conftest import cpu_attention_impl, fp8_on_this_cpu
from kvpress_critical_vllm.kv_codes import FP8_FORMATS, KVCodes
from kvpress_critical_vllm.layouts import LearnedBlockLayout, check_round_trip
from kvpress_critical_vllm.options import CompressionOptions
from reference import fp8_codes

FORMATS = ["fp8", "fp8_e4m3", "fp8_e5m2"]


needs_fp8_cpu = pytest.mark.skipif(fp8_on_this_cpu() is not None, reason=str(fp8_on_this_cpu()))


def cpu_layer(dtype, block_size, head_size, cache_dtype, k_scale=1.0, v_scale=1.0):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
    return SimpleNamespace(isa=isa, _k_scale_float=k_scale, _v_scale_float=v_scale)


@needs_fp8_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_cpu_attention_stores_codes_rounded_toward_zero(monkeypatch, dtype, cache_dtype):
    """The tests' quantizer (``reference.fp8_codes``) is vLLM's, code for code, over magnitudes from subnormal to
    saturated and scales above and below 1: the transformers reference then attends over what the engine holds."""
    block_size, head_size, num_kv_heads = 32, 64, 2
    impl = cpu_attention_impl(monkeypatch, dtype, cache_dtype, num_kv_heads, head_size)
    for k_scale, v_scale in ((1.0, 1.0), (0.37, 3.0)):
        layer = cpu_layer(dtype, block_size, head_size, cache_dtype, k_scale, v_scale)
        kv_cache = torch.zeros(4, num_kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
        layout = LearnedBlockLayout.probe(impl, layer, kv_cache, KVCodes(cache_dtype, k_scale, v_scale), dtype)
        generator = torch.Generator().manual_seed(0)
        magnitude = torch.tensor([1e-4, 0.01, 1.0, 30.0, 1000.0]).repeat_interleave(24)[:, None, None]
        keys = (torch.randn(120, num_kv_heads, head_size, generator=generator) * magnitude).to(dtype)
        values = (torch.randn(120, num_kv_heads, head_size, generator=generator) * magnitude).to(dtype)
        slots = torch.randperm(4 * block_size, generator=generator)[:120]
        impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
        got_keys, got_values = layout.read(kv_cache, slots)
        code = FP8_FORMATS[cache_dtype]
        assert torch.equal(got_keys, fp8_codes(keys, code, k_scale).view(torch.uint8))
        assert torch.equal(got_values, fp8_codes(values, code, v_scale).view(torch.uint8))


@needs_fp8_cpu
@pytest.mark.parametrize("cache_dtype", FORMATS)
@pytest.mark.parametrize("block_size,head_size,num_kv_heads", [(32, 64, 3), (64, 128, 2)])
def test_the_learned_layout_reads_fp8_codes_whatever_the_scales(monkeypatch, cache_dtype, block_size, head_size,
                                                                  num_kv_heads):  # fmt: skip
    """The probe writes through the backend with the layer's scales seen as 1.0 (small integers stay exact in fp8);
    the round trip checks reads within the format's rounding and the plugin's writes byte for byte."""
    dtype = torch.bfloat16
    impl = cpu_attention_impl(monkeypatch, dtype, cache_dtype, num_kv_heads, head_size)
    layer = cpu_layer(dtype, block_size, head_size, cache_dtype, k_scale=0.5, v_scale=2.0)
    codes = KVCodes(cache_dtype, 0.5, 2.0)
    kv_cache = torch.zeros(3, num_kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
    layout = LearnedBlockLayout.probe(impl, layer, kv_cache, codes, dtype)
    check_round_trip(impl, layer, kv_cache, layout, codes, dtype)
    keys, values = codes.decode(*layout.read(kv_cache, torch.arange(4)), torch.float32)
    assert keys.shape == (4, num_kv_heads, head_size) and not keys.any() and not values.any()  # untouched: zeros
    # a layout that swaps keys and values fails the round trip
    swapped = LearnedBlockLayout(layout.value_offsets, layout.key_offsets)
    with pytest.raises(Exception, match="cannot read this engine's paged KV cache back"):
        check_round_trip(impl, layer, kv_cache, swapped, codes, dtype)


@needs_fp8_cpu
@pytest.mark.parametrize("press", ["critical_snapkv", "critical_knorm", "snapkv"])
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_a_compaction_scores_the_dequantized_entries_and_moves_their_codes(monkeypatch, press, cache_dtype):
    """Over an fp8 cache written by vLLM's CPU attention: the kept entries are the press's selection on the
    dequantized entries (quantized here by the reference quantizer, scored by the same rule), and every kept entry's
    codes move to its new slot byte for byte."""
    from kvpress_critical_vllm.budget import eviction
    from kvpress_critical_vllm.compaction import Compactor
    from kvpress_critical_vllm.presses import keep_mask
    from kvpress_critical_vllm.protocol import Compact
    from kvpress_critical_vllm.step_plan import Job

    dtype, block_size, head_size, num_kv_heads, group, n_prompt = torch.float32, 32, 64, 2, 3, 200
    k_scale, v_scale = 0.5, 1.25
    impl = cpu_attention_impl(monkeypatch, dtype, cache_dtype, num_kv_heads, head_size, group)
    layer = cpu_layer(dtype, block_size, head_size, cache_dtype, k_scale, v_scale)
    codes = KVCodes(cache_dtype, k_scale, v_scale)
    num_blocks = 12
    kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=torch.uint8)
    layout = LearnedBlockLayout.probe(impl, layer, kv_cache, codes, dtype)
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(n_prompt, num_kv_heads, head_size, generator=generator) * 2
    values = torch.randn(n_prompt, num_kv_heads, head_size, generator=generator)
    queries = torch.randn(64, num_kv_heads * group, head_size, generator=generator)
    o_proj = torch.randn(96, num_kv_heads * group * head_size, generator=generator)
    options = CompressionOptions(press=press, compression_ratio=0.5, window_size=64)
    evict = eviction(options, n_prompt, block_size)
    block_ids = torch.randperm(num_blocks, generator=generator)
    job = Job(Compact("a", options, evict), row=0, query_start=0, query_end=n_prompt, block_ids=block_ids)
    job.queries = {"layer": queries}
    compactor = Compactor(layout, {"layer": o_proj}, kv_codes={"layer": codes})
    slots = compactor.slots(job)
    impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    before = kv_cache.clone()
    layers = {"layer": SimpleNamespace(kv_cache=kv_cache, impl=impl)}
    outcome = compactor.compact([job], layers)
    assert not outcome.uncompressed and not outcome.broken
    ((_, kept),) = outcome.written
    code = FP8_FORMATS[cache_dtype]
    cached_keys = (fp8_codes(keys, code, k_scale).float() * k_scale).to(dtype)
    cached_values = (fp8_codes(values, code, v_scale).float() * v_scale).to(dtype)

    def read(first, end):
        return cached_keys[:, first:end], cached_values[:, first:end]

    expected = keep_mask(options, read, num_kv_heads, evict.kept, queries=queries, o_proj_weight=o_proj)
    assert torch.equal(kept["layer"], expected)
    # the float entries, scored as they were before the cache rounded them, select otherwise for some head: the
    # check above sees the rounding
    unrounded = keep_mask(
        options, lambda f, e: (keys[:, f:e], values[:, f:e]), num_kv_heads, evict.kept, queries, o_proj
    )
    assert not torch.equal(unrounded, expected)
    target = slots[evict.evicted - evict.start :]
    for head in range(num_kv_heads):
        heads = slice(head, head + 1)
        moved = layout.read(kv_cache, target, heads)
        original = layout.read(before, slots[expected[head].nonzero().flatten()], heads)
        assert all(torch.equal(a, b) for a, b in zip(moved, original))  # the same bytes, not re-quantized
