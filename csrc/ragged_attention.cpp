// kvpress_critical::ragged_attention: attention over the compact per-head KV layout, CPU implementation.
//
//   ragged_attention(query (B, H, q, d), keys (N, d), values (N, d), cu_seqlens (S + 1) int64,
//                    tail_keys (B, H_kv, C, d), tail_values (B, H_kv, C, d), tail_len, scale) -> (B, q, H, d)
//
// The context part of the cache is packed: segment s = b * H_kv + h holds the entries kept for batch row b and KV
// head h at rows cu_seqlens[s] .. cu_seqlens[s + 1] of keys / values (any length, 0 included, very unequal across
// heads). Tokens added later are a dense tail shared by all heads: the first tail_len of C reserved positions. The q
// queries are the last q tail tokens: query i sees every context entry of its segment and tail entries
// j <= tail_len - q + i (causal among the new tokens). GQA is handled inside: the G = H / H_kv query heads of a KV
// head are the rows of one problem with q tokens each (R = G * q rows), so K and V are read once per KV head and
// never copied. Softmax in float32 (online, log-sum-exp merged), any input float dtype, output in the query's dtype;
// a query that sees no entry gets zeros.
//
// Work items are (segment, chunk of its context entries) plus one item per segment for the tail, handed out through
// an atomic counter to at::parallel_for threads (so a few long heads do not serialise on one thread); each item
// writes its partial (max, sum, unnormalised output) per row, and a second pass merges the items of each segment.
// No padding is materialised: a segment's keys are read in place (fp32, unit stride) or converted block by block.

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
#include <limits>
#include <string>
#include <vector>

namespace kvpress_critical {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVPC_X86_ATTENTION 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
namespace attn_avx512 {
constexpr int VL = 16;
#include "cpu_attention_kernel.inc"
}  // namespace attn_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace attn_avx2 {
constexpr int VL = 8;
#include "cpu_attention_kernel.inc"
}  // namespace attn_avx2
#pragma GCC pop_options
#endif

namespace attn_generic {
constexpr int VL = 4;
#include "cpu_attention_kernel.inc"
}  // namespace attn_generic

struct AttentionIsa {
  void (*scores)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);
  void (*accumulate)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*);
  const char* name;
};

// The best micro-kernels the CPU supports, at most KVPRESS_CRITICAL_CPU_ISA when set (as for the projected norm).
const AttentionIsa& attention_isa() {
  static const AttentionIsa isa = [] {
    const char* env = std::getenv("KVPRESS_CRITICAL_CPU_ISA");
    const std::string cap = env != nullptr ? env : "avx512";
#ifdef KVPC_X86_ATTENTION
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const bool fma = __builtin_cpu_supports("fma");
    if (cap == "avx512" && avx512 && fma)
      return AttentionIsa{attn_avx512::attn_scores, attn_avx512::attn_accumulate, "avx512"};
    if (cap != "generic" && __builtin_cpu_supports("avx2") && fma)
      return AttentionIsa{attn_avx2::attn_scores, attn_avx2::attn_accumulate, "avx2"};
#endif
    return AttentionIsa{attn_generic::attn_scores, attn_generic::attn_accumulate, "generic"};
  }();
  return isa;
}

constexpr int64_t kKeyBlock = 32;     // keys per block: scores (R x 32) and the key / value blocks stay in L1
constexpr int64_t kMinChunk = 256;    // context entries per work item, at least
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t segment;
  int64_t begin, end;  // context rows [begin, end) of the segment, or tail positions for the tail item
  bool tail;
};

// dst[r * d + k] = float(src[r * s_r + k * s_k]) for r < rows
template <typename scalar_t>
void convert_rows(const scalar_t* src, int64_t s_r, int64_t s_k, int64_t rows, int64_t d, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < d; ++k) dst[r * d + k] = static_cast<float>(src[r * s_r + k * s_k]);
}

