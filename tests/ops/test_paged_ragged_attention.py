"""The paged ragged attention op: every backend against the float64 reference, over the layouts a paged engine makes.

Grid: block sizes 8 / 16 / 32, per-head region lengths 0 / 1 / odd / a whole region block / several blocks and very
unequal across heads, GQA groups 1 / 4 / 7, head_dim 64 / 80 / 128, q_len 1 (decoding) and 6 (a chunk, causal among
the new tokens), tails from the queries alone to several blocks (the tail's first block holds the prompt's last
tokens and the first new ones, as in the vLLM plugin), batch 1 and 3, fp32 and bf16. Blocks are handed out in a
shuffled order with spare blocks poisoned with NaN (an out-of-range read shows as NaN); tail keys are stored
dimension-major inside a block (the CPU backend's vector layout), so the element offsets are not the identity.
Triton runs in its interpreter on CPU (tiny shapes) and is compiled ahead of time for sm_80 / sm_90.
"""

import pytest
import torch
from covering import grid
from op_helpers import triton_aot_rows

from kvpress_critical.ops.paged_ragged_attention import (
    PAGED_RAGGED_ATTENTION,
    packed_segments,
    paged_ragged_attention,
    paged_ragged_attention_ref,
    random_paged_layout,
    split_offsets,
)
from kvpress_critical.ops.ragged_attention import ATTENTION_TOLERANCE, ragged_attention_ref

CPU_BACKENDS = [n for n in ("torch", "cpp") if PAGED_RAGGED_ATTENTION[n].availability() is None]


def seg_lens_for(bsz, block_size, num_kv_heads=2):
    """Per (row, head) region lengths: empty, one, odd, exactly one region block, several blocks, very unequal."""
    rows = block_size * num_kv_heads
    lengths = [[0, 1], [rows - 7, 2 * rows + 3], [rows, 0]][:bsz] if bsz > 1 else [[5, 3 * rows + 1]]
    return lengths


def layout(bsz, group, q_len, head_dim, block_size, dtype, tail_extra=(0, 9, 2 * 16 + 5), seed=0):
    seg_lens = seg_lens_for(bsz, block_size)
    tail_lens = [q_len + tail_extra[b % len(tail_extra)] for b in range(bsz)]
    inputs = random_paged_layout(
        bsz, 2, group, q_len, head_dim, block_size, seg_lens, tail_lens, dtype=dtype, seed=seed
    )
    used = set(inputs["region_table"].flatten().tolist()) | set(inputs["tail_table"].flatten().tolist())
    spare = [b for b in range(inputs["region_keys"].shape[0]) if b not in used]
    inputs["tail_keys"][spare] = float("nan")  # the same storage as the region's rows
    return inputs


def check(backend, bsz, group, q_len, head_dim, block_size, dtype):
    inputs = layout(bsz, group, q_len, head_dim, block_size, dtype)
    ref = paged_ragged_attention_ref(**inputs).double()
    out = paged_ragged_attention(**inputs, backend=backend)
    assert out.shape == (bsz, q_len, 2 * group, head_dim) and out.dtype == dtype
    assert not torch.isnan(out).any(), f"{backend}: NaN (a read outside the row's blocks)"
    rtol, atol = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol + rtol * 4)


# every pair of values and every backend x block_size x q_len (the region and tail reads; the micro-kernels are
# ragged_attention's, covered by its own grid); the full product with --full-grid
GRID = dict(
    backend=CPU_BACKENDS, bsz=[1, 3], block_size=[8, 16, 32], q_len=[1, 6], group=[1, 4, 7], head_dim=[64, 80, 128],
    dtype=[torch.float32, torch.bfloat16],
)  # fmt: skip


@pytest.mark.parametrize(",".join(GRID), grid(GRID, stronger=[("backend", "block_size", "q_len")]))
def test_cpu_backends_match_reference(backend, bsz, block_size, q_len, group, head_dim, dtype):
    check(backend, bsz, group, q_len, head_dim, block_size, dtype)


