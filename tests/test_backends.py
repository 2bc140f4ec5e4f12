"""Every fused backend of projected_value_norm against the float64 reference (the op alone: needs torch only, so it
runs on a GPU machine without kvpress; the press-level check is in test_backends_in_presses.py).

Backends: "cpp" (CPU, the C++ extension), "triton" (the Triton interpreter on CPU here, compiled on a GPU),
"cuda" (the CUDA extension, GPU only). Outputs are pre-filled with NaN, so an element a kernel never writes
fails the comparison. GPU-only cases skip with the reason where no CUDA device is visible.
"""

import pytest
import torch

from kvpress_critical.ops import projected_norm as dispatch
from kvpress_critical.ops import projected_value_norm, projected_value_norm_ref
from kvpress_critical.ops.projected_norm.cpp_backend import projected_value_norm_cpp
from kvpress_critical.ops.projected_norm.naive import UNIT_ROUNDOFF, projected_value_norm_error_bound
from kvpress_critical.ops.projected_norm.triton_backend import projected_value_norm_triton

# Tolerances are derived, not tuned: inputs of every dtype are exact in float32 (16-bit products too), so the only
# error is float32 accumulation, bounded per output by projected_value_norm_error_bound (Higham's gamma_n) with the
# unit roundoff of each backend's accumulation: IEEE round-to-nearest on CPU and in FMA kernels, one ulp per addition
# (truncation) on tensor cores, which the GPU kernels use for 16-bit operands of one dtype.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unit_roundoff(backend: str, dtype: torch.dtype) -> float:
    tensor_cores = backend in ("cuda", "triton") and dtype != torch.float32 and torch.cuda.is_available()
    return UNIT_ROUNDOFF["tensor_core" if tensor_cores else "ieee"]


def assert_within_bound(out, values, weight, heads, norm, backend, msg=""):
    """``|out - exact| <= bound`` elementwise, with the derived worst-case accumulation error as the bound."""
    values, weight = values.cpu(), weight.cpu()
    ref = projected_value_norm_ref(values, weight, heads, norm=norm).double()
    bound = projected_value_norm_error_bound(values, weight, heads, norm, unit_roundoff(backend, values.dtype))
    error = (out.cpu().double() - ref).abs()
    assert not torch.isnan(out).any(), f"{backend} {norm} {msg}: NaN in the output (an element was never written)"
    worst = (error / bound.clamp_min(1e-30)).max().item()
    assert bool((error <= bound).all()), f"{backend} {norm} {msg}: error up to {worst:.2f}x the derived bound"


TOKENS = (1, 7, 63, 129, 1000)
HEAD_DIMS = (64, 80, 128)
GROUPS = (1, 4, 7)
# 203 = 7 * 29: not a multiple of any tile size of any backend (CPU rows of 4/8, GPU tiles of 16..128)
HIDDEN = 203
NUM_KV_HEADS = 2

# backend name -> function taking an optional `out`
FUSED = {"cpp": projected_value_norm_cpp, "cuda": projected_value_norm_cpp, "triton": projected_value_norm_triton}
HAS_CUDA = torch.cuda.is_available()


_WEIGHTS: dict = {}


def make_weight(heads, head_dim, dtype, hidden=HIDDEN):
    """One o_proj weight per shape and dtype, reused, so its Gram factors (L2) are computed once per session."""
    key = (heads, head_dim, dtype, hidden)
    if key not in _WEIGHTS:
        gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
        _WEIGHTS[key] = (torch.randn(hidden, heads * head_dim, generator=gen) / head_dim**0.5).to(dtype)
    return _WEIGHTS[key]


def make_inputs(bsz, group, k_len, head_dim, dtype, contiguous, seed=0):
    """values (B, H_kv, T, d) — non-contiguous: (B, T, H_kv, 2d) storage, every other head_dim element — and weight."""
    gen = torch.Generator().manual_seed(seed)
    heads = NUM_KV_HEADS * group
    if contiguous:
        values = torch.randn(bsz, NUM_KV_HEADS, k_len, head_dim, generator=gen)
    else:
        values = torch.randn(bsz, k_len, NUM_KV_HEADS, 2 * head_dim, generator=gen).transpose(1, 2)[..., ::2]
    return values.to(dtype), make_weight(heads, head_dim, dtype), heads


def variants(k_len):
    """(batch, contiguous, norm) combinations run for a context length: both batch sizes, both layouts, both norms."""
    if k_len >= 1000:  # the reference costs most here: each of batch/layout/norm once
        return [(1, True, "l1"), (3, False, "l2")]
    return [(1, True, "l1"), (3, False, "l1"), (1, False, "l2"), (3, True, "l2")]


