"""The CPU's arithmetic peak, measured in the same run as the kernels it bounds (the projected-norm benchmark).

``arithmetic_peak(kind)``: FLOP/s of a loop of independent register-only multiply-adds on every torch thread: ``fp32``
(vfmadd, 16 chains of AVX-512 or AVX2 vectors: 2 FLOP per lane) or ``bf16`` (vdpbf16ps: 4 FLOP per fp32 lane). The
loop is compiled once (``torch.utils.cpp_extension.load_inline``, under ``$KVPRESS_CRITICAL_HOME/benchmark-limits``).
"""

from __future__ import annotations

import time

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <chrono>
#include <string>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
constexpr int kChains = 16;  // independent accumulators: more than FMA latency x ports

#if defined(__x86_64__)
__attribute__((target("avx512f,fma"))) float fp32_avx512(int64_t iterations) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + i);
  const __m512 b = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], b, c);
  float s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

__attribute__((target("avx2,fma"))) float fp32_avx2(int64_t iterations) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(1.0f + i);
  const __m256 b = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], b, c);
  alignas(32) float out[8];
  float s = 0;
  for (int i = 0; i < kChains; ++i) {
    _mm256_store_ps(out, acc[i]);
    for (float x : out) s += x;
  }
  return s;
}

__attribute__((target("avx512f,avx512bf16"))) float bf16_avx512(int64_t iterations) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1.0f + i);
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33003300);
  for (int64_t it = 0; it < iterations; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  float s = 0;
  for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}
#endif
}  // namespace

// FLOP/s of `iterations` loop trips on every torch thread (0 when the CPU lacks the instructions).
double arithmetic_peak(const std::string& kind, int64_t iterations) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  float (*loop)(int64_t) = nullptr;
  double flop_per_trip = 0;
  if (kind == "fp32" && avx512) { loop = fp32_avx512; flop_per_trip = kChains * 16 * 2.0; }
  else if (kind == "fp32" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    loop = fp32_avx2; flop_per_trip = kChains * 8 * 2.0;
  } else if (kind == "bf16" && avx512 && __builtin_cpu_supports("avx512bf16")) {
    loop = bf16_avx512; flop_per_trip = kChains * 16 * 4.0;
  }
  if (loop == nullptr) return 0.0;
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) sink[t] = loop(iterations);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return threads * iterations * flop_per_trip / seconds;
#else
  return 0.0;
#endif
}
"""

_MODULE = None


def _module():
    global _MODULE
    if _MODULE is None:
        from torch.utils.cpp_extension import load_inline

        from kvpress_critical.default_model import cache_home

        folder = cache_home() / "benchmark-limits"
        folder.mkdir(parents=True, exist_ok=True)
        _MODULE = load_inline(
            name="kvpress_critical_benchmark_limits",
            cpp_sources=[_SOURCE],
            functions=["arithmetic_peak"],
            extra_cflags=["-O2", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
        )
    return _MODULE


def arithmetic_peak(kind: str = "fp32", seconds: float = 0.3) -> float | None:
    """FLOP/s of register-only ``kind`` (``fp32`` or ``bf16``) multiply-adds on every torch thread, best of three
    runs of about ``seconds``; None where the CPU lacks the instructions."""
    module = _module()
    iterations = 1 << 16
    while True:  # calibrate to about `seconds` per run
        start = time.perf_counter()
        module.arithmetic_peak(kind, iterations)
        if time.perf_counter() - start >= seconds / 4 or iterations > 1 << 34:
            break
        iterations *= 4
    best = max(module.arithmetic_peak(kind, iterations) for _ in range(3))
    return best or None
