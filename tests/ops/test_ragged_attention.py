"""The ragged attention op: every backend against the float64 reference over a grid of layouts, and its dispatch.

Grid: segment lengths 0 / 1 / odd / long and very unequal across heads, GQA groups 1 / 4 / 7, head_dim 64 / 80 / 128,
q_len 1 (decoding) and > 1 (a question, causal among the new tokens), batch 1 and 3, fp32 and bf16. Inputs are
NaN-poisoned where no backend may read them (the tail's reserved capacity past ``tail_len``), so an out-of-range
read shows as NaN. Triton runs in its interpreter on CPU (tiny shapes); flash-attn's adapter runs against a stand-in
module with flash-attn's signatures (the real kernels need a GPU: benchmarks/gpu_check.sh).
"""

import sys
import types

import pytest
import torch
from covering import grid
from op_helpers import triton_aot_rows

from kvpress_critical.ops.extension import cpp_availability
from kvpress_critical.ops.ragged_attention import (
    ATTENTION_TOLERANCE,
    RAGGED_ATTENTION,
    QuantizedEntries,
    flash_backend,
    ragged_attention,
    ragged_attention_ref,
    random_layout,
)
from kvpress_critical.ops.ragged_attention.codes import FORMATS, CodeSpec, quantize_entries
from kvpress_critical.ops.registry import BackendUnavailableError

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

# lengths of the 2 KV heads x batch rows: empty, single, odd, long, very unequal
LENGTHS = {1: [0, 37], 3: [1, 300, 0, 5, 129, 2]}


def make(bsz, group, q_len, head_dim, dtype, tail_extra=3, capacity_extra=4, lengths=None, seed=0):
    lengths = LENGTHS[bsz] if lengths is None else lengths
    tail_len = q_len + tail_extra
    inputs = list(
        random_layout(
            bsz, 2, group, q_len, head_dim, lengths, tail_len, tail_len + capacity_extra, dtype=dtype, seed=seed
        )
    )
    inputs[4][:, :, tail_len:] = float("nan")  # reserved tail capacity: never read
    inputs[5][:, :, tail_len:] = float("nan")
    return inputs, tail_len


def check(backend, bsz, group, q_len, head_dim, dtype, **kw):
    inputs, tail_len = make(bsz, group, q_len, head_dim, dtype, **kw)
    scale = head_dim**-0.5
    ref = ragged_attention_ref(*inputs, tail_len=tail_len, scale=scale).double()
    moved = [t.to(DEVICE) for t in inputs]
    out = ragged_attention(*moved, tail_len=tail_len, scale=scale, backend=backend)
    assert out.shape == (bsz, q_len, 2 * group, head_dim) and out.dtype == dtype
    assert not torch.isnan(out).any(), f"{backend}: NaN (a read past the valid entries)"
    rtol, atol = ATTENTION_TOLERANCE[dtype]
    values_scale = max(float(inputs[2].abs().max()) if inputs[2].numel() else 1.0, 1.0)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=0, atol=atol + rtol * values_scale)


def usable(name):
    b = RAGGED_ATTENTION[name]
    return b.availability() is None and DEVICE in b.device_types()


CPU_BACKENDS = [n for n in ("torch", "cpp") if RAGGED_ATTENTION[n].availability() is None]


# the grid of the float entries: a covering array (tests/covering.py) of every pair of values, every backend x dtype x
# head_dim (the C++ kernel's micro-kernels) and every backend x q_len x group (its query loading; 20: the torch
# backend's per-segment sdpa path, a prefill chunk); the full product with --full-grid
FLOAT_GRID = dict(
    backend=CPU_BACKENDS, bsz=[1, 3], q_len=[1, 6, 20], group=[1, 4, 7], head_dim=[64, 80, 128],
    dtype=[torch.float32, torch.bfloat16],
)  # fmt: skip
FLOAT_STRONGER = [("backend", "dtype", "head_dim"), ("backend", "q_len", "group")]


@pytest.mark.parametrize(",".join(FLOAT_GRID), grid(FLOAT_GRID, stronger=FLOAT_STRONGER))
def test_cpu_backends_match_reference(backend, bsz, q_len, group, head_dim, dtype):
    check(backend, bsz, group, q_len, head_dim, dtype)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_long_and_unequal_segments_split_across_threads(backend):
    """Segments longer than a work item (the C++ kernel splits them) next to empty ones."""
    check(backend, 3, 4, 1, 64, torch.float32, lengths=[2000, 0, 3, 1100, 1, 700], tail_extra=0)
    check(backend, 1, 4, 5, 128, torch.bfloat16, lengths=[1500, 7], tail_extra=2)