@pytest.mark.parametrize("q_len", [1, 6])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_matches_reference(block_size, group, q_len):
    backend = PAGED_RAGGED_ATTENTION["triton"]
    if backend.availability() is not None or "cpu" not in backend.device_types():
        pytest.skip(backend.availability() or "Triton runs on CPU tensors only under its interpreter")
    check("triton", 3, group, q_len, 64, block_size, torch.float32)
    # the grid sized from the caller's host-side bound, not read back from the device
    inputs = layout(3, group, q_len, 64, block_size, torch.float32)
    longest = int((inputs["seg_len"].view(3, 2).max(dim=1).values + inputs["tail_len"]).max())
    bounded = paged_ragged_attention(**inputs, backend="triton", max_len=longest)
    torch.testing.assert_close(bounded, paged_ragged_attention(**inputs, backend="triton"), rtol=0, atol=1e-5)


def test_the_reference_is_ragged_attention_over_the_gathered_entries():
    """The paged layout holds what the compact layout holds: gathered segment by segment into packed entries and a
    dense tail, ``ragged_attention_ref`` gives the same output (tails of equal length)."""
    from kvpress_critical.ops.paged_ragged_attention.naive import gather_segment, gather_tail

    bsz, group, q_len, head_dim, block_size = 2, 3, 4, 32, 8
    inputs = random_paged_layout(bsz, 2, group, q_len, head_dim, block_size, [[3, 40], [17, 0]], [11, 11], seed=3)
    keys, values, tail_k, tail_v = [], [], [], []
    for b in range(bsz):
        heads_k, heads_v = [], []
        for h in range(2):
            k, v = gather_segment(inputs["region_keys"], inputs["region_values"], inputs["region_table"],
                                  inputs["seg_start"], inputs["seg_len"], b, b * 2 + h)  # fmt: skip
            keys.append(k)
            values.append(v)
            tk, tv = gather_tail(inputs["tail_keys"], inputs["tail_values"], inputs["tail_table"], 11,
                                 inputs["key_offsets"], inputs["value_offsets"], b, h)  # fmt: skip
            heads_k.append(tk)
            heads_v.append(tv)
        tail_k.append(torch.stack(heads_k))
        tail_v.append(torch.stack(heads_v))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(inputs["seg_len"], 0)])
    ragged = ragged_attention_ref(inputs["query"], torch.cat(keys), torch.cat(values), cu, torch.stack(tail_k),
                                  torch.stack(tail_v), 11, inputs["scale"])  # fmt: skip
    torch.testing.assert_close(paged_ragged_attention_ref(**inputs), ragged, rtol=0, atol=1e-6)


def test_packed_segments_and_split_offsets():
    start, length = packed_segments(torch.tensor([[3, 0, 5], [1, 1, 1]]))
    assert start.tolist() == [0, 3, 3, 0, 1, 2] and length.tolist() == [3, 0, 5, 1, 1, 1]
    offsets = split_offsets(num_kv_heads=2, block_size=4, head_dim=3)  # [block, slot, head, dim]
    assert offsets[1, 2].tolist() == [2 * 2 * 3 + 1 * 3 + k for k in range(3)]


