// kvpress_critical::* operators: schemas, the CPU implementation, and the composite projected_value_norm.
//
//   head_projected_norm(values (B, H_kv, T, d), head_proj (H, N, d), norm) -> (B, H_kv, T) float32
//     out[b, kv, t] = mean over the G = H / H_kv query heads h of KV head kv (h // G == kv) of
//                     || values[b, kv, t] @ head_proj[h]^T ||_p
//   projected_value_norm(values, o_proj_weight (D, H * d), num_attention_heads, norm)
//     = head_projected_norm(values, o_proj_weight viewed as (H, D, d) without a copy, norm): CriticalKV's N_i.
//
// CPU implementation: a fused, register-blocked kernel (no BLAS call, so nothing nests inside the parallel loop).
// Work items are (KV head, batch row, tile of kTokenTile tokens), handed out dynamically to at::parallel_for
// threads. An item transposes its value tile into an fp32 buffer Vt (d, tokens) that stays in L1/L2 cache, then for
// each query head of the group and each tile of kFeatureTile output features computes
//   P^T[n, j] = sum_k head_proj[h][n, k] * Vt[k, j]
// in R x (C * VL) register blocks (R features x C vectors of VL tokens) and folds |P| (or P^2) straight from the
// registers into per-token fp32 accumulators. P = V W_O never exists in memory, not even as a tile.
// The micro-kernel is compiled for AVX-512, AVX2+FMA and the baseline ISA; the best one is picked at run time. With
// bfloat16 values and weights on a CPU with AVX512-BF16, a kernel on vdpbf16ps (cpu_tile_bf16_kernel.inc) works on
// bf16 pairs directly: two multiply-adds per fp32 lane and instruction, fp32 sums.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <c10/util/BFloat16.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "checks.h"

