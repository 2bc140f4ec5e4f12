"""The torch backend of projected_value_norm against the float64 reference, and the dispatch function."""

import logging

import pytest
import torch

from kvpress_critical.ops import (
    Backend,
    BackendUnavailableError,
    available_backends,
    projected_value_norm,
    projected_value_norm_ref,
    register_backend,
)
from kvpress_critical.ops import projected_norm as dispatch
from kvpress_critical.ops.projected_value_norm.torch_backend import gram_factors, projected_value_norm_torch

# Inputs are upcast exactly to float32, so the error is float32 accumulation only: one row per dtype.
TOLERANCES = {  # dtype: (rtol, atol)
    torch.float32: (2e-5, 1e-5),
    torch.bfloat16: (2e-5, 1e-5),
    torch.float16: (2e-5, 1e-5),
}


def make_inputs(bsz, num_kv_heads, group, k_len, head_dim, hidden, dtype, seed=0, contiguous=True):
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
        values, weight, heads = make_inputs(bsz, 2, group, k_len, head_dim, hidden, dtype, contiguous=contiguous)
        out = projected_value_norm(values, weight, heads, norm=norm, backend="torch")
        ref = projected_value_norm_ref(values, weight, heads, norm=norm)
        assert out.dtype == torch.float32 and out.shape == (bsz, 2, k_len)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_l2_gram_path_is_exact_for_ill_conditioned_weights():
    """The Gram factor path must not lose precision when W_O^h has a wide range of singular values."""
    values, weight, heads = make_inputs(2, 2, 2, 33, 64, 96, torch.float32)
    u, _, vh = torch.linalg.svd(weight.double().view(96, heads, 64).transpose(0, 1), full_matrices=False)
    spectrum = torch.logspace(0, -4, 64, dtype=torch.float64)  # condition number 1e4 per head
    weight = (u * spectrum[None, None, :] @ vh).transpose(0, 1).reshape(96, heads * 64).float()
    out = projected_value_norm(values, weight, heads, norm="l2", backend="torch")
    torch.testing.assert_close(out, projected_value_norm_ref(values, weight, heads, norm="l2"), rtol=1e-5, atol=1e-7)


def test_chunking_is_exact_and_bounded(monkeypatch):
    """Tiles much smaller than T give the same result, and no V W_O tile exceeds the configured size."""
    values, weight, heads = make_inputs(3, 2, 3, 257, 64, 100, torch.float32)
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
    _, weight, heads = make_inputs(1, 2, 2, 1, 16, 40, torch.float32)
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
    values, weight, heads = make_inputs(2, 2, 2, 0, 16, 40, torch.float32)
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
    saved, warned = dict(dispatch._BACKENDS), set(dispatch._warned)
    register_backend(
        Backend("cpp", projected_value_norm_torch, ("cpu",), lambda: "not compiled: run `kvpress-critical-build`")
    )
    calls = []

    def fake(*args):
        calls.append(args)
        return projected_value_norm_torch(*args)

    register_backend(Backend("fake", fake, ("cpu",), lambda: None))
    dispatch._warned.clear()
    yield calls
    dispatch._BACKENDS.clear()
    dispatch._BACKENDS.update(saved)
    dispatch._warned.clear()
    dispatch._warned.update(warned)


def test_dispatch_names_and_errors(fake_backends):
    values, weight, heads = make_inputs(1, 2, 2, 5, 16, 40, torch.float32)
    assert "torch" in available_backends() and "fake" in available_backends("cpu")
    assert "cpp" not in available_backends()
    assert "torch" in available_backends("cuda") and "fake" not in available_backends("cuda")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        projected_value_norm(values, weight, heads, backend="nope")
    with pytest.raises(BackendUnavailableError, match="kvpress-critical-build"):
        projected_value_norm(values, weight, heads, backend="cpp")
    projected_value_norm(values, weight, heads, backend="fake")
    assert len(fake_backends) == 1


def test_auto_falls_back_with_one_warning(fake_backends, caplog):
    values, weight, heads = make_inputs(1, 2, 2, 5, 16, 40, torch.float32)
    with caplog.at_level(logging.WARNING, logger="kvpress_critical.ops.projected_value_norm"):
        projected_value_norm(values, weight, heads)
        projected_value_norm(values, weight, heads)
    warnings = [r for r in caplog.records if "'cpp' is not available" in r.getMessage()]
    assert len(warnings) == 1 and "kvpress-critical-build" in warnings[0].getMessage()
    assert dispatch.resolve_backend("auto", torch.device("cpu")) == "torch"


def test_environment_variable_selects_the_default_backend(fake_backends, monkeypatch):
    values, weight, heads = make_inputs(1, 2, 2, 5, 16, 40, torch.float32)
    monkeypatch.setenv("KVPRESS_CRITICAL_BACKEND", "fake")
    projected_value_norm(values, weight, heads)
    assert len(fake_backends) == 1
    projected_value_norm(values, weight, heads, backend="torch")  # an explicit name wins
    assert len(fake_backends) == 1
