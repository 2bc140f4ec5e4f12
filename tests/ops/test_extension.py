"""The C++/CUDA extension that carries the ``cpp`` and ``cuda`` backends of both ops: every CPU instruction set it
compiles against the references, compilation on first use (the cache folder per torch / accelerator / Python /
sources, the lock, missing tools reported once), and the CUDA kernel compile-checked with nvcc.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from op_helpers import small_inputs

from kvpress_critical.ops import BackendUnavailableError
from kvpress_critical.ops import extension as ext
from kvpress_critical.ops.projected_value_norm import (
    PROJECTED_VALUE_NORM,
    projected_value_norm,
    projected_value_norm_ref,
)

REPO = Path(__file__).resolve().parents[2]
NAIVE = REPO / "kvpress_critical" / "ops" / "projected_value_norm" / "naive.py"
ATTENTION_NAIVE = REPO / "kvpress_critical" / "ops" / "ragged_attention" / "naive.py"
ATTENTION_LAYOUT = REPO / "kvpress_critical" / "ops" / "ragged_attention" / "layout.py"
PAGED_NAIVE = REPO / "kvpress_critical" / "ops" / "paged_ragged_attention" / "naive.py"


def test_every_cpu_instruction_set_matches_the_reference(ops):
    """AVX-512 (with and without the BF16 dot products), AVX2 and the generic micro-kernels of both ops against their
    float64 references (KVPRESS_CRITICAL_CPU_ISA caps the choice, read once per process): strided fp32 and bf16
    values for the projected norm; fp32, bf16 and half caches, a head_dim that is not a multiple of any vector width,
    the head sizes with compile-time addressing (64, 128) under and over a register block of rows, more query rows
    than head_dim (the scaled-probability scratch), causal query rows and a long split segment for the ragged
    attention, over float entries and over int8 / int4 codes and KIVI's layout; the paged op over fp8 codes (the
    vector loads, and the scalar ones under generic and for the last 4 elements of a head_dim of 68), and with a logits
    soft cap and attention sinks."""
    # loads the library and the reference modules by path: no package import (kvpress, transformers) per process
    script = (
        "import importlib.util, sys, torch\n"
        "def load(name, path):\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n"
        "    module = sys.modules[name] = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(module); return module\n"
        f"naive = load('naive', {str(NAIVE)!r})\n"
        f"attention = load('attention', {str(ATTENTION_NAIVE)!r})\n"
        f"layout = load('layout', {str(ATTENTION_LAYOUT)!r})\n"
        f"codes = load('codes', {str(ATTENTION_LAYOUT.parent / 'codes.py')!r})\n"
        f"torch.ops.load_library({str(ext.extension_state().path)!r})\n"
        "ops = torch.ops.kvpress_critical\n"
        "g = torch.Generator().manual_seed(0)\n"
        "v = torch.randn(3, 30, 2, 2 * 80, generator=g).transpose(1, 2)[..., ::2]\n"  # strided values
        "w = torch.randn(203, 8 * 80, generator=g) / 9\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    vd, wd = v.to(dtype), w.to(dtype)\n"
        "    for norm in ('l1', 'l2'):\n"
        "        out = ops.projected_value_norm(vd, wd, 8, norm)\n"
        "        ref = naive.projected_value_norm_ref(vd, wd, 8, norm)\n"
        "        torch.testing.assert_close(out, ref.float(), rtol=2e-5, atol=1e-5)\n"
        "for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-8), (torch.float16, 2**-10)):\n"
        "    shapes = ((72, 4, 3, [0, 37, 5, 300]), (128, 3, 1, [1700, 2]), (64, 7, 10, [90, 33]))\n"
        "    for d, group, q, lengths in shapes:\n"
        "        inputs = layout.random_layout(len(lengths) // 2, 2, group, q, d, lengths, q + 2, q + 6, dtype=dtype)\n"
        "        out = ops.ragged_attention(*inputs, q + 2, d ** -0.5)\n"
        "        ref = attention.ragged_attention_ref(*inputs, tail_len=q + 2, scale=d ** -0.5).double()\n"
        "        torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol * (1 + inputs[2].abs().max().item()))\n"
        "        for key_spec, value_spec in codes.FORMATS.values():\n"  # quantized entries: int8, int4, kivi4
        "            k = codes.quantize_entries(inputs[1], key_spec, inputs[3])\n"
        "            v = codes.quantize_entries(inputs[2], value_spec, inputs[3])\n"
        "            out = ops.ragged_attention_quantized(inputs[0], k.codes, k.scales, k.zeros, k.groups, v.codes, "
        "v.scales, v.zeros, v.groups, k.bits, inputs[3], *inputs[4:], q + 2, d ** -0.5)\n"
        "            ref = attention.ragged_attention_ref(inputs[0], k, v, *inputs[3:], q + 2, d ** -0.5).double()\n"
        "            bound = tol * (1 + v.dequantize().abs().max().item())\n"
        "            torch.testing.assert_close(out.double(), ref, rtol=0, atol=bound)\n"
        f"paged = load('paged', {str(PAGED_NAIVE)!r})\n"
        f"paged_layout = load('paged_layout', {str(PAGED_NAIVE.parent / 'layout.py')!r})\n"
        "for codes_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):\n"  # fp8 caches: the vector and scalar decoders
        "    for d in (64, 68):\n"
        "        inputs = paged_layout.random_paged_layout(2, 2, 3, 2, d, 8, [[5, 40], [17, 0]], [4, 11],\n"
        "                                                  cache_dtype=codes_dtype)\n"
        "        out = ops.paged_ragged_attention(*list(inputs.values())[:13], inputs['k_scale'], inputs['v_scale'])\n"
        "        ref = paged.paged_ragged_attention_ref(**inputs).double()\n"
        "        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)\n"
        "for d in (64, 68):\n"  # a logits soft cap (the vector tanh, and the scalar tail of 68) and attention sinks
        "    inputs = paged_layout.random_paged_layout(2, 2, 3, 2, d, 8, [[5, 40], [17, 0]], [4, 11])\n"
        "    inputs['query'] = inputs['query'] * 4\n"
        "    sinks = torch.linspace(-2, 3, 6)\n"
        "    out = ops.paged_ragged_attention(*list(inputs.values())[:13], 1.0, 1.0, 5.0, sinks)\n"
        "    ref = paged.paged_ragged_attention_ref(**inputs, soft_cap=5.0, sinks=sinks).double()\n"
        "    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)\n"
        "print(ops.cpu_kernel_isa(), ops.attention_kernel_isa())\n"
    )
    seen = {}
    for isa in ("avx512bf16", "avx512", "avx2", "generic"):
        env = {**os.environ, "KVPRESS_CRITICAL_CPU_ISA": isa}
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, (isa, run.stderr[-2000:])
        seen[isa] = run.stdout.strip().splitlines()[-1].split()
    assert seen["generic"] == ["generic", "generic"]
    assert seen["avx2"][0] in ("avx2", "generic") and seen["avx2"][1] == seen["avx2"][0]  # generic without AVX2
    assert seen["avx512"][0] in ("avx512", "avx2", "generic")
    assert seen["avx512bf16"][0] in ("avx512+bf16", "avx512", "avx2", "generic")
    assert ops.cpu_kernel_isa() == seen["avx512bf16"][0]  # the default: the best the CPU has


# ----------------------------------------------------------------------------------------------------------
# Compilation on first use: where the library is cached, what happens when a tool is missing.


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """An empty cache folder and a process that has not loaded the extension yet (the real state is restored)."""
    monkeypatch.setenv("KVPRESS_CRITICAL_HOME", str(tmp_path))
    monkeypatch.setattr(ext, "_STATE", None)
    monkeypatch.setattr(PROJECTED_VALUE_NORM, "warned", set())
    yield tmp_path


def test_the_cache_folder_is_per_torch_accelerator_python_and_sources(monkeypatch):
    tag = ext.build_tag(False)
    assert tag.startswith(f"torch{torch.__version__.replace('+', '_')}-cpu-py")
    assert tag.endswith(ext.sources_hash()[:16])
    assert ext.build_tag(False, "0" * 64) != tag  # other sources: another library, never a stale one
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert ext.build_tag(False) != tag and "torch9.9.9" in ext.build_tag(False)
    assert ext.library_path(False, "ab" * 32).parent.parent == ext.cache_root()


def test_a_missing_compiler_falls_back_once_and_says_what_to_install(fresh_state, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    reason = ext.cpp_availability()
    assert reason is not None and "no C++ compiler" in reason and "apt install g++" in reason
    values, weight, heads = small_inputs()
    with pytest.raises(BackendUnavailableError, match="backend 'cpp' is not available: .*no C\\+\\+ compiler"):
        projected_value_norm(values, weight, heads, backend="cpp")
    with caplog.at_level("WARNING"):
        for _ in range(3):
            out = projected_value_norm(values, weight, heads, backend="auto")
    torch.testing.assert_close(out, projected_value_norm_ref(values, weight, heads), rtol=2e-5, atol=1e-5)
    warnings = [r.getMessage() for r in caplog.records if "using backend 'torch'" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0]
    assert not any(fresh_state.rglob("*.so"))


def test_missing_ninja_and_compiling_switched_off_are_reported(fresh_state, monkeypatch):
    monkeypatch.setattr(ext, "_tool_path", lambda: str(fresh_state))  # no ninja on this PATH
    assert "pip install ninja" in ext.cpp_availability()
    monkeypatch.setattr(ext, "_STATE", None)
    monkeypatch.setenv("KVPRESS_CRITICAL_COMPILE", "0")
    reason = ext.cpp_availability()
    assert "KVPRESS_CRITICAL_COMPILE=0" in reason and "kvpress-critical-build" in reason
    with pytest.raises(BackendUnavailableError, match="kvpress-critical-build"):
        projected_value_norm(*small_inputs(), backend="cuda")


def test_parallel_first_uses_compile_once(tmp_path):
    """Two processes needing the extension at once in an empty cache: one compiles, the other waits for the lock and
    loads the library the first published. The compiler's child process is stood in for by one that waits 3 s and
    hands over this environment's library (compiled by `make build`): the lock, the publication and the loading are
    what is tested here; a real first-use compile is run by `make check-wheel` in a fresh venv."""
    built = ext.extension_state().path
    if built is None:
        pytest.skip(ext.cpp_availability())
    script = (
        "import logging, shutil, subprocess, sys, time, torch\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from kvpress_critical import projected_value_norm\n"
        "from kvpress_critical.ops import extension\n"
        "run = subprocess.run\n"
        "def compiler(command, **kwargs):\n"
        "    if '--compile-into' not in command:\n"
        "        return run(command, **kwargs)\n"
        "    time.sleep(3)  # the other process reaches the lock meanwhile\n"
        f"    shutil.copy({str(built)!r}, command[command.index('--compile-into') + 1])\n"
        "    return subprocess.CompletedProcess(command, 0, '', '')\n"
        "extension.subprocess.run = compiler\n"
        "v, w = torch.randn(1, 2, 9, 16), torch.randn(24, 4 * 16)\n"
        "torch.testing.assert_close(projected_value_norm(v, w, 4, backend='cpp'), projected_value_norm(v, w, 4, "
        "backend='torch'), rtol=2e-5, atol=1e-5)\n"
        "print('loaded', extension.extension_state().path)\n"
    )
    env = {**os.environ, "KVPRESS_CRITICAL_HOME": str(tmp_path)}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in outputs]
    libraries = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(libraries) == 1 and len(list(tmp_path.rglob("*.so"))) == 1
    assert str(tmp_path) in next(iter(libraries))  # the library published in the empty cache, not the original
    assert sum(err.count("compiled ") for _, err in outputs) == 1, [err[-2000:] for _, err in outputs]


def test_cuda_build_flag_fails_loudly_without_a_cuda_toolchain(monkeypatch):
    if ext.cuda_toolchain() is None:
        pytest.skip("CUDA can be compiled here")
    monkeypatch.setenv("KVPRESS_CRITICAL_BUILD_CUDA", "1")
    with pytest.raises(RuntimeError, match="KVPRESS_CRITICAL_BUILD_CUDA=1 but CUDA cannot be compiled"):
        ext.want_cuda()
    monkeypatch.setenv("KVPRESS_CRITICAL_BUILD_CUDA", "0")
    assert ext.want_cuda() is False


@pytest.mark.skipif(shutil.which(os.environ.get("NVCC", "nvcc")) is None, reason="nvcc is not installed")
def test_cuda_kernel_compiles_for_ampere_and_hopper():
    """`make check-cuda`: the .cu with nvcc alone for sm_80 and sm_90, and the torch binding against torch's headers."""
    run = subprocess.run(
        ["bash", str(REPO / "csrc" / "check_cuda.sh"), sys.executable], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "compiles for sm_80, sm_90" in run.stderr