namespace kvpress_critical {
namespace {

// Tokens per work item (a multiple of every token block below: 48 = 3 x 16, 24 = 3 x 8, 12 = 3 x 4) and output
// features per projection tile: Vt (d x 192 fp32 = 96 KiB at d = 128) and a projection tile (512 x d = 256 KiB)
// stay in a 1 MiB L2 cache.
constexpr int64_t kTokenTile = 192;
constexpr int64_t kFeatureTile = 512;
constexpr int64_t kTokenPad = 48;  // Vt rows are padded (with zeros) to a multiple of the widest token block

// ---------------------------------------------------------------------------------------------------------------
// Micro-kernel (cpu_tile_kernel.inc), compiled once per ISA; the best one the CPU supports is picked at run time.

struct TileArgs {
  const float* vt;  // (d, ldv) transposed value tile, zero-padded to `cols` tokens
  int64_t ldv;
  int64_t cols;  // tokens to process, a multiple of C * VL
  const float* w;  // (rows, d) projection rows with row stride ldw; rows a multiple of R (zero-padded)
  int64_t ldw;
  int64_t rows;
  int64_t d;
  bool l1;  // accumulate |P| (L1) or P^2 (L2)
  float* acc;  // (cols,) per-token accumulators
};

struct TileBf16Args {
  const uint32_t* vt;  // (d2, ldv) pairs of bf16 values (v[2k, j], v[2k + 1, j]), zero-padded to `cols` tokens
  int64_t ldv;
  int64_t cols;
  const uint32_t* w;  // (rows, ldw) pairs of bf16 weights (w[n, 2k], w[n, 2k + 1]); rows a multiple of R
  int64_t ldw;
  int64_t rows;
  int64_t d2;  // ceil(head_dim / 2)
  bool l1;
  float* acc;
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPC_X86_KERNELS 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")
namespace avx512bf16 {
#include "cpu_tile_bf16_kernel.inc"
}  // namespace avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
namespace avx512 {
constexpr int VL = 16, R = 8, C = 3;  // 24 accumulators + 3 token vectors + 1 broadcast of 32 zmm registers
#include "cpu_tile_kernel.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
constexpr int VL = 8, R = 4, C = 3;  // 12 accumulators + 3 + 1 of 16 ymm registers
#include "cpu_tile_kernel.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace generic {
constexpr int VL = 4, R = 4, C = 3;
#include "cpu_tile_kernel.inc"
}  // namespace generic

struct KernelIsa {
  void (*fn)(const TileArgs&);
  int rows;  // R: projection rows per register block (tiles are padded to a multiple of it)
  const char* name;
  void (*bf16)(const TileBf16Args&) = nullptr;  // bf16 values and weights: AVX512-BF16 dot products, if available
  int bf16_rows = 1;
};

// The best micro-kernels the CPU supports, at most KVPRESS_CRITICAL_CPU_ISA ("avx512bf16", "avx512", "avx2" or
// "generic") when set.
const KernelIsa& kernel_isa() {
  static const KernelIsa isa = [] {
    const char* env = std::getenv("KVPRESS_CRITICAL_CPU_ISA");
    const std::string cap = env != nullptr ? env : "avx512bf16";
    TORCH_CHECK(cap == "avx512bf16" || cap == "avx512" || cap == "avx2" || cap == "generic",
                "kvpress_critical: KVPRESS_CRITICAL_CPU_ISA must be avx512bf16, avx512, avx2 or generic, got '", cap,
                "'");
#ifdef KVPC_X86_KERNELS
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const bool fma = __builtin_cpu_supports("fma");
    if (cap == "avx512bf16" && avx512 && fma && __builtin_cpu_supports("avx512bf16"))
      return KernelIsa{avx512::tile, avx512::R, "avx512+bf16", avx512bf16::tile_bf16, avx512bf16::R};
    if (cap.rfind("avx512", 0) == 0 && avx512 && fma) return KernelIsa{avx512::tile, avx512::R, "avx512"};
    if (cap != "generic" && __builtin_cpu_supports("avx2") && fma) return KernelIsa{avx2::tile, avx2::R, "avx2"};
#endif
    return KernelIsa{generic::tile, generic::R, "generic"};
  }();
  return isa;
}

// ---------------------------------------------------------------------------------------------------------------
// Tile preparation: conversion to fp32 (any input dtype, any strides) with zero padding.

// vt[k * ldv + j] = values[t0 + j, k] for j < t, 0 for t <= j < ldv.   src: (t, d) slice with strides (s_t, s_d).
template <typename scalar_t>
void transpose_values(const scalar_t* src, int64_t s_t, int64_t s_d, int64_t t, int64_t d, float* vt, int64_t ldv) {
  for (int64_t k = 0; k < d; ++k) {
    float* row = vt + k * ldv;
    for (int64_t j = 0; j < t; ++j) row[j] = static_cast<float>(src[j * s_t + k * s_d]);
    std::fill(row + t, row + ldv, 0.0f);
  }
}

// dst[n * d + k] = proj[n, k] for n < rows, 0 for rows <= n < rows_pad.   src: (rows, d) with strides (s_n, s_d).
template <typename scalar_t>
void copy_rows(const scalar_t* src, int64_t s_n, int64_t s_d, int64_t rows, int64_t rows_pad, int64_t d, float* dst) {
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t k = 0; k < d; ++k) dst[n * d + k] = static_cast<float>(src[n * s_n + k * s_d]);
  std::fill(dst + rows * d, dst + rows_pad * d, 0.0f);
}

inline uint32_t bf16_bits(const c10::BFloat16* p) { return p->x; }

// vt[k * ldv + j] = (values[j, 2k], values[j, 2k + 1]) as one uint32 (the low half first; 0 past head_dim) for j < t,
// 0 for t <= j < ldv: the pairs layout of the bf16 kernel.   src: (t, d) slice with strides (s_t, s_d).
void pack_value_pairs(const c10::BFloat16* src, int64_t s_t, int64_t s_d, int64_t t, int64_t d, uint32_t* vt,
                      int64_t ldv) {
  for (int64_t k = 0; 2 * k < d; ++k) {
    uint32_t* row = vt + k * ldv;
    const bool odd = 2 * k + 1 == d;
    for (int64_t j = 0; j < t; ++j) {
      const c10::BFloat16* e = src + j * s_t + 2 * k * s_d;
      row[j] = bf16_bits(e) | (odd ? 0u : bf16_bits(e + s_d) << 16);
    }
    std::fill(row + t, row + ldv, 0u);
  }
}

// dst[n * d2 + k] = (proj[n, 2k], proj[n, 2k + 1]) for n < rows, 0 for rows <= n < rows_pad.
void pack_row_pairs(const c10::BFloat16* src, int64_t s_n, int64_t s_d, int64_t rows, int64_t rows_pad, int64_t d,
                    uint32_t* dst) {
  const int64_t d2 = (d + 1) / 2;
  for (int64_t n = 0; n < rows; ++n)
    for (int64_t k = 0; k < d2; ++k) {
      const c10::BFloat16* e = src + n * s_n + 2 * k * s_d;
      dst[n * d2 + k] = bf16_bits(e) | (2 * k + 1 == d ? 0u : bf16_bits(e + s_d) << 16);
    }
  std::fill(dst + rows * d2, dst + rows_pad * d2, 0u);
}

template <typename scalar_t>
const scalar_t* typed_ptr(const at::Tensor& t) {
  return static_cast<const scalar_t*>(t.const_data_ptr());
}

void head_projected_norm_cpu_impl(const at::Tensor& values, const at::Tensor& head_proj, Norm norm, at::Tensor out) {
  const int64_t batch = values.size(0), kv_heads = values.size(1), tokens = values.size(2), d = values.size(3);
  const int64_t features = head_proj.size(1), group = head_proj.size(0) / kv_heads;
  if (out.numel() == 0) return;
  if (features == 0 || d == 0) {
    out.zero_();
    return;
  }
  const KernelIsa& isa = kernel_isa();
  // bf16 values and weights: AVX512-BF16 dot products on bf16 pairs, where the CPU has them; else fp32 FMAs
  const bool bf16 = isa.bf16 != nullptr && values.scalar_type() == at::kBFloat16 &&
                    head_proj.scalar_type() == at::kBFloat16;
  const int64_t block_rows = bf16 ? isa.bf16_rows : isa.rows;
  const int64_t d2 = (d + 1) / 2;
  const int64_t token_tiles = (tokens + kTokenTile - 1) / kTokenTile;
  const int64_t num_items = kv_heads * batch * token_tiles;
  // fp32 projections with unit stride along head_dim are read in place (any row stride: the o_proj weight as
  // stored), bf16 ones as pairs when both halves of a pair are adjacent and 4-byte aligned; others, and a last tile
  // whose rows are not a multiple of the register block, go through a per-thread buffer
  const bool proj_direct = head_proj.scalar_type() == at::kFloat && head_proj.stride(2) == 1;
  const bool pairs_direct = bf16 && head_proj.stride(2) == 1 && d % 2 == 0 && head_proj.stride(0) % 2 == 0 &&
                            head_proj.stride(1) % 2 == 0 &&
                            reinterpret_cast<uintptr_t>(head_proj.const_data_ptr()) % 4 == 0;
  const int64_t feature_tile = std::min(kFeatureTile, (features + block_rows - 1) / block_rows * block_rows);
  float* out_data = out.mutable_data_ptr<float>();
  const int64_t so_b = out.stride(0), so_h = out.stride(1), so_t = out.stride(2);
  const int64_t sv_b = values.stride(0), sv_h = values.stride(1), sv_t = values.stride(2), sv_d = values.stride(3);
  const int64_t sp_h = head_proj.stride(0), sp_n = head_proj.stride(1), sp_d = head_proj.stride(2);
  const float inv_group = 1.0f / static_cast<float>(group);

  // Items are ordered KV head first (consecutive items reuse the same projection rows) and handed out through an
  // atomic counter rather than in static chunks, so a thread delayed by another process does not hold the others.
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // Per-thread scratch, allocated through torch's CPU allocator (so memory profilers see it):
    //   vt (d, ldv) transposed value tile | wbuf (feature_tile, d) converted projection rows | 2 x (ldv,) accumulators
    const int64_t ldv = kTokenTile;  // multiple of kTokenPad
    at::Tensor scratch = at::empty({d * ldv + feature_tile * d + 2 * ldv}, values.options().dtype(at::kFloat));
    float* const vt = scratch.mutable_data_ptr<float>();
    float* const wbuf = vt + d * ldv;
    float* const head_acc = wbuf + feature_tile * d;
    float* const group_acc = head_acc + ldv;

    for (int64_t item = next_item.fetch_add(1); item < num_items; item = next_item.fetch_add(1)) {
      const int64_t kv = item / (batch * token_tiles);
      const int64_t b = (item / token_tiles) % batch;
      const int64_t t0 = (item % token_tiles) * kTokenTile;
      const int64_t t = std::min(kTokenTile, tokens - t0);
      const int64_t cols = (t + kTokenPad - 1) / kTokenPad * kTokenPad;

      if (bf16) {  // vt holds the (d2, ldv) pairs (as many 4-byte words as the fp32 tile has floats, at most)
        pack_value_pairs(typed_ptr<c10::BFloat16>(values) + b * sv_b + kv * sv_h + t0 * sv_t, sv_t, sv_d, t, d,
                         reinterpret_cast<uint32_t*>(vt), ldv);
      } else {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, values.scalar_type(), "head_projected_norm_cpu", [&] {
          transpose_values(typed_ptr<scalar_t>(values) + b * sv_b + kv * sv_h + t0 * sv_t, sv_t, sv_d, t, d, vt, ldv);
        });
      }
      std::fill(group_acc, group_acc + cols, 0.0f);

      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kv * group + g;
        float* acc = norm == Norm::L1 ? group_acc : head_acc;
        if (norm == Norm::L2) std::fill(head_acc, head_acc + cols, 0.0f);
        for (int64_t n0 = 0; n0 < features; n0 += feature_tile) {
          const int64_t rows = std::min(feature_tile, features - n0);
          const int64_t rows_pad = (rows + block_rows - 1) / block_rows * block_rows;
          if (bf16) {  // wbuf holds row pairs (fewer 4-byte words than the fp32 rows' floats)
            const c10::BFloat16* proj = typed_ptr<c10::BFloat16>(head_proj) + h * sp_h + n0 * sp_n;
            TileBf16Args args{reinterpret_cast<const uint32_t*>(vt), ldv, cols, nullptr, d2, rows_pad, d2,
                              norm == Norm::L1, acc};
            if (pairs_direct && rows == rows_pad) {
              args.w = reinterpret_cast<const uint32_t*>(proj);
              args.ldw = sp_n / 2;
            } else {
              pack_row_pairs(proj, sp_n, sp_d, rows, rows_pad, d, reinterpret_cast<uint32_t*>(wbuf));
              args.w = reinterpret_cast<const uint32_t*>(wbuf);
            }
            isa.bf16(args);
            continue;
          }
          TileArgs args{vt, ldv, cols, nullptr, d, rows_pad, d, norm == Norm::L1, acc};
          if (proj_direct && rows == rows_pad) {
            args.w = typed_ptr<float>(head_proj) + h * sp_h + n0 * sp_n;
            args.ldw = sp_n;
          } else {
            AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, head_proj.scalar_type(), "head_projected_norm_cpu",
                                            [&] {
                                              copy_rows(typed_ptr<scalar_t>(head_proj) + h * sp_h + n0 * sp_n, sp_n,
                                                        sp_d, rows, rows_pad, d, wbuf);
                                            });
            args.w = wbuf;
          }
          isa.fn(args);
        }
        if (norm == Norm::L2)
          for (int64_t j = 0; j < t; ++j) group_acc[j] += std::sqrt(head_acc[j]);
      }
      float* o = out_data + b * so_b + kv * so_h + t0 * so_t;
      for (int64_t j = 0; j < t; ++j) o[j * so_t] = group_acc[j] * inv_group;
    }
  });
}

