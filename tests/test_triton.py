"""The Triton backend: the kernel against the reference, its device/interpreter rules, and its tile table.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set by conftest.py
before triton is imported). The interpreter multiplies in numpy, so the grid here is reduced to small shapes that
still cover every value of every axis (tokens, head_dim, group, batch, layout, norm, dtype) and every edge:
partial token and feature tiles, head_dim not a power of two. On a GPU, test_backends.py runs the full grid.
"""

import pytest
import torch
from test_backends import TOLERANCES, make_inputs, run_fused

from kvpress_critical.ops import projected_norm as dispatch
from kvpress_critical.ops import projected_value_norm_ref
from kvpress_critical.ops.triton_backend import kernel, launcher, triton_availability, triton_devices

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


@pytest.fixture(scope="module", autouse=True)
def triton_usable():
    reason = triton_availability()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_triton_matches_reference(case):
    bsz, group, k_len, head_dim, dtype, contiguous, norm = case
    values, weight, heads = make_inputs(bsz, group, k_len, head_dim, dtype, contiguous)
    out = run_fused("triton", values.to(DEVICE), weight.to(DEVICE), heads, norm)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu(), projected_value_norm_ref(values, weight, heads, norm), rtol=rtol, atol=atol)


def test_dispatch_runs_triton_on_cpu_tensors_only_under_the_interpreter(monkeypatch):
    values, weight, heads = make_inputs(1, 2, 5, 16, torch.float32, True)
    if not torch.cuda.is_available():
        assert kernel.interpreter_enabled() and "cpu" in triton_devices()
        out = dispatch.projected_value_norm(values, weight, heads, backend="triton")
        torch.testing.assert_close(out, projected_value_norm_ref(values, weight, heads), rtol=2e-5, atol=1e-5)
    monkeypatch.setattr(kernel, "interpreter_enabled", lambda: False)
    assert triton_devices() == ("cuda",)
    with pytest.raises(dispatch.BackendUnavailableError, match="runs on \\[.cuda.\\]|need a CUDA GPU"):
        dispatch.projected_value_norm(values, weight, heads, backend="triton")
    if not torch.cuda.is_available():
        assert "TRITON_INTERPRET=1" in triton_availability()


def test_interpreter_switched_on_after_import_is_reported(monkeypatch):
    monkeypatch.setattr(kernel, "interpreter_mismatch", lambda: True)
    assert "before starting Python" in triton_availability()


def test_auto_never_picks_the_interpreter_on_cpu():
    assert dispatch.resolve_backend("auto", torch.device("cpu")) in ("cpp", "torch")


@pytest.mark.parametrize(
    "capability, sixteen_bit, head_dim, expected",
    [
        ((9, 0), True, 128, (128, 128, 8)),  # Hopper
        ((8, 0), True, 128, (64, 128, 4)),  # Ampere
        ((8, 9), True, 256, (64, 64, 4)),  # Ada, wide heads: half the feature tile
        ((8, 0), False, 128, (32, 64, 4)),  # fp32 ieee dots: smaller tiles
        ((7, 5), True, 128, (32, 64, 4)),  # pre-Ampere: the conservative configuration
    ],
)
def test_tile_table_is_keyed_on_the_device(monkeypatch, capability, sixteen_bit, head_dim, expected):
    monkeypatch.setattr(launcher, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cfg = launcher.pick_config(torch.device("cuda"), sixteen_bit, head_dim, tokens=4096, features=4096)
    assert (cfg.block_t, cfg.block_n, cfg.num_warps) == expected


def test_interpreter_tiles_never_exceed_the_problem():
    cfg = launcher.pick_config(torch.device("cpu"), False, 80, tokens=7, features=40)
    assert (cfg.block_t, cfg.block_n) == (16, 64)