@pytest.mark.parametrize("vector", [1, 4, 8, 80], ids=lambda x: f"vector{x}")
def test_cpu_backends_read_tails_stored_in_vectors(vector):
    """Tail keys stored in vectors of ``vector`` elements (``[d / x, slot, x]`` inside a head's block: vLLM's CPU
    layouts), values slot-major: the C++ kernel copies a tail entry run by run, runs of 1, x or d elements."""
    inputs = layout(3, 4, 6, 80, 16, torch.float32)
    bs, d = 16, 80
    heads = torch.arange(2)[:, None, None] * bs * 2 * d
    slots, dims = torch.arange(bs)[None, :, None], torch.arange(d)[None, None, :]
    inputs["key_offsets"] = heads + (dims // vector) * bs * vector + slots * vector + dims % vector
    ref = paged_ragged_attention_ref(**inputs).double()
    for backend in CPU_BACKENDS:
        out = paged_ragged_attention(**inputs, backend=backend)
        assert not torch.isnan(out).any(), backend
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_a_host_bound_of_the_longest_segment_is_checked_and_changes_nothing():
    """``max_len`` (the engine's host-side bound, which spares the Triton backend a device read per call) gives the
    same output where it is the longest segment plus tail, and is refused shorter."""
    inputs = layout(3, 4, 1, 64, 8, torch.float32)
    rows = inputs["seg_len"].view(3, 2).max(dim=1).values + inputs["tail_len"]
    longest = int(rows.max())
    for backend in CPU_BACKENDS:
        expected = paged_ragged_attention(**inputs, backend=backend)
        torch.testing.assert_close(paged_ragged_attention(**inputs, backend=backend, max_len=longest), expected)
    with pytest.raises(ValueError, match=f"max_len={longest - 1} is shorter than the longest segment and tail"):
        paged_ragged_attention(**inputs, backend="torch", max_len=longest - 1)


def test_unvalidated_calls_give_the_same_output_and_skip_only_the_python_checks():
    """``validate=False`` (an engine's later layers of a step) gives the validated call's output; it skips the
    wrapper's checks (a short ``max_len`` passes), while the C++ kernel still refuses a block outside the cache."""
    inputs = layout(3, 4, 1, 64, 8, torch.float32)
    for backend in CPU_BACKENDS:
        expected = paged_ragged_attention(**inputs, backend=backend)
        torch.testing.assert_close(paged_ragged_attention(**inputs, backend=backend, validate=False), expected)
    paged_ragged_attention(**inputs, backend="torch", max_len=1, validate=False)
    with pytest.raises(ValueError, match="max_len=1 is shorter"):
        paged_ragged_attention(**inputs, backend="torch", max_len=1)
    if "cpp" in CPU_BACKENDS:
        table = inputs["region_table"].clone()
        table[1, 0] = inputs["region_keys"].shape[0] + 5
        with pytest.raises(RuntimeError, match="region block outside the cache"):
            paged_ragged_attention(**{**inputs, "region_table": table}, backend="cpp", validate=False)


def test_bad_inputs_are_refused_with_their_name():
    inputs = layout(1, 2, 1, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="tail_len >= q_len"):
        paged_ragged_attention(**{**inputs, "tail_len": torch.zeros(1, dtype=torch.int64)}, backend="torch")
    with pytest.raises(ValueError, match="seg_start must have 2 entries"):
        paged_ragged_attention(**{**inputs, "seg_start": inputs["seg_start"][:1]}, backend="torch")
    with pytest.raises(ValueError, match="not a multiple"):
        paged_ragged_attention(**{**inputs, "query": inputs["query"][:, :3]}, backend="torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_len", [1, 5])
def test_opcheck(ops, dtype, q_len):
    """Schema, fake implementation and dispatch of kvpress_critical::paged_ragged_attention (torch.library.opcheck)."""
    inputs = layout(2, 3, q_len, 16, 8, dtype)
    inputs["tail_keys"] = inputs["tail_values"] = inputs["tail_keys"].nan_to_num()  # NaN-free results to compare
    args = [inputs[name] for name in ("query", "region_keys", "region_values", "region_table", "seg_start", "seg_len",
                                      "tail_keys", "tail_values", "tail_table", "tail_len", "key_offsets",
                                      "value_offsets")]  # fmt: skip
    torch.library.opcheck(ops.paged_ragged_attention.default, (*args, 0.25))


def test_the_cpp_kernel_refuses_blocks_outside_the_cache(ops):
    inputs = layout(1, 2, 1, 64, 8, torch.float32)
    table = inputs["region_table"].clone()
    table[0, 0] = inputs["region_keys"].shape[0] + 5
    with pytest.raises(RuntimeError, match="region block outside the cache"):
        paged_ragged_attention(**{**inputs, "region_table": table}, backend="cpp")
    offsets = inputs["value_offsets"].clone()
    offsets[1, 3, 5] = inputs["tail_keys"].shape[1]  # one element past the block, in the second KV head
    with pytest.raises(RuntimeError, match="offsets outside a block"):
        paged_ragged_attention(**{**inputs, "value_offsets": offsets}, backend="cpp")


def test_triton_kernel_compiles_for_gpus_without_spilling():
    """The launcher's configurations in fp32 / bf16 / fp16 at head_dim 128, bf16 at 64 and 256, a prefill chunk,
    bf16 over fp8 codes, compiled by Triton for sm_80 / sm_90 and assembled with ``ptxas -v``: at most a few words
    spill."""
    from kvpress_critical.ops.triton_aot import PAGED_CASES

    if PAGED_RAGGED_ATTENTION["triton"].availability() is not None:
        pytest.skip(PAGED_RAGGED_ATTENTION["triton"].availability())
    rows = triton_aot_rows("--op", "paged_ragged_attention")
    assert len(rows) == sum(len(case[3]) for case in PAGED_CASES)
    assert {r["cache"] for r in rows} >= {"float8_e4m3fn", "float8_e5m2"}
    assert all(0 < r["registers"] <= 255 for r in rows)
    spilling = [r for r in rows if r["spill_stores"] > 64]
    assert not spilling, spilling


# ------------------------------------------------------------------------------------------------ fp8 caches (vLLM's)
def fp8_layout(group, q_len, block_size, cache_dtype, dtype=torch.float32, bsz=3):
    seg_lens = seg_lens_for(bsz, block_size)
    tail_lens = [q_len + (0, 9, 37)[b % 3] for b in range(bsz)]
    return random_paged_layout(
        bsz, 2, group, q_len, 64, block_size, seg_lens, tail_lens, dtype=dtype, cache_dtype=cache_dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_len", [1, 6])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_codes_are_read_with_their_scales(cache_dtype, q_len, dtype):
    """An fp8 cache's entries are its codes times the per-tensor scales: the op over the codes equals the float64
    reference over the same codes, and equals the op over a float32 cache holding the dequantized entries."""
    inputs = fp8_layout(4, q_len, 16, cache_dtype, dtype)
    assert inputs["region_keys"].dtype == cache_dtype and inputs["k_scale"] != inputs["v_scale"]
    ref = paged_ragged_attention_ref(**inputs).double()
    out = paged_ragged_attention(**inputs, backend="auto")
    assert out.dtype == dtype and not torch.isnan(out).any()
    rtol, atol = ATTENTION_TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol + rtol * 4)
    # the same entries stored as floats: keys are the first half of each region block and of each tail block-head
    dequantized = dict(inputs)
    del dequantized["k_scale"], dequantized["v_scale"]
    for name, scale in (("region_keys", inputs["k_scale"]), ("region_values", inputs["v_scale"])):
        dequantized[name] = inputs[name].float() * scale
    flat = inputs["tail_keys"].float()
    keys_flat, values_flat = flat * inputs["k_scale"], flat * inputs["v_scale"]
    dequantized["tail_keys"], dequantized["tail_values"] = keys_flat, values_flat
    expected = paged_ragged_attention_ref(**dequantized).double()
    torch.testing.assert_close(ref, expected, rtol=0, atol=1e-12)
    over_floats = paged_ragged_attention(**{**dequantized, "query": dequantized["query"].float()}, backend="auto")
    torch.testing.assert_close(out.double(), over_floats.double(), rtol=2 * rtol, atol=atol + rtol * 4)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_backends_read_fp8_codes(backend, cache_dtype):
    """Each CPU backend over fp8 codes, GQA 4 and 7, decoding and a chunk, block sizes 8 and 32, against the float64
    reference over the same codes."""
    for group, q_len, block_size in ((4, 1, 8), (7, 6, 32), (1, 3, 16)):
        inputs = fp8_layout(group, q_len, block_size, cache_dtype)
        out = paged_ragged_attention(**inputs, backend=backend)
        rtol, atol = ATTENTION_TOLERANCE[torch.float32]
        expected = paged_ragged_attention_ref(**inputs).double()
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol + rtol * 4)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_triton_reads_fp8_codes(cache_dtype):
    """The Triton kernel over fp8 codes (their bytes converted in registers), as the CPU backends: GQA 4, 7 and 1,
    decoding and chunks, against the float64 reference over the same codes; a bfloat16 query too."""
    backend = PAGED_RAGGED_ATTENTION["triton"]
    if backend.availability() is not None or "cpu" not in backend.device_types():
        pytest.skip(backend.availability() or "Triton runs on CPU tensors only under its interpreter")
    assert backend.refusal(*[fp8_layout(4, 1, 8, cache_dtype)[n] for n in ("query", "region_keys")]) is None
    for group, q_len, block_size, dtype in ((4, 1, 8, torch.float32), (7, 6, 32, torch.float32),
                                            (1, 3, 16, torch.bfloat16)):  # fmt: skip
        inputs = fp8_layout(group, q_len, block_size, cache_dtype, dtype)
        out = paged_ragged_attention(**inputs, backend="triton")
        rtol, atol = ATTENTION_TOLERANCE[dtype]
        expected = paged_ragged_attention_ref(**inputs).double()
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol + rtol * 4)