def run_fused(name, values, weight, heads, norm, out_layout="contiguous"):
    """Call a fused backend with a NaN-filled output buffer (contiguous or strided) and return that buffer."""
    bsz, num_kv_heads, k_len, _ = values.shape
    if out_layout == "contiguous":
        out = torch.full((bsz, num_kv_heads, k_len), float("nan"), device=values.device)
    else:  # (B, T, H_kv) storage seen as (B, H_kv, T)
        out = torch.full((bsz, k_len, num_kv_heads), float("nan"), device=values.device).transpose(1, 2)
    returned = FUSED[name](values, weight, heads, norm, out=out)
    assert returned.data_ptr() == out.data_ptr()
    return out


def usable(name):
    reason = dispatch._BACKENDS[name].availability()
    return reason is None, reason


def check_against_reference(names, device, dtype, k_len, head_dim, group):
    for seed, (bsz, contiguous, norm) in enumerate(variants(k_len)):
        values, weight, heads = make_inputs(bsz, group, k_len, head_dim, dtype, contiguous, seed=seed)
        for name in names:
            out = run_fused(name, values.to(device), weight.to(device), heads, norm)
            assert out.dtype == torch.float32 and out.shape == values.shape[:3]
            assert_within_bound(out, values, weight, heads, norm, name, f"{dtype} T={k_len} d={head_dim} G={group}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k_len", TOKENS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
def test_cpp_backend_matches_reference(dtype, k_len, head_dim, group):
    ok, reason = usable("cpp")
    if not ok:
        pytest.skip(reason)
    check_against_reference(["cpp"], "cpu", dtype, k_len, head_dim, group)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_backends_match_reference(dtype):
    """The CUDA extension and the compiled Triton kernel over the whole grid."""
    names = [n for n in ("cuda", "triton") if usable(n)[0]]
    if not names:
        pytest.skip(f"neither GPU backend is available: {usable('cuda')[1]}; {usable('triton')[1]}")
    for k_len in TOKENS:
        for head_dim in HEAD_DIMS:
            for group in GROUPS:
                check_against_reference(names, "cuda", dtype, k_len, head_dim, group)


@pytest.mark.parametrize("name", ["cpp", "triton"])
def test_strided_output_and_every_element_written(name):
    """A (B, T, H_kv)-major output view is written in place, every element (NaN-filled beforehand)."""
    ok, reason = usable(name)
    if not ok:
        pytest.skip(reason)
    device = "cuda" if HAS_CUDA and name != "cpp" else "cpu"
    values, weight, heads = make_inputs(3, 4, 37, 80, torch.float32, contiguous=False)
    for norm in ("l1", "l2"):
        out = run_fused(name, values.to(device), weight.to(device), heads, norm, out_layout="strided")
        torch.testing.assert_close(
            out.cpu(), projected_value_norm_ref(values, weight, heads, norm), rtol=2e-5, atol=1e-5
        )


def test_cpp_is_the_auto_choice_on_cpu():
    ok, reason = usable("cpp")
    if not ok:
        pytest.skip(reason)
    assert dispatch.resolve_backend("auto", torch.device("cpu")) == "cpp"
    values, weight, heads = make_inputs(1, 4, 9, 64, torch.float32, contiguous=True)
    torch.testing.assert_close(
        projected_value_norm(values, weight, heads), projected_value_norm(values, weight, heads, backend="cpp")
    )


def test_cuda_backend_requested_without_it_says_how_to_get_it():
    ok, reason = usable("cuda")
    if ok:
        pytest.skip("the CUDA backend is available here")
    values, weight, heads = make_inputs(1, 1, 3, 16, torch.float32, contiguous=True)
    with pytest.raises(dispatch.BackendUnavailableError, match="backend 'cuda' is not available") as err:
        projected_value_norm(values, weight, heads, backend="cuda")
    assert "kvpress-critical-build" in str(err.value) or "CUDA device" in str(err.value)


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_error_bound_catches_a_dropped_feature(norm):
    """The derived bound is loose enough for any summation order, yet far tighter than a real kernel bug."""
    values, weight, heads = make_inputs(3, 4, 129, 80, torch.bfloat16, False)
    exact = projected_value_norm_ref(values, weight, heads, norm=norm).double()
    bound = projected_value_norm_error_bound(values, weight, heads, norm, UNIT_ROUNDOFF["tensor_core"])
    assert bool((bound < 1e-3 * exact).all())  # at most 0.1% relative, even with truncating accumulation
    broken = weight.clone()
    broken[-1] = 0  # one output feature (of 203) skipped, as a kernel with a wrong tile mask would
    wrong = projected_value_norm_ref(values, broken, heads, norm=norm).double()
    assert bool(((wrong - exact).abs() > bound).float().mean() > 0.9)