// A block of kb rows of a (rows, d) matrix as fp32 rows `ld` apart: in place when possible, else converted into buf.
const float* rows_as_float(const at::Tensor& t, const char* base, int64_t s_r, int64_t s_k, int64_t first, int64_t kb,
                           int64_t d, float* buf, int64_t& ld) {
  if (t.scalar_type() == at::kFloat && s_k == 1) {
    ld = s_r;
    return reinterpret_cast<const float*>(base) + first * s_r;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "ragged_attention_cpu", [&] {
    convert_rows(reinterpret_cast<const scalar_t*>(base) + first * s_r, s_r, s_k, kb, d, buf);
  });
  ld = d;
  return buf;
}

void check_args(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& cu,
                const at::Tensor& tail_keys, const at::Tensor& tail_values, int64_t tail_len) {
  TORCH_CHECK(query.dim() == 4, "kvpress_critical: query must be (batch, heads, q_len, head_dim), got ", query.sizes());
  TORCH_CHECK(keys.dim() == 2 && values.dim() == 2 && keys.sizes() == values.sizes(),
              "kvpress_critical: keys and values must be packed (entries, head_dim) of the same shape, got ",
              keys.sizes(), " and ", values.sizes());
  TORCH_CHECK(keys.size(1) == query.size(3), "kvpress_critical: head_dim of keys (", keys.size(1),
              ") differs from the query's (", query.size(3), ")");
  TORCH_CHECK(cu.dim() == 1 && cu.scalar_type() == at::kLong && cu.device().is_cpu(),
              "kvpress_critical: cu_seqlens must be a 1-D int64 CPU tensor");
  TORCH_CHECK(tail_keys.dim() == 4 && tail_keys.sizes() == tail_values.sizes(),
              "kvpress_critical: tail keys/values must be (batch, kv_heads, capacity, head_dim) of the same shape");
  const int64_t batch = query.size(0), kv_heads = tail_keys.size(1);
  TORCH_CHECK(tail_keys.size(0) == batch && tail_keys.size(3) == query.size(3),
              "kvpress_critical: tail keys have shape ", tail_keys.sizes(), ", expected (", batch, ", kv_heads, C, ",
              query.size(3), ")");
  TORCH_CHECK(kv_heads > 0 && query.size(1) % kv_heads == 0, "kvpress_critical: the query's ", query.size(1),
              " heads are not a multiple of the cache's ", kv_heads, " KV heads");
  TORCH_CHECK(cu.size(0) == batch * kv_heads + 1, "kvpress_critical: cu_seqlens has ", cu.size(0),
              " entries, expected batch * kv_heads + 1 = ", batch * kv_heads + 1);
  TORCH_CHECK(tail_len >= 0 && tail_len <= tail_keys.size(2), "kvpress_critical: tail_len ", tail_len,
              " outside the tail's capacity ", tail_keys.size(2));
  for (const at::Tensor* t : {&query, &keys, &values, &tail_keys, &tail_values})
    TORCH_CHECK(t->is_floating_point() && t->device().is_cpu(),
                "kvpress_critical: the CPU ragged attention takes floating-point CPU tensors");
}

