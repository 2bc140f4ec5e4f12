"""Every fused backend of projected_value_norm against the float64 reference (the op alone: needs torch only, so it
runs on a GPU machine without kvpress; the press-level check is in test_backends_in_presses.py).

Backends: "cpp" (CPU, the C++ extension), "triton" (the Triton interpreter on CPU here, compiled on a GPU),
"cuda" (the CUDA extension, GPU only). Outputs are pre-filled with NaN, so an element a kernel never writes
fails the comparison. GPU-only cases skip with the reason where no CUDA device is visible.
"""

import pytest
import torch
from op_helpers import (
    DTYPES,
    GROUPS,
    HAS_CUDA,
    HEAD_DIMS,
    TOKENS,
    assert_within_bound,
    make_inputs,
    run_fused,
    usable,
    variants,
)

from kvpress_critical.ops import projected_norm as dispatch
from kvpress_critical.ops import projected_value_norm, projected_value_norm_ref
from kvpress_critical.ops.projected_value_norm.naive import UNIT_ROUNDOFF, projected_value_norm_error_bound


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