void head_projected_norm_out_cpu(const at::Tensor& values, const at::Tensor& head_proj,
                                        c10::string_view norm, at::Tensor out) {
  const Norm p = parse_norm(norm);
  check_head_projected_norm_args(values, head_proj, out);
  TORCH_CHECK(values.device().is_cpu(), "kvpress_critical: the CPU kernel got values on ", values.device());
  head_projected_norm_cpu_impl(values, head_proj, p, out);
}

at::Tensor head_projected_norm_cpu(const at::Tensor& values, const at::Tensor& head_proj, c10::string_view norm) {
  at::Tensor out = new_output(values);
  head_projected_norm_out_cpu(values, head_proj, norm, out);
  return out;
}

// (D, H * d) o_proj weight -> (H, D, d) view: head h is W_O^h transposed, rows = output features. No copy for a
// weight with unit stride along its input features (every nn.Linear weight).
at::Tensor o_proj_head_view(const at::Tensor& values, const at::Tensor& o_proj_weight, int64_t num_attention_heads) {
  TORCH_CHECK(values.dim() == 4, "kvpress_critical: values must be (batch, kv_heads, tokens, head_dim), got shape ",
              values.sizes());
  TORCH_CHECK(o_proj_weight.dim() == 2,
              "kvpress_critical: o_proj_weight must be (hidden, heads * head_dim), got shape ", o_proj_weight.sizes());
  const int64_t head_dim = values.size(3), hidden = o_proj_weight.size(0);
  TORCH_CHECK(num_attention_heads > 0 && o_proj_weight.size(1) == num_attention_heads * head_dim,
              "kvpress_critical: o_proj_weight has ", o_proj_weight.size(1),
              " input features but num_attention_heads * head_dim = ", num_attention_heads, " * ", head_dim, " = ",
              num_attention_heads * head_dim);
  return o_proj_weight.reshape({hidden, num_attention_heads, head_dim}).permute({1, 0, 2});
}