at::Tensor ragged_attention_cpu(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                                const at::Tensor& cu_seqlens, const at::Tensor& tail_keys,
                                const at::Tensor& tail_values, int64_t tail_len, double scale) {
  check_args(query, keys, values, cu_seqlens, tail_keys, tail_values, tail_len);
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), d = query.size(3);
  const int64_t kv_heads = tail_keys.size(1), group = heads / kv_heads, segments = batch * kv_heads;
  const int64_t rows = group * q_len;  // problem rows of a segment: row r = g * q_len + i
  at::Tensor out = at::empty({batch, q_len, heads, d}, query.options());
  if (out.numel() == 0) return out;
  const at::Tensor cu = cu_seqlens.contiguous();
  const int64_t* cu_ptr = cu.const_data_ptr<int64_t>();
  const int64_t n_entries = keys.size(0);
  TORCH_CHECK(cu_ptr[0] == 0 && cu_ptr[segments] == n_entries, "kvpress_critical: cu_seqlens must start at 0 and end "
              "at the number of packed entries (", n_entries, "), got ", cu_ptr[0], " .. ", cu_ptr[segments]);

  // work items: context chunks of every segment, then one tail item per segment
  const int64_t threads = at::get_num_threads();
  const int64_t total = n_entries + segments * tail_len;
  const int64_t chunk = std::max<int64_t>(kMinChunk, (total + 4 * threads - 1) / (4 * threads));
  std::vector<Item> items;
  std::vector<int64_t> first_item(segments + 1, 0);
  for (int64_t s = 0; s < segments; ++s) {
    first_item[s] = static_cast<int64_t>(items.size());
    const int64_t length = cu_ptr[s + 1] - cu_ptr[s];
    TORCH_CHECK(length >= 0, "kvpress_critical: cu_seqlens must be non-decreasing");
    for (int64_t begin = 0; begin < length; begin += chunk) items.push_back({s, begin, std::min(length, begin + chunk), false});
    if (tail_len > 0) items.push_back({s, 0, tail_len, true});
  }
  first_item[segments] = static_cast<int64_t>(items.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
  // per item and row: max, sum, then the (rows, d) unnormalised output
  const int64_t slot = rows * (d + 2);
  at::Tensor partial = at::empty({std::max<int64_t>(n_items, 1) * slot}, query.options().dtype(at::kFloat));
  float* const part = partial.mutable_data_ptr<float>();

  const AttentionIsa& isa = attention_isa();
  const char* k_base = static_cast<const char*>(keys.const_data_ptr());
  const char* v_base = static_cast<const char*>(values.const_data_ptr());
  const char* tk_base = static_cast<const char*>(tail_keys.const_data_ptr());
  const char* tv_base = static_cast<const char*>(tail_values.const_data_ptr());
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  const float fscale = static_cast<float>(scale);

  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, std::max<int64_t>(n_items, 1));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // per-thread scratch through torch's allocator: scaled queries, converted key / value blocks, scores
    at::Tensor scratch = at::empty({rows * d + 2 * kKeyBlock * d + rows * kKeyBlock}, partial.options());
    float* const qs = scratch.mutable_data_ptr<float>();
    float* const kbuf = qs + rows * d;
    float* const vbuf = kbuf + kKeyBlock * d;
    float* const sc = vbuf + kKeyBlock * d;
    int64_t loaded_segment = -1;

    for (int64_t it = next.fetch_add(1); it < n_items; it = next.fetch_add(1)) {
      const Item item = items[it];
      const int64_t b = item.segment / kv_heads, kv = item.segment % kv_heads;
      if (item.segment != loaded_segment) {  // the segment's G * q query rows, scaled, in fp32
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "ragged_attention_q", [&] {
          const scalar_t* q = query.const_data_ptr<scalar_t>();
          for (int64_t g = 0; g < group; ++g)
            for (int64_t i = 0; i < q_len; ++i) {
              const scalar_t* src = q + b * query.stride(0) + (kv * group + g) * query.stride(1) + i * query.stride(2);
              float* dst = qs + (g * q_len + i) * d;
              for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<float>(src[k * query.stride(3)]) * fscale;
            }
        });
        loaded_segment = item.segment;
      }
      float* const m = part + it * slot;
      float* const l = m + rows;
      float* const acc = l + rows;
      std::fill(m, m + rows, kNegInf);
      std::fill(l, l + rows, 0.0f);
      std::fill(acc, acc + rows * d, 0.0f);

      for (int64_t j0 = item.begin; j0 < item.end; j0 += kKeyBlock) {
        const int64_t kb = std::min(kKeyBlock, item.end - j0);
        int64_t ldk, ldv;
        const float *kp, *vp;
        if (item.tail) {
          const int64_t tk0 = b * tail_keys.stride(0) + kv * tail_keys.stride(1);
          const int64_t tv0 = b * tail_values.stride(0) + kv * tail_values.stride(1);
          const char* tkb = tk_base + tk0 * tail_keys.element_size();
          const char* tvb = tv_base + tv0 * tail_values.element_size();
          kp = rows_as_float(tail_keys, tkb, tail_keys.stride(2), tail_keys.stride(3), j0, kb, d, kbuf, ldk);
          vp = rows_as_float(tail_values, tvb, tail_values.stride(2), tail_values.stride(3), j0, kb, d, vbuf, ldv);
        } else {
          const int64_t first = cu_ptr[item.segment] + j0;
          kp = rows_as_float(keys, k_base, ks0, ks1, first, kb, d, kbuf, ldk);
          vp = rows_as_float(values, v_base, vs0, vs1, first, kb, d, vbuf, ldv);
        }
        isa.scores(qs, rows, kp, ldk, kb, d, sc);  // (rows, kb)
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = sc + r * kb;
          if (item.tail) {  // query i sees tail positions <= tail_len - q_len + i
            const int64_t last = tail_len - q_len + r % q_len;
            for (int64_t j = 0; j < kb; ++j)
              if (j0 + j > last) sr[j] = kNegInf;
          }
          float block_max = kNegInf;
          for (int64_t j = 0; j < kb; ++j) block_max = std::max(block_max, sr[j]);
          const float new_max = std::max(m[r], block_max);
          if (new_max == kNegInf) {  // nothing visible yet in this row
            std::fill(sr, sr + kb, 0.0f);
            continue;
          }
          const float correction = std::exp(m[r] - new_max);  // exp(-inf) = 0 on the first visible block
          float sum = 0.0f;
          for (int64_t j = 0; j < kb; ++j) {
            sr[j] = std::exp(sr[j] - new_max);
            sum += sr[j];
          }
          l[r] = l[r] * correction + sum;
          if (correction != 1.0f) {
            float* ar = acc + r * d;
            for (int64_t k = 0; k < d; ++k) ar[k] *= correction;
          }
          m[r] = new_max;
        }
        isa.accumulate(sc, rows, vp, ldv, kb, d, acc);
      }
    }
  });

  // merge the items of every segment and write the output (B, q, H, d)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "ragged_attention_out", [&] {
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, segments * rows, 1, [&](int64_t start, int64_t stop) {
      std::vector<float> row(d);
      for (int64_t task = start; task < stop; ++task) {
        const int64_t s = task / rows, r = task % rows;
        const int64_t b = s / kv_heads, kv = s % kv_heads, g = r / q_len, i = r % q_len;
        float total_max = kNegInf;
        for (int64_t it = first_item[s]; it < first_item[s + 1]; ++it) total_max = std::max(total_max, part[it * slot + r]);
        std::fill(row.begin(), row.end(), 0.0f);
        float denominator = 0.0f;
        if (total_max != kNegInf) {
          for (int64_t it = first_item[s]; it < first_item[s + 1]; ++it) {
            const float* m = part + it * slot;
            if (m[r] == kNegInf) continue;
            const float w = std::exp(m[r] - total_max);
            denominator += w * m[rows + r];
            const float* a = m + 2 * rows + r * d;
            for (int64_t k = 0; k < d; ++k) row[k] += w * a[k];
          }
        }
        const float inv = denominator > 0.0f ? 1.0f / denominator : 0.0f;
        scalar_t* dst = o + ((b * q_len + i) * heads + kv * group + g) * d;
        for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<scalar_t>(row[k] * inv);
      }
    });
  });
  return out;
}

std::string attention_kernel_isa() { return attention_isa().name; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpress_critical, m) {
  m.def(
      "ragged_attention(Tensor query, Tensor keys, Tensor values, Tensor cu_seqlens, Tensor tail_keys, "
      "Tensor tail_values, int tail_len, float scale) -> Tensor");
  m.def("attention_kernel_isa() -> str", &attention_kernel_isa);
}

TORCH_LIBRARY_IMPL(kvpress_critical, CPU, m) { m.impl("ragged_attention", &ragged_attention_cpu); }

}  // namespace kvpress_critical
