"""The Triton backend: the kernel against the reference, its device/interpreter rules, and its tile table.

Without a GPU the kernel runs in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set by conftest.py
before triton is imported). The interpreter multiplies in numpy, so the grid here is reduced to small shapes that
still cover every value of every axis (tokens, head_dim, group, batch, layout, norm, dtype) and every edge:
partial token and feature tiles, head_dim not a power of two. On a GPU, test_backends.py runs the full grid.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from op_helpers import assert_within_bound, make_inputs, run_fused

from kvpress_critical.ops import projected_norm as dispatch
from kvpress_critical.ops import projected_value_norm_ref, triton_utils
from kvpress_critical.ops.projected_value_norm import triton_backend as launcher
from kvpress_critical.ops.triton_utils import triton_availability, triton_devices

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
    assert_within_bound(out, values, weight, heads, norm, "triton")


def test_dispatch_runs_triton_on_cpu_tensors_only_under_the_interpreter(monkeypatch):
    values, weight, heads = make_inputs(1, 2, 5, 16, torch.float32, True)
    if not torch.cuda.is_available():
        assert triton_utils.interpreter_enabled() and "cpu" in triton_devices()
        out = dispatch.projected_value_norm(values, weight, heads, backend="triton")
        torch.testing.assert_close(out, projected_value_norm_ref(values, weight, heads), rtol=2e-5, atol=1e-5)
    monkeypatch.setattr(triton_utils, "interpreter_enabled", lambda: False)
    assert triton_devices() == ("cuda",)
    with pytest.raises(dispatch.BackendUnavailableError, match="runs on \\[.cuda.\\]|need a CUDA GPU"):
        dispatch.projected_value_norm(values, weight, heads, backend="triton")
    if not torch.cuda.is_available():
        assert "TRITON_INTERPRET=1" in triton_availability()


def test_interpreter_switched_on_after_import_is_reported(monkeypatch):
    monkeypatch.setattr(triton_utils, "interpreter_mismatch", lambda: True)
    assert "before starting Python" in triton_availability()


def test_auto_never_picks_the_interpreter_on_cpu():
    assert dispatch.resolve_backend("auto", torch.device("cpu")) in ("cpp", "torch")


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
def test_tile_table_is_keyed_on_the_device(monkeypatch, capability, sixteen_bit, head_dim, expected):
    monkeypatch.setattr(launcher, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cfg = launcher.pick_config(torch.device("cuda"), sixteen_bit, head_dim, tokens=4096, features=4096)
    assert (cfg.block_t, cfg.block_n, cfg.num_warps, cfg.block_k) == expected


@pytest.fixture(scope="module")
def gpu_resource_usage():
    """ptxas -v of every launcher configuration for sm_80 and sm_90, compiled ahead of time without a GPU.

    In a subprocess without TRITON_INTERPRET: the interpreter (on in this process) replaces what the compiler needs.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "kvpress_critical.ops.triton_aot", "--arch", "80,90"],
        capture_output=True,
        text=True,
        env=env,
    )
    if result.returncode != 0:
        if "ptxas" in result.stderr or "nvidia" in result.stderr.lower():
            pytest.skip(f"Triton cannot compile for NVIDIA GPUs ahead of time here: {result.stderr[-500:]}")
        raise AssertionError(result.stderr)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_gpu_tiles_do_not_spill(gpu_resource_usage):
    """Every tile configuration of the launcher: no register spills on Ampere and Hopper (fp32 spilled 10 KB)."""
    from kvpress_critical.ops.triton_aot import CASES

    assert len(gpu_resource_usage) == 2 * len(CASES)
    spilling = [r for r in gpu_resource_usage if r["spill_stores"] or r["spill_loads"]]
    assert not spilling, spilling
    assert all(0 < r["registers"] <= 255 for r in gpu_resource_usage)


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


def test_interpreter_tiles_never_exceed_the_problem():
    cfg = launcher.pick_config(torch.device("cpu"), False, 80, tokens=7, features=40)
    assert (cfg.block_t, cfg.block_n) == (16, 64)