def test_sdpa_path_with_the_tail_exactly_the_queries():
    """A chunk over a compact cache: the tail holds only the chunk's queries (tail_len == q_len), long segments."""
    from kvpress_critical.ops.ragged_attention.torch_backend import SDPA_MIN_QUERIES

    for dtype in (torch.float32, torch.bfloat16):
        check("torch", 3, 4, 2 * SDPA_MIN_QUERIES, 64, dtype, lengths=[700, 0, 3, 1100, 1, 250], tail_extra=0)


def test_auto_prefers_cpp_for_decoding_and_torch_for_chunks_on_cpu(caplog, monkeypatch):
    """A preference by input shape, not a fallback: no warning either way."""
    from kvpress_critical.ops.ragged_attention import CPU_MULTI_QUERY

    if "cpp" not in RAGGED_ATTENTION.available("cpu"):
        pytest.skip(f"the C++ extension is unavailable: {cpp_availability()}")
    monkeypatch.delenv("KVPRESS_CRITICAL_ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv(RAGGED_ATTENTION.env_var, raising=False)
    decode, _ = make(1, 4, 1, 64, torch.float32)
    chunk, _ = make(1, 4, CPU_MULTI_QUERY, 64, torch.float32)
    with caplog.at_level("WARNING"):
        assert RAGGED_ATTENTION.resolve("auto", torch.device("cpu"), *decode) == "cpp"
        assert RAGGED_ATTENTION.resolve("auto", torch.device("cpu"), *chunk) == "torch"
        assert RAGGED_ATTENTION.resolve("cpp", torch.device("cpu"), *chunk) == "cpp"  # a named backend is kept
    assert not caplog.records


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_queries_that_see_nothing_get_zeros(backend):
    inputs, _ = make(1, 2, 3, 16, torch.float32, lengths=[0, 0], tail_extra=0)
    out = ragged_attention(*inputs, tail_len=1, scale=0.25, backend=backend)  # queries 0, 1 see no entry
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    torch.testing.assert_close(out, ragged_attention_ref(*inputs, tail_len=1, scale=0.25))


def test_strided_inputs():
    """Queries as transformers passes them (a transposed view) and packed entries with a row stride."""
    inputs, tail_len = make(3, 4, 2, 64, torch.float32)
    query = inputs[0].transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, q, d) view of (B, q, H, d) storage
    keys = torch.cat([inputs[1], inputs[1]], dim=1)[:, :64]  # row stride 128
    ref = ragged_attention_ref(*inputs, tail_len=tail_len, scale=0.125)
    for backend in CPU_BACKENDS:
        out = ragged_attention(query, keys, *inputs[2:], tail_len=tail_len, scale=0.125, backend=backend)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


