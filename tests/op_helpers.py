"""Shared utilities of the op tests: projected_value_norm's inputs, fused calls and derived error bounds; the
ahead-of-time compilation of the Triton kernels for GPUs.

Needs torch only, like the op tests themselves, so that they run on a GPU machine without kvpress.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from kvpress_critical.ops.projected_value_norm import PROJECTED_VALUE_NORM, projected_value_norm_ref
from kvpress_critical.ops.projected_value_norm.cpp_backend import projected_value_norm_cpp
from kvpress_critical.ops.projected_value_norm.naive import UNIT_ROUNDOFF, projected_value_norm_error_bound
from kvpress_critical.ops.projected_value_norm.triton_backend import projected_value_norm_triton

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
    reason = PROJECTED_VALUE_NORM[name].availability()
    return reason is None, reason


def small_inputs(dtype=torch.float32, bsz=2, group=3, k_len=11, head_dim=16, hidden=40):
    """A small (values, weight, heads) case for the C++ operators' checks."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(bsz, 2, k_len, head_dim, generator=gen).to(dtype)
    weight = (torch.randn(hidden, 2 * group * head_dim, generator=gen) / 4).to(dtype)
    return values, weight, 2 * group


def triton_aot_rows(*args: str) -> list[dict]:
    """The rows of ``python -m kvpress_critical.ops.triton_aot *args``: Triton kernels compiled for NVIDIA GPUs and
    assembled with ``ptxas -v``, no GPU needed. Skips the test where Triton cannot compile for NVIDIA GPUs here.

    In a subprocess without TRITON_INTERPRET: the interpreter (on in the test process) replaces what the compiler needs.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "kvpress_critical.ops.triton_aot", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if run.returncode != 0:
        if "ptxas" in run.stderr or "nvidia" in run.stderr.lower():
            pytest.skip(f"Triton cannot compile for NVIDIA GPUs ahead of time here: {run.stderr[-500:]}")
        raise AssertionError(run.stderr[-3000:])
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
