"""The projected-value norm (CriticalKV's ``N_i``), over its registry: every backend against the float64 reference
over dtypes, head dimensions, GQA groups, batch sizes, odd and empty sizes and strided inputs; the dispatch
(explicit names, ``auto``, the environment variable); the C++ operators' schemas and fake implementations; the Triton
kernel in Triton's interpreter (without a GPU) and its tile table.

Outputs of the fused backends are pre-filled with NaN, so an element a kernel never writes fails the comparison.
GPU-only cases skip with the reason where no CUDA device is visible; the C++ operators' tests skip where the
extension cannot be compiled (it is compiled here by `make test`).
"""

import logging

import pytest
import torch
from covering import grid
from op_helpers import (
    DTYPES,
    GROUPS,
    HAS_CUDA,
    HEAD_DIMS,
    TOKENS,
    assert_within_bound,
    make_inputs,
    run_fused,
    small_inputs,
    triton_aot_rows,
    usable,
    variants,
)

from kvpress_critical.ops import Backend, BackendUnavailableError, triton_utils
from kvpress_critical.ops.projected_value_norm import (
    PROJECTED_VALUE_NORM,
    projected_value_norm,
    projected_value_norm_ref,
)
from kvpress_critical.ops.projected_value_norm import triton_backend as launcher
from kvpress_critical.ops.projected_value_norm.naive import UNIT_ROUNDOFF, projected_value_norm_error_bound
from kvpress_critical.ops.projected_value_norm.torch_backend import gram_factors, projected_value_norm_torch
from kvpress_critical.ops.triton_utils import triton_availability, triton_devices

# ---- the torch backend and the dispatch --------------------------------------------------------------------------

# Inputs are upcast exactly to float32, so the error is float32 accumulation only: one row per dtype.
TOLERANCES = {  # dtype: (rtol, atol)
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (2e-5, 1e-5),
    torch.float16: (2e-5, 1e-5),
}


def torch_inputs(bsz, num_kv_heads, group, k_len, head_dim, hidden, dtype, seed=0, contiguous=True):
    gen = torch.Generator().manual_seed(seed)
    heads = num_kv_heads * group
    if contiguous:
        values = torch.randn(bsz, num_kv_heads, k_len, head_dim, generator=gen)
    else:  # (B, T, H_kv, d) storage seen as (B, H_kv, T, d), plus a stride-2 slice of the head dim
        values = torch.randn(bsz, k_len, num_kv_heads, 2 * head_dim, generator=gen).transpose(1, 2)[..., ::2]
    weight = torch.randn(hidden, heads * head_dim, generator=gen) / head_dim**0.5
    return values.to(dtype), weight.to(dtype), heads


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_torch_backend_matches_reference(dtype, head_dim, group, norm):
    rtol, atol = TOLERANCES[dtype]
    for bsz, k_len, hidden, contiguous in [(1, 1, 200, True), (3, 7, 200, False), (1, 129, 328, True)]:
        values, weight, heads = torch_inputs(bsz, 2, group, k_len, head_dim, hidden, dtype, contiguous=contiguous)
        out = projected_value_norm(values, weight, heads, norm=norm, backend="torch")
        ref = projected_value_norm_ref(values, weight, heads, norm=norm)
        assert out.dtype == torch.float32 and out.shape == (bsz, 2, k_len)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_l2_gram_path_is_exact_for_ill_conditioned_weights():
    """The Gram factor path must not lose precision when W_O^h has a wide range of singular values."""
    values, weight, heads = torch_inputs(2, 2, 2, 33, 64, 96, torch.float32)
    u, _, vh = torch.linalg.svd(weight.double().view(96, heads, 64).transpose(0, 1), full_matrices=False)
    spectrum = torch.logspace(0, -4, 64, dtype=torch.float64)  # condition number 1e4 per head
    weight = (u * spectrum[None, None, :] @ vh).transpose(0, 1).reshape(96, heads * 64).float()
    out = projected_value_norm(values, weight, heads, norm="l2", backend="torch")
    torch.testing.assert_close(out, projected_value_norm_ref(values, weight, heads, norm="l2"), rtol=1e-5, atol=1e-7)