TRITON_CASES = [(1, 1, 1, 64, torch.float32), (3, 4, 6, 80, torch.bfloat16), (3, 7, 1, 128, torch.float32)]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_triton_matches_reference(case):
    if not usable("triton"):
        pytest.skip(RAGGED_ATTENTION["triton"].availability() or "Triton does not run on this device here")
    check("triton", *case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gpu_backends_match_reference(dtype):
    probe = torch.empty(1, 64, dtype=dtype)  # flash-attn: 16-bit, head_dim a multiple of 8
    names = [n for n in ("triton", "flash") if usable(n) and RAGGED_ATTENTION[n].refusal(probe, probe) is None]
    if not names:
        pytest.skip("no GPU backend of the ragged attention is available")
    for name in names:
        for bsz in (1, 3):
            for group in (1, 4, 7):
                for q_len in (1, 6):
                    for head_dim in (64, 128):
                        check(name, bsz, group, q_len, head_dim, dtype)


# ---- quantized entries: codes and scales read by the kernels ------------------------------------------------------


# the formats of CompactCachePress, plus the other combinations the op takes: 8-bit asymmetric codes, per-channel
# 8-bit keys, symmetric keys with asymmetric per-channel values
SPECS = dict(
    FORMATS,
    asym8=(CodeSpec(8, symmetric=False), CodeSpec(8, symmetric=False)),
    channel8=(CodeSpec(8, symmetric=False, per_channel=True), CodeSpec(8)),
    mixed4=(CodeSpec(4), CodeSpec(4, symmetric=False, per_channel=True)),
)


def make_quantized(bsz, group, q_len, head_dim, dtype, fmt, **kw):
    """A layout whose context entries are codes: the float entries of make() quantized as ``fmt`` (a SPECS name),
    with rows of every magnitude and channels of different offsets (what per-channel scales are for)."""
    inputs, tail_len = make(bsz, group, q_len, head_dim, dtype, **kw)
    gen = torch.Generator().manual_seed(1)
    magnitude = 10 ** (torch.rand(inputs[1].shape[0], 1, generator=gen) * 2 - 1)  # rows from 0.1 to 10
    keys = inputs[1].float() * magnitude + torch.randn(head_dim, generator=gen)  # channel offsets
    values = inputs[2].float()
    if keys.shape[0]:
        keys[0] = 0  # an all-zero entry (scale 1 by convention)
    key_spec, value_spec = SPECS[fmt]
    inputs[1] = quantize_entries(keys, key_spec, inputs[3])
    inputs[2] = quantize_entries(values, value_spec, inputs[3])
    return inputs, tail_len


def check_quantized(backend, bsz, group, q_len, head_dim, dtype, fmt, **kw):
    inputs, tail_len = make_quantized(bsz, group, q_len, head_dim, dtype, fmt, **kw)
    scale = head_dim**-0.5
    ref = ragged_attention_ref(*inputs, tail_len=tail_len, scale=scale).double()  # over the dequantized entries
    moved = [t.to(DEVICE) for t in inputs]
    out = ragged_attention(*moved, tail_len=tail_len, scale=scale, backend=backend)
    assert out.shape == (bsz, q_len, 2 * group, head_dim) and out.dtype == dtype
    assert not torch.isnan(out).any(), f"{backend}: NaN (a read past the valid entries)"
    rtol, atol = ATTENTION_TOLERANCE[dtype]
    values_scale = max(float(inputs[2].dequantize().abs().max()) if inputs[2].shape[0] else 1.0, 1.0)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=0, atol=atol + rtol * values_scale)


# the grid of the quantized entries: every pair of values, every backend x format x head_dim (the code decoders; 20: no
# full vector of int4 bytes on AVX-512) and every backend x format x dtype; the full product with --full-grid
QUANTIZED_GRID = dict(
    backend=CPU_BACKENDS, bsz=[1, 3], q_len=[1, 6, 20], group=[1, 4, 7], head_dim=[64, 80, 128, 20],
    dtype=[torch.float32, torch.bfloat16], fmt=list(SPECS),
)  # fmt: skip
QUANTIZED_STRONGER = [("backend", "fmt", "head_dim"), ("backend", "fmt", "dtype")]


@pytest.mark.parametrize(",".join(QUANTIZED_GRID), grid(QUANTIZED_GRID, stronger=QUANTIZED_STRONGER))
def test_quantized_entries_match_the_reference(backend, bsz, q_len, group, head_dim, dtype, fmt):
    check_quantized(backend, bsz, q_len=q_len, group=group, head_dim=head_dim, dtype=dtype, fmt=fmt)


@pytest.mark.parametrize("fmt", list(SPECS))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quantized_long_unequal_segments(backend, fmt):
    """Segments split over several work items (cpp), one empty, with an odd head_dim: every code of every chunk read."""
    check_quantized(backend, 2, 4, 1, 72, torch.float32, fmt, lengths=[3000, 0, 17, 1029])


@pytest.mark.parametrize("fmt", list(SPECS))
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_triton_reads_quantized_entries(case, fmt):
    if not usable("triton"):
        pytest.skip(RAGGED_ATTENTION["triton"].availability() or "Triton does not run on this device here")
    check_quantized("triton", *case, fmt=fmt)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quantized_entries_are_never_dequantized_as_a_layer(backend, monkeypatch):
    """cpp reads the codes (no dequantization in Python at all); torch dequantizes one segment at a time."""
    inputs, tail_len = make_quantized(3, 4, 1, 64, torch.float32, "kivi4")
    ref = ragged_attention_ref(*inputs, tail_len=tail_len, scale=0.125)
    longest = int((inputs[3][1:] - inputs[3][:-1]).max())
    sizes = []
    original = QuantizedEntries.dequantize

    def spy(self, dtype=torch.float32):
        sizes.append(self.shape[0])
        return original(self, dtype)

    monkeypatch.setattr(QuantizedEntries, "dequantize", spy)
    out = ragged_attention(*inputs, tail_len=tail_len, scale=0.125, backend=backend)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if backend == "cpp":
        assert sizes == []
    else:
        assert sizes and max(sizes) <= longest < inputs[1].shape[0]