def test_fp8_bytes_are_refused_by_name_and_scales_by_a_float_cache():
    raw = fp8_layout(2, 1, 8, torch.float8_e4m3fn)
    for name in ("region_keys", "region_values", "tail_keys", "tail_values"):
        raw[name] = raw[name].view(torch.uint8)  # an fp8 cache's bytes, not viewed as codes
    with pytest.raises(ValueError, match="uint8: pass float entries, or fp8 codes"):
        paged_ragged_attention(**raw, backend="torch")
    inputs = fp8_layout(2, 1, 8, torch.float8_e4m3fn)
    expected = CPU_BACKENDS[-1]  # cpp where the extension loads, else torch
    assert PAGED_RAGGED_ATTENTION.resolve("auto", torch.device("cpu"), inputs["query"], inputs["region_keys"]) == (
        expected
    )
    float_inputs = layout(1, 2, 1, 64, 8, torch.float32)
    for backend in CPU_BACKENDS:
        with pytest.raises(ValueError, match="scale fp8 codes"):
            paged_ragged_attention(**float_inputs, k_scale=0.5, backend=backend)


def test_opcheck_over_fp8_codes(ops):
    """The fake implementation and the autograd registration with fp8 codes and their scales (torch.library.opcheck;
    its schema check compares inputs with a multiplication torch has no CPU kernel of for float8)."""
    inputs = fp8_layout(3, 2, 8, torch.float8_e4m3fn, bsz=2)
    args = [inputs[name] for name in ("query", "region_keys", "region_values", "region_table", "seg_start", "seg_len",
                                      "tail_keys", "tail_values", "tail_table", "tail_len", "key_offsets",
                                      "value_offsets")]  # fmt: skip
    torch.library.opcheck(
        ops.paged_ragged_attention.default, (*args, 0.25, inputs["k_scale"], inputs["v_scale"]),
        test_utils=("test_faketensor", "test_autograd_registration"),
    )  # fmt: skip