def test_chunking_is_exact_and_bounded(monkeypatch):
    """Tiles much smaller than T give the same result, and no V W_O tile exceeds the configured size."""
    values, weight, heads = torch_inputs(3, 2, 3, 257, 64, 100, torch.float32)
    full = projected_value_norm_torch(values, weight, heads, "l1")

    tile_mib = 0.01  # 2621 float32 elements -> 8 tokens of (B=3, D=100) per tile
    monkeypatch.setenv("KVPRESS_CRITICAL_TILE_MB", str(tile_mib))
    largest = []
    real_matmul = torch.matmul

    def spy(a, b):
        out = real_matmul(a, b)
        largest.append(out.numel())
        return out

    monkeypatch.setattr(torch, "matmul", spy)
    tiled = projected_value_norm_torch(values, weight, heads, "l1")
    monkeypatch.undo()
    torch.testing.assert_close(tiled, full, rtol=1e-6, atol=1e-6)
    assert len(largest) > heads, "expected several token tiles per head"
    assert max(largest) <= tile_mib * (1 << 20) / 4


def test_gram_factors_are_cached_and_invalidated_by_in_place_updates():
    _, weight, heads = torch_inputs(1, 2, 2, 1, 16, 40, torch.float32)
    first = gram_factors(weight, heads)
    assert gram_factors(weight, heads) is first
    per_head = weight.view(40, heads, 16).transpose(0, 1).double()  # (H, D, d)
    torch.testing.assert_close(
        first.double().transpose(1, 2) @ first.double(), per_head.transpose(1, 2) @ per_head, rtol=1e-5, atol=1e-6
    )
    weight.mul_(2)
    second = gram_factors(weight, heads)
    assert second is not first
    torch.testing.assert_close(second.abs(), 2 * first.abs(), rtol=1e-5, atol=1e-6)


def test_empty_context():
    values, weight, heads = torch_inputs(2, 2, 2, 0, 16, 40, torch.float32)
    assert projected_value_norm(values, weight, heads).shape == (2, 2, 0)


@pytest.mark.parametrize(
    "values_shape, weight_shape, heads, norm, match",
    [
        ((2, 16), (40, 32), 2, "l1", "values must be"),
        ((1, 2, 5, 16), (40,), 2, "l1", "o_proj_weight must be"),
        ((1, 2, 5, 16), (40, 48), 3, "l1", "multiple of the number of KV heads"),
        ((1, 2, 5, 16), (40, 48), 2, "l1", "input features"),
        ((1, 2, 5, 16), (40, 32), 2, "max", "norm must be"),
    ],
)
def test_bad_inputs(values_shape, weight_shape, heads, norm, match):
    with pytest.raises(ValueError, match=match):
        projected_value_norm(torch.randn(values_shape), torch.randn(weight_shape), heads, norm=norm)


def test_integer_inputs_are_rejected_with_a_hint():
    with pytest.raises(TypeError, match="dequantize"):
        projected_value_norm(torch.randn(1, 2, 5, 16), torch.ones(40, 32, dtype=torch.int8), 2)


@pytest.fixture
def fake_backends():
    """Register an unavailable 'cpp' and an available 'fake' backend; restore the registry afterwards."""
    saved, warned = dict(PROJECTED_VALUE_NORM.backends), set(PROJECTED_VALUE_NORM.warned)
    PROJECTED_VALUE_NORM.register(
        Backend("cpp", projected_value_norm_torch, ("cpu",), lambda: "not compiled: run `kvpress-critical-build`")
    )
    calls = []

    def fake(*args):
        calls.append(args)
        return projected_value_norm_torch(*args)

    PROJECTED_VALUE_NORM.register(Backend("fake", fake, ("cpu",), lambda: None))
    PROJECTED_VALUE_NORM.warned.clear()
    yield calls
    PROJECTED_VALUE_NORM.backends.clear()
    PROJECTED_VALUE_NORM.backends.update(saved)
    PROJECTED_VALUE_NORM.warned.clear()
    PROJECTED_VALUE_NORM.warned.update(warned)


def test_dispatch_names_and_errors(fake_backends):
    values, weight, heads = torch_inputs(1, 2, 2, 5, 16, 40, torch.float32)
    assert "torch" in PROJECTED_VALUE_NORM.available() and "fake" in PROJECTED_VALUE_NORM.available("cpu")
    assert "cpp" not in PROJECTED_VALUE_NORM.available()
    assert "torch" in PROJECTED_VALUE_NORM.available("cuda") and "fake" not in PROJECTED_VALUE_NORM.available("cuda")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        projected_value_norm(values, weight, heads, backend="nope")
    with pytest.raises(BackendUnavailableError, match="kvpress-critical-build"):
        projected_value_norm(values, weight, heads, backend="cpp")
    projected_value_norm(values, weight, heads, backend="fake")
    assert len(fake_backends) == 1