def test_quantized_entries_refuse_what_does_not_fit():
    codes = torch.zeros(5, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="must be torch.uint8"):
        QuantizedEntries(codes, torch.ones(5), 4, 16)
    with pytest.raises(ValueError, match="scales must be float32"):
        QuantizedEntries(codes, torch.ones(4), 8, 8)
    inputs, tail_len = make_quantized(1, 2, 1, 16, torch.float32, "int8")
    other = QuantizedEntries.quantize(inputs[2].dequantize(), 4)
    with pytest.raises(ValueError, match="8-bit codes but values 4-bit"):
        ragged_attention(inputs[0], inputs[1], other, *inputs[3:], tail_len=tail_len, scale=1.0)
    with pytest.raises(TypeError, match="both be tensors or both QuantizedEntries"):
        ragged_attention(inputs[0], inputs[1], inputs[2].dequantize(), *inputs[3:], tail_len=tail_len, scale=1.0)
    assert "quantized" in flash_backend.flash_supports(inputs[0].bfloat16(), inputs[1])


# ---- flash-attn's adapter, against a stand-in module with flash-attn's signatures --------------------------------


def _flash_reference(q, k, v, scale, causal, cu_q=None, cu_k=None):
    """flash-attn's semantics: (out, lse, None); an empty key set gives out 0 and lse +inf, as flash-attn 2 does."""
    outs, lses = [], []
    spans = (
        [(0, q.shape[0], 0, k.shape[0])]
        if cu_q is None
        else [(int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])) for i in range(len(cu_q) - 1)]
    )
    for q0, q1, k0, k1 in spans:
        qs, ks, vs = q[q0:q1].float(), k[k0:k1].float(), v[k0:k1].float()  # (Lq, Hq, d), (Lk, Hk, d)
        rep = qs.shape[1] // max(ks.shape[1], 1)
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:  # bottom-right aligned
            visible = (
                torch.arange(ks.shape[0])[None, :] <= (ks.shape[0] - qs.shape[0] + torch.arange(qs.shape[0]))[:, None]
            )
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # (H, Lq)
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", weights, vs).to(q.dtype))
        lses.append(torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse))
    return outs, lses


def _fake_flash_attn():
    module = types.ModuleType("flash_attn")

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, return_attn_probs=False):
        outs, lses = _flash_reference(q, k, v, softmax_scale, causal, cu_q, cu_k)
        return torch.cat(outs), torch.cat(lses, dim=1), None  # lse (H, total_q), as flash-attn 2.x

    def dense(q, k, v, softmax_scale=None, causal=False, return_attn_probs=False):  # (B, L, H, d)
        results = [_flash_reference(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])]
        return torch.stack([o[0] for o, _ in results]), torch.stack([lse[0] for _, lse in results]), None

    module.flash_attn_varlen_func, module.flash_attn_func = varlen, dense
    return module


@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("tail_extra", [0, 3])
def test_flash_adapter_against_a_stand_in(monkeypatch, q_len, tail_extra):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    inputs, tail_len = make(3, 4, q_len, 64, torch.bfloat16, tail_extra=tail_extra)  # empty segments included
    ref = ragged_attention_ref(*inputs, tail_len=tail_len, scale=0.125).double()
    out = flash_backend.ragged_attention_flash(*inputs, tail_len=tail_len, scale=0.125)
    rtol, atol = ATTENTION_TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=atol + rtol * float(inputs[2].abs().max()))


def test_flash_refuses_float32():
    assert "float16 / bfloat16" in flash_backend.flash_supports(torch.empty(1), torch.empty(1))
    assert (
        flash_backend.flash_supports(torch.empty(1, 64, dtype=torch.bfloat16), torch.empty(1, dtype=torch.bfloat16))
        is None
    )
    inputs, tail_len = make(1, 2, 1, 64, torch.float32)
    with pytest.raises(BackendUnavailableError):
        ragged_attention(*inputs, tail_len=tail_len, scale=0.125, backend="flash")