# ---- logits soft caps (Gemma 2) and attention sinks (gpt-oss) -------------------------------------------------------
def softmax_terms(heads: int, seed: int = 1) -> torch.Tensor:
    """Sink logits per query head around the scores' range: some well below (a small weight), some above."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float() * 3.0


SOFTMAX_TERMS = [(30.0, False), (0.0, True), (5.0, True)]  # (soft cap, sinks): the cap alone, the sinks, both


@pytest.mark.parametrize("soft_cap,with_sinks", SOFTMAX_TERMS, ids=["cap", "sinks", "cap+sinks"])
@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "triton"])
def test_soft_caps_and_sinks_match_the_reference(backend, soft_cap, with_sinks):
    """Each backend with a soft cap, sinks or both, GQA 4, 7 and 1, decoding and chunks, float32, bfloat16 and fp8
    caches, against the float64 reference; the reference itself against its definition (capped scores, the sink one
    more softmax term) and against the plain op, which the terms change."""
    if backend == "triton":
        triton = PAGED_RAGGED_ATTENTION["triton"]
        if triton.availability() is not None or "cpu" not in triton.device_types():
            pytest.skip(triton.availability() or "Triton runs on CPU tensors only under its interpreter")
    cases = [(4, 1, 8, torch.float32, None), (7, 6, 32, torch.bfloat16, None), (1, 3, 16, torch.float32, None)]
    cases += [(4, 1, 16, torch.float32, torch.float8_e4m3fn)]
    for group, q_len, block_size, dtype, cache in cases:
        if cache is None:
            inputs = layout(3, group, q_len, 64, block_size, dtype)
        else:
            inputs = fp8_layout(group, q_len, block_size, cache, dtype)
        inputs["query"] = inputs["query"] * 4.0  # peaky scores, so that a cap of 5 bends them
        terms = dict(soft_cap=soft_cap, sinks=softmax_terms(2 * group) if with_sinks else None)
        expected = paged_ragged_attention_ref(**inputs, **terms).double()
        plain = paged_ragged_attention_ref(**inputs).double()
        assert (expected - plain).abs().max() > 1e-2, "the terms change the output"
        out = paged_ragged_attention(**inputs, **terms, backend=backend)
        assert out.dtype == dtype and not torch.isnan(out).any()
        rtol, atol = ATTENTION_TOLERANCE[dtype]
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol + rtol * 4)


def test_the_references_soft_cap_and_sinks_are_their_definitions():
    """One row, one head, written out: softmax over ``cap * tanh(s / cap)`` and the sink's logit, the sink's weight
    dropped."""
    inputs = layout(1, 1, 1, 64, 8, torch.float32)
    inputs["query"] = inputs["query"] * 4.0
    sinks = torch.tensor([0.7, -1.3])
    out = paged_ragged_attention_ref(**inputs, soft_cap=5.0, sinks=sinks).double()
    from kvpress_critical.ops.paged_ragged_attention.naive import gather_segment, gather_tail

    for h in range(2):
        args = (inputs["region_keys"], inputs["region_values"], inputs["region_table"], inputs["seg_start"])
        rk, rv = gather_segment(*args, inputs["seg_len"], 0, h)
        length = int(inputs["tail_len"][0])
        tail_args = (inputs["tail_keys"], inputs["tail_values"], inputs["tail_table"], length)
        tk, tv = gather_tail(*tail_args, inputs["key_offsets"], inputs["value_offsets"], 0, h)
        k, v = torch.cat([rk, tk]).double(), torch.cat([rv, tv]).double()
        s = k @ inputs["query"][0, h, 0].double() * inputs["scale"]
        s = 5.0 * torch.tanh(s / 5.0)
        weights = torch.exp(s) / (torch.exp(s).sum() + torch.exp(torch.tensor(float(sinks[h]), dtype=torch.float64)))
        torch.testing.assert_close(out[0, 0, h], weights @ v, rtol=0, atol=1e-6)  # the float32 output


def test_bad_soft_caps_and_sinks_are_refused():
    inputs = layout(1, 2, 1, 64, 8, torch.float32)
    with pytest.raises(ValueError, match="soft_cap must be a finite number >= 0"):
        paged_ragged_attention(**inputs, soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must be \(4,\) floats"):
        paged_ragged_attention(**inputs, sinks=torch.zeros(2))


def test_opcheck_with_soft_cap_and_sinks(ops):
    """The schema's ``soft_cap`` and ``sinks`` through torch.library.opcheck."""
    inputs = layout(2, 2, 3, 16, 8, torch.float32)
    inputs["tail_keys"] = inputs["tail_values"] = inputs["tail_keys"].nan_to_num()  # NaN-free results to compare
    names = ("query", "region_keys", "region_values", "region_table", "seg_start", "seg_len", "tail_keys",
             "tail_values", "tail_table", "tail_len", "key_offsets", "value_offsets")  # fmt: skip
    args = [inputs[name] for name in names]
    torch.library.opcheck(ops.paged_ragged_attention.default, (*args, 0.25, 1.0, 1.0, 5.0, softmax_terms(4)))