def test_auto_falls_back_with_one_warning(fake_backends, caplog):
    values, weight, heads = torch_inputs(1, 2, 2, 5, 16, 40, torch.float32)
    with caplog.at_level(logging.WARNING, logger="kvpress_critical.ops.registry"):
        projected_value_norm(values, weight, heads)
        projected_value_norm(values, weight, heads)
    warnings = [r for r in caplog.records if "'cpp' is not available" in r.getMessage()]
    assert len(warnings) == 1 and "kvpress-critical-build" in warnings[0].getMessage()
    assert PROJECTED_VALUE_NORM.resolve("auto", torch.device("cpu")) == "torch"


def test_environment_variable_selects_the_default_backend(fake_backends, monkeypatch):
    values, weight, heads = torch_inputs(1, 2, 2, 5, 16, 40, torch.float32)
    monkeypatch.setenv("KVPRESS_CRITICAL_PROJECTED_VALUE_NORM_BACKEND", "fake")
    projected_value_norm(values, weight, heads)
    assert len(fake_backends) == 1
    projected_value_norm(values, weight, heads, backend="torch")  # an explicit name wins
    assert len(fake_backends) == 1


def test_the_earlier_environment_variable_still_works_with_one_warning(fake_backends, monkeypatch, caplog):
    values, weight, heads = torch_inputs(1, 2, 2, 5, 16, 40, torch.float32)
    monkeypatch.setenv("KVPRESS_CRITICAL_BACKEND", "fake")
    with caplog.at_level(logging.WARNING, logger="kvpress_critical.ops.registry"):
        projected_value_norm(values, weight, heads)
        projected_value_norm(values, weight, heads)
    assert len(fake_backends) == 2
    renamed = [r for r in caplog.records if "KVPRESS_CRITICAL_PROJECTED_VALUE_NORM_BACKEND" in r.getMessage()]
    assert len(renamed) == 1


# ---- the fused backends against the reference -------------------------------------------------------------------


def check_against_reference(names, device, dtype, k_len, head_dim, group):
    for seed, (bsz, contiguous, norm) in enumerate(variants(k_len)):
        values, weight, heads = make_inputs(bsz, group, k_len, head_dim, dtype, contiguous, seed=seed)
        for name in names:
            out = run_fused(name, values.to(device), weight.to(device), heads, norm)
            assert out.dtype == torch.float32 and out.shape == values.shape[:3]
            assert_within_bound(out, values, weight, heads, norm, name, f"{dtype} T={k_len} d={head_dim} G={group}")


# every pair of values and every dtype x k_len x head_dim (the C++ kernel's tiles and their tails); the full product
# with --full-grid
CPP_GRID = dict(dtype=DTYPES, k_len=TOKENS, head_dim=HEAD_DIMS, group=GROUPS)


@pytest.mark.parametrize(",".join(CPP_GRID), grid(CPP_GRID, stronger=[("dtype", "k_len", "head_dim")]))
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
    assert PROJECTED_VALUE_NORM.resolve("auto", torch.device("cpu")) == "cpp"
    values, weight, heads = make_inputs(1, 4, 9, 64, torch.float32, contiguous=True)
    torch.testing.assert_close(
        projected_value_norm(values, weight, heads), projected_value_norm(values, weight, heads, backend="cpp")
    )


def test_cuda_backend_requested_without_it_says_how_to_get_it():
    ok, reason = usable("cuda")
    if ok:
        pytest.skip("the CUDA backend is available here")
    values, weight, heads = make_inputs(1, 1, 3, 16, torch.float32, contiguous=True)
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' is not available") as err:
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


# ---- the C++ operators ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(ops, dtype):
    """Schemas, fake implementations, and dispatch (torch.library.opcheck's full set of checks)."""
    values, weight, heads = small_inputs(dtype)
    head_proj = weight.view(weight.shape[0], heads, -1).permute(1, 0, 2)
    torch.library.opcheck(ops.head_projected_norm.default, (values, head_proj, "l1"))
    out = torch.empty(values.shape[:3])
    torch.library.opcheck(ops.head_projected_norm.out, (values, head_proj, "l2"), {"out": out})
    torch.library.opcheck(ops.projected_value_norm.default, (values, weight, heads, "l2"))