def test_dispatch():
    assert RAGGED_ATTENTION.resolve("auto", torch.device("cpu")) in ("cpp", "torch")
    if "cpp" in CPU_BACKENDS:
        assert RAGGED_ATTENTION.resolve("auto", torch.device("cpu")) == "cpp"
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        RAGGED_ATTENTION.resolve("nope", torch.device("cpu"))
    inputs, tail_len = make(1, 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens must have"):
        ragged_attention(inputs[0], inputs[1], inputs[2], inputs[3][:-1], *inputs[4:], tail_len=tail_len, scale=1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_attention(inputs[0][:, :3], *inputs[1:], tail_len=tail_len, scale=1.0)
    with pytest.raises(ValueError, match="capacity"):
        ragged_attention(*inputs, tail_len=100, scale=1.0)
    for bad in (inputs[3] + 1, inputs[3].flip(0), inputs[3] * 2 + 1):  # not from 0, decreasing, past the entries
        if not torch.equal(bad, inputs[3]):
            with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
                ragged_attention(inputs[0], inputs[1], inputs[2], bad, *inputs[4:], tail_len=tail_len, scale=1.0)


# ---- the C++ operator -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_len", [1, 5])
def test_opcheck(ops, dtype, q_len):
    """Schema, fake implementation and dispatch of kvpress_critical::ragged_attention (torch.library.opcheck)."""
    inputs, tail_len = make(3, 4, q_len, 16, dtype)
    inputs[4], inputs[5] = inputs[4].nan_to_num(), inputs[5].nan_to_num()  # opcheck compares NaN-free results
    torch.library.opcheck(ops.ragged_attention.default, (*inputs, tail_len, 0.25))


@pytest.mark.parametrize("fmt", list(SPECS))
def test_opcheck_quantized(ops, fmt):
    inputs, tail_len = make_quantized(3, 4, 2, 16, torch.bfloat16, fmt)
    k, v = inputs[1], inputs[2]
    tail_k, tail_v = inputs[4].nan_to_num(), inputs[5].nan_to_num()
    args = (inputs[0], k.codes, k.scales, k.zeros, k.groups, v.codes, v.scales, v.zeros, v.groups, k.bits, inputs[3])
    args += (tail_k, tail_v)
    torch.library.opcheck(ops.ragged_attention_quantized.default, (*args, tail_len, 0.25))


def test_fake_tensor_shape(ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        query = torch.empty(2, 32, 1, 128, dtype=torch.bfloat16)
        keys = torch.empty(5000, 128, dtype=torch.bfloat16)
        tail = torch.empty(2, 8, 16, 128, dtype=torch.bfloat16)
        cu = torch.zeros(17, dtype=torch.int64)
        out = ops.ragged_attention(query, keys, keys, cu, tail, tail, 1, 0.1)
    assert out.shape == (2, 1, 32, 128) and out.dtype == torch.bfloat16


def test_traces_under_torch_compile(ops):
    """The operator inside a compiled graph (fullgraph: no graph break) equals the eager call."""
    inputs, tail_len = make(3, 4, 1, 16, torch.float32)

    def attend(query, keys, values, cu, tail_keys, tail_values):
        return ops.ragged_attention(query, keys, values, cu, tail_keys, tail_values, tail_len, 0.25).sum(-1)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*inputs), attend(*inputs))


# ----------------------------------------------------------------------------------------------------------
# The compiled kernel: the interpreter runs the kernel's Python, the compiler accepts less (a loop-carried variable
# must keep its type), so every entry format is also compiled for sm_80 / sm_90 ahead of time (no GPU needed).


def test_triton_kernel_compiles_for_gpus_without_spilling():
    """Every entry format (float, int8, int4, kivi4) under fp32 / bf16 / fp16 queries, head sizes 64 / 128 / 256
    and a prefill chunk, compiled by Triton for sm_90 (and sm_80) with the launcher's configuration and assembled
    with ``ptxas -v``: it compiles (KIVI's per-channel keys once reused a kernel argument's name for the entries'
    groups inside the loop, which only the compiler rejects) and spills at most a few words."""
    from kvpress_critical.ops.triton_aot import RAGGED_CASES

    if RAGGED_ATTENTION["triton"].availability() is not None:
        pytest.skip(RAGGED_ATTENTION["triton"].availability())
    rows = triton_aot_rows("--op", "ragged_attention")
    assert len(rows) == sum(len(case[-1]) for case in RAGGED_CASES)
    assert {r["entries"] for r in rows} == {"float", "int8", "int4", "kivi4"}
    assert all(0 < r["registers"] <= 255 for r in rows)
    spilling = [r for r in rows if r["spill_stores"] > 64]
    assert not spilling, spilling