at::Tensor projected_value_norm(const at::Tensor& values, const at::Tensor& o_proj_weight, int64_t num_attention_heads,
                                c10::string_view norm) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvpress_critical::head_projected_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>();
  return op.call(values, o_proj_head_view(values, o_proj_weight, num_attention_heads), norm);
}

std::string cpu_kernel_isa() { return kernel_isa().name; }

}  // namespace

TORCH_LIBRARY(kvpress_critical, m) {
  m.def("head_projected_norm(Tensor values, Tensor head_proj, str norm) -> Tensor");
  m.def("head_projected_norm.out(Tensor values, Tensor head_proj, str norm, *, Tensor(a!) out) -> ()");
  m.def("projected_value_norm(Tensor values, Tensor o_proj_weight, int num_attention_heads, str norm='l1') -> Tensor");
  m.def("cpu_kernel_isa() -> str", &cpu_kernel_isa);
}

TORCH_LIBRARY_IMPL(kvpress_critical, CPU, m) {
  m.impl("head_projected_norm", &head_projected_norm_cpu);
  m.impl("head_projected_norm.out", &head_projected_norm_out_cpu);
}

TORCH_LIBRARY_IMPL(kvpress_critical, CompositeImplicitAutograd, m) {
  m.impl("projected_value_norm", &projected_value_norm);
}

}  // namespace kvpress_critical