def test_fake_tensor_shapes(ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        values = torch.empty(3, 2, 1000, 128, dtype=torch.bfloat16)
        weight = torch.empty(4096, 8 * 128, dtype=torch.bfloat16)
        out = ops.projected_value_norm(values, weight, 8, "l1")
    assert out.shape == (3, 2, 1000) and out.dtype == torch.float32


def test_traces_under_torch_compile(ops):
    values, weight, heads = small_inputs()

    def score(v, w):
        return ops.projected_value_norm(v, w, heads, "l1").softmax(-1)

    compiled = torch.compile(score, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(values, weight), score(values, weight))
    longer, _, _ = small_inputs(k_len=23)  # dynamic shapes: no recompilation needed for another length
    torch.testing.assert_close(compiled(longer, weight), score(longer, weight))


def test_the_composite_op_reads_the_weight_as_stored(ops):
    """projected_value_norm(values, W, H) on the raw o_proj weight equals the reference for L1 and L2."""
    values, weight, heads = small_inputs()
    for norm in ("l1", "l2"):
        torch.testing.assert_close(
            ops.projected_value_norm(values, weight, heads, norm),
            projected_value_norm_ref(values, weight, heads, norm),
            rtol=2e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda v, p, o: (v[0], p, o), "values must be \\(batch, kv_heads, tokens, head_dim\\)"),
        (lambda v, p, o: (v, p[0], o), "head_proj must be \\(heads, out_features, head_dim\\)"),
        (lambda v, p, o: (v, p[..., :8], o), "head_dim of values \\(16\\) differs"),
        (lambda v, p, o: (v, p[:5], o), "must be a positive multiple of the number of KV heads"),
        (lambda v, p, o: (v, p, o.double()), "out must be float32"),
        (lambda v, p, o: (v, p, o[:, :, :3]), "out must have shape"),
        (lambda v, p, o: (v.int(), p, o), "must be floating point"),
    ],
)
def test_argument_checks_say_what_is_wrong(ops, mutate, match):
    values, weight, heads = small_inputs()
    head_proj = weight.view(weight.shape[0], heads, -1).permute(1, 0, 2)
    args = mutate(values, head_proj, torch.empty(values.shape[:3]))
    with pytest.raises(RuntimeError, match=match):
        ops.head_projected_norm.out(*args[:2], "l1", out=args[2])


def test_bad_norm_and_weight_shape(ops):
    values, weight, heads = small_inputs()
    with pytest.raises(RuntimeError, match="norm must be 'l1' or 'l2', got 'max'"):
        ops.projected_value_norm(values, weight, heads, "max")
    with pytest.raises(RuntimeError, match="input features"):
        ops.projected_value_norm(values, weight, heads + 2, "l1")


def test_empty_inputs(ops):
    values, weight, heads = small_inputs(k_len=0)
    assert ops.projected_value_norm(values, weight, heads, "l1").shape == (2, 2, 0)
    values, weight, heads = small_inputs(hidden=0)
    assert torch.equal(ops.projected_value_norm(values, weight, heads, "l1"), torch.zeros(2, 2, 11))


# ---- the Triton backend -----------------------------------------------------------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (batch, group, tokens, head_dim, dtype, contiguous, norm)
CASES = [
    (1, 1, 1, 64, torch.float32, True, "l1"),
    (3, 4, 7, 80, torch.bfloat16, False, "l2"),
    (1, 7, 63, 128, torch.float16, False, "l1"),
    (3, 1, 129, 80, torch.float32, True, "l2"),
    (1, 4, 129, 64, torch.bfloat16, True, "l1"),
    (3, 7, 7, 128, torch.float32, False, "l2"),
    (1, 1, 1000, 64, torch.float16, False, "l1"),
    (3, 1, 1000, 80, torch.bfloat16, True, "l2"),
]


@pytest.fixture(scope="module")
def triton_usable():
    reason = triton_availability()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
@pytest.mark.usefixtures("triton_usable")
def test_triton_matches_reference(case):
    bsz, group, k_len, head_dim, dtype, contiguous, norm = case
    values, weight, heads = make_inputs(bsz, group, k_len, head_dim, dtype, contiguous)
    out = run_fused("triton", values.to(DEVICE), weight.to(DEVICE), heads, norm)
    assert_within_bound(out, values, weight, heads, norm, "triton")


@pytest.mark.usefixtures("triton_usable")
def test_dispatch_runs_triton_on_cpu_tensors_only_under_the_interpreter(monkeypatch):
    values, weight, heads = make_inputs(1, 2, 5, 16, torch.float32, True)
    if not torch.cuda.is_available():
        assert triton_utils.interpreter_enabled() and "cpu" in triton_devices()
        out = projected_value_norm(values, weight, heads, backend="triton")
        torch.testing.assert_close(out, projected_value_norm_ref(values, weight, heads), rtol=2e-5, atol=1e-5)
    monkeypatch.setattr(triton_utils, "interpreter_enabled", lambda: False)
    assert triton_devices() == ("cuda",)
    with pytest.raises(BackendUnavailableError, match="runs on \\[.cuda.\\]|need a CUDA GPU"):
        projected_value_norm(values, weight, heads, backend="triton")
    if not torch.cuda.is_available():
        assert "TRITON_INTERPRET=1" in triton_availability()


@pytest.mark.usefixtures("triton_usable")
def test_interpreter_switched_on_after_import_is_reported(monkeypatch):
    monkeypatch.setattr(triton_utils, "interpreter_mismatch", lambda: True)
    assert "before starting Python" in triton_availability()


@pytest.mark.usefixtures("triton_usable")
def test_auto_never_picks_the_interpreter_on_cpu():
    assert PROJECTED_VALUE_NORM.resolve("auto", torch.device("cpu")) in ("cpp", "torch")


@pytest.mark.parametrize(
    "capability, sixteen_bit, head_dim, expected",
    [
        ((9, 0), True, 128, (128, 128, 8, None)),  # Hopper
        ((8, 0), True, 128, (64, 128, 4, 64)),  # Ampere
        ((8, 9), True, 256, (64, 64, 4, 64)),  # Ada, wide heads: half the feature tile
        ((9, 0), False, 128, (64, 64, 8, 8)),  # fp32 FMA dots: the head dimension in slices
        ((8, 0), False, 128, (64, 64, 8, 8)),
        ((7, 5), True, 128, (64, 64, 8, 8)),  # pre-Ampere: the fp32 configuration
    ],
)
@pytest.mark.usefixtures("triton_usable")
def test_tile_table_is_keyed_on_the_device(monkeypatch, capability, sixteen_bit, head_dim, expected):
    monkeypatch.setattr(launcher, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cfg = launcher.pick_config(torch.device("cuda"), sixteen_bit, head_dim, tokens=4096, features=4096)
    assert (cfg.block_t, cfg.block_n, cfg.num_warps, cfg.block_k) == expected


@pytest.fixture(scope="module")
def gpu_resource_usage():
    """ptxas -v of every launcher configuration for sm_80 and sm_90, compiled ahead of time without a GPU."""
    return triton_aot_rows("--arch", "80,90")


@pytest.mark.usefixtures("triton_usable")
def test_gpu_tiles_do_not_spill(gpu_resource_usage):
    """Every tile configuration of the launcher: no register spills on Ampere and Hopper (fp32 spilled 10 KB)."""
    from kvpress_critical.ops.triton_aot import CASES

    assert len(gpu_resource_usage) == 2 * len(CASES)
    spilling = [r for r in gpu_resource_usage if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, spilling
    assert all(0 < r["registers"] <= 255 for r in gpu_resource_usage)


@pytest.mark.usefixtures("triton_usable")
def test_sliced_head_dim_matches_reference(monkeypatch):
    """The fp32 GPU tiles take the head dimension in slices (block_k < head_dim): run that path in the interpreter."""
    real = launcher.pick_config

    def sliced(device, sixteen_bit, head_dim, tokens, features):
        return launcher.replace(real(device, sixteen_bit, head_dim, tokens, features), block_k=16)

    monkeypatch.setattr(launcher, "pick_config", sliced)
    for head_dim, norm in ((80, "l1"), (64, "l2")):
        values, weight, heads = make_inputs(3, 4, 37, head_dim, torch.float32, False)
        out = run_fused("triton", values.to(DEVICE), weight.to(DEVICE), heads, norm)
        assert_within_bound(out, values, weight, heads, norm, "triton", "block_k=16")


@pytest.mark.usefixtures("triton_usable")
def test_interpreter_tiles_never_exceed_the_problem():
    cfg = launcher.pick_config(torch.device("cpu"), False, 80, tokens=7, features=40)
    assert (cfg.block_t, cfg.block_n) == (16, 64)
