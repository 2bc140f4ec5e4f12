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
// No padding is materialised: K and V stream from memory once, read in place in fp32 or converted in registers from
// bfloat16 / half (cpu_attention_kernel.inc: vectorised scores, exp and output update, VL keys at a time).
//
//   ragged_attention_quantized(query, key_codes, key_scales, key_zeros?, key_groups?, value_codes, value_scales,
//                              value_zeros?, value_groups?, bits, cu_seqlens, tail_keys, tail_values, tail_len,
//                              scale) -> (B, q, H, d)
//
// The same over quantized context entries (kvpress_critical/ops/ragged_attention/codes.py): 8-bit codes (N, d) or
// 4-bit codes two a byte (N, ceil(d / 2)), symmetric or asymmetric (zeros), with one fp32 scale per entry or one per
// channel of a group of entries (groups: KIVI's key layout). Each block of VL entries is dequantized once into L1
// (float(code) * scale (+ zero), the value the Python codec gives) and attended as fp32 entries: the codes are the
// only bytes read from memory, and no float copy of the layer is made.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace kvpress_critical {
namespace {

// One tensor's quantized entries as the micro-kernels read them (kvpress_critical/ops/ragged_attention/codes.py).
struct CodeView {
  const uint8_t* codes;    // entry e's codes at codes + e * ld (int8 / uint8, or 4-bit nibbles two a byte)
  int64_t ld;              // bytes between entries
  const float* scales;     // (N,) per entry, or (G, d) per channel of a group
  const float* zeros;      // nullptr: symmetric codes; else the shape of scales (asymmetric: x = zero + code * scale)
  const int32_t* groups;   // nullptr: per entry; else (N,) the group (row of scales / zeros) of every entry
  int bits;                // 8 or 4
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define KVPC_X86_ATTENTION 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")
namespace attn_avx512 {
#define KVPC_VL 16
#define KVPC_F16_VECTOR 1
#include "cpu_attention_kernel.inc"
#undef KVPC_F16_VECTOR
#undef KVPC_VL
}  // namespace attn_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace attn_avx2 {
#define KVPC_VL 8
#define KVPC_F16_VECTOR 1
#include "cpu_attention_kernel.inc"
#undef KVPC_F16_VECTOR
#undef KVPC_VL
}  // namespace attn_avx2
#pragma GCC pop_options
#endif

namespace attn_generic {
#define KVPC_VL 4
#include "cpu_attention_kernel.inc"
#undef KVPC_VL
}  // namespace attn_generic

using AttendFn = void (*)(const float*, int64_t, int64_t, const void*, int64_t, const void*, int64_t, int64_t,
                          const int64_t*, float*, float*, float*, float*, float);
using AttendCodesFn = void (*)(const float*, int64_t, int64_t, const CodeView&, const CodeView&, int64_t, int64_t,
                               float*, float*, float*, float*);

struct AttentionIsa {
  AttendFn f32, bf16, f16;         // one work item, by the dtype of the cache
  AttendFn fp8_e4m3, fp8_e5m2;     // over fp8 codes (paged_ragged_attention)
  AttendCodesFn codes;             // one context work item over quantized entries
  const char* name;
};

#define KVPC_ATTENTION_ISA(ns, label) \
  AttentionIsa{ns::attend_f32, ns::attend_bf16, ns::attend_f16, ns::attend_fp8_e4m3, ns::attend_fp8_e5m2, \
               ns::attend_codes, label}

// The best micro-kernels the CPU supports, at most KVPRESS_CRITICAL_CPU_ISA when set (as for the projected norm).
const AttentionIsa& attention_isa() {
  static const AttentionIsa isa = [] {
    const char* env = std::getenv("KVPRESS_CRITICAL_CPU_ISA");
    const std::string cap = env != nullptr ? env : "avx512";
#ifdef KVPC_X86_ATTENTION
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const bool fma = __builtin_cpu_supports("fma"), f16c = __builtin_cpu_supports("f16c");
    if (cap == "avx512" && avx512 && fma && f16c) return KVPC_ATTENTION_ISA(attn_avx512, "avx512");
    if (cap != "generic" && __builtin_cpu_supports("avx2") && fma && f16c) return KVPC_ATTENTION_ISA(attn_avx2, "avx2");
#endif
    return KVPC_ATTENTION_ISA(attn_generic, "generic");
  }();
  return isa;
}

constexpr int64_t kMinChunk = 256;  // context entries per work item, at least
constexpr int64_t kMaxVL = 16;      // the widest vector of the micro-kernels (their scratch is sized for it)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Item {
  int64_t segment;
  int64_t begin, end;  // context rows [begin, end) of the segment, or tail positions for the tail item
  bool tail;
};

// The micro-kernels read rows with unit stride along head_dim, in fp32, bf16 or half (others are converted).
at::Tensor kernel_layout(const at::Tensor& t) {
  at::Tensor x = t;
  const auto dtype = x.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) x = x.to(at::kFloat);
  return x.stride(-1) == 1 ? x : x.contiguous();
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

// The packed context entries as the work items read them: fp32 / bf16 / half rows, or int8 / int4 codes with one
// fp32 scale per entry.
struct Context {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t ldk = 0, ldv = 0;  // row strides, in elements
  int64_t esize = 0;         // bytes per element
  AttendFn attend = nullptr;             // float rows
  AttendCodesFn attend_codes = nullptr;  // codes
  CodeView k_codes{}, v_codes{};
};

// The G * q query rows of segment (b, kv), scaled, in fp32: row g * q + i at qs + (g * q + i) * d.
void load_queries(const at::Tensor& query, int64_t b, int64_t kv, int64_t group, float fscale, float* qs) {
  const int64_t q_len = query.size(2), d = query.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "ragged_attention_q", [&] {
    const scalar_t* q = query.const_data_ptr<scalar_t>();
    for (int64_t g = 0; g < group; ++g)
      for (int64_t i = 0; i < q_len; ++i) {
        const scalar_t* src = q + b * query.stride(0) + (kv * group + g) * query.stride(1) + i * query.stride(2);
        float* dst = qs + (g * q_len + i) * d;
        for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<float>(src[k * query.stride(3)]) * fscale;
      }
  });
}

// Merge the partial results (max, sum, unnormalised output per row, `slot` floats an item) of every segment's items
// first_item[s] .. first_item[s + 1] - 1 by their log-sum-exp and write out (B, q, H, d); rows that saw nothing: 0.
void merge_items(const float* part, int64_t slot, const std::vector<int64_t>& first_item, int64_t kv_heads,
                 at::Tensor& out, float out_scale = 1.0f, const float* sinks = nullptr) {
  const int64_t q_len = out.size(1), heads = out.size(2), d = out.size(3), group = heads / kv_heads;
  const int64_t rows = group * q_len, segments = out.size(0) * kv_heads;
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
        // a sink (one logit per query head, no value): one more term of the denominator, exp(sink - max); with
        // nothing visible the row stays 0
        if (sinks != nullptr && denominator > 0.0f) denominator += std::exp(sinks[kv * group + g] - total_max);
        const float inv = denominator > 0.0f ? out_scale / denominator : 0.0f;
        scalar_t* dst = o + ((b * q_len + i) * heads + kv * group + g) * d;
        for (int64_t k = 0; k < d; ++k) dst[k] = static_cast<scalar_t>(row[k] * inv);
      }
    });
  });
}

// The work items of an op, run by the threads: each item's problem rows (its segment's G * q queries, scaled, fp32)
// attend through `attend_item(item, b, kv, qs, m, l, acc, space, last, extra)`, which fills the item's partial state
// (max m, sum l, unnormalised output acc: initialised here) with the micro-kernels; `last` (rows) holds causal limits
// and `extra` is a per-thread byte buffer the item may use. Then the items of each segment are merged into the output.
template <typename AttendItem>
at::Tensor run_items(const at::Tensor& query, int64_t kv_heads, const std::vector<Item>& items,
                     const std::vector<int64_t>& first_item, double scale, AttendItem&& attend_item,
                     float out_scale = 1.0f, const float* sinks = nullptr) {
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), d = query.size(3);
  const int64_t group = heads / kv_heads, rows = group * q_len;  // problem rows of a segment: r = g * q_len + i
  at::Tensor out = at::empty({batch, q_len, heads, d}, query.options());
  if (out.numel() == 0) return out;
  const int64_t n_items = static_cast<int64_t>(items.size());
  // per item and row: max, sum, then the (rows, d) unnormalised output
  const int64_t slot = rows * (d + 2);
  at::Tensor partial = at::empty({std::max<int64_t>(n_items, 1) * slot}, query.options().dtype(at::kFloat));
  float* const part = partial.mutable_data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(n_items, 1));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // per-thread scratch through torch's allocator: scaled queries | the micro-kernel's work space
    const int64_t work = (2 * rows + 2 * d) * kMaxVL;
    at::Tensor scratch = at::empty({rows * d + work}, partial.options());
    float* const qs = scratch.mutable_data_ptr<float>();
    float* const space = qs + rows * d;
    std::vector<int64_t> last(rows);
    thread_local std::vector<char> extra;  // kept between calls: a tail's copy, not allocated and zeroed each call
    int64_t loaded_segment = -1;
    for (int64_t it = next.fetch_add(1); it < n_items; it = next.fetch_add(1)) {
      const Item item = items[it];
      const int64_t b = item.segment / kv_heads, kv = item.segment % kv_heads;
      if (item.segment != loaded_segment) {
        load_queries(query, b, kv, group, fscale, qs);
        loaded_segment = item.segment;
      }
      float* const m = part + it * slot;
      float* const l = m + rows;
      float* const acc = l + rows;
      std::fill(m, m + rows, kNegInf);
      std::fill(l, l + rows, 0.0f);
      std::fill(acc, acc + rows * d, 0.0f);
      attend_item(item, b, kv, qs, m, l, acc, space, last.data(), extra);
    }
  });
  merge_items(part, slot, first_item, kv_heads, out, out_scale, sinks);
  return out;
}

// The items of a segment: chunks of its context entries (flash-decoding splits: a long head is spread over the
// threads) of at least kMinChunk entries, then one tail item when it has a tail. Returns the segments' first items.
std::vector<int64_t> segment_items(int64_t segments, int64_t total, const int64_t* lengths_or_null,
                                   const int64_t* cu_or_null, const int64_t* tails, int64_t kv_heads,
                                   std::vector<Item>& items) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(kMinChunk, (total + 4 * threads - 1) / (4 * threads));
  std::vector<int64_t> first_item(segments + 1, 0);
  for (int64_t s = 0; s < segments; ++s) {
    first_item[s] = static_cast<int64_t>(items.size());
    const int64_t length = lengths_or_null != nullptr ? lengths_or_null[s] : cu_or_null[s + 1] - cu_or_null[s];
    TORCH_CHECK(length >= 0, "kvpress_critical: segment lengths must be non-negative (cu_seqlens non-decreasing)");
    for (int64_t begin = 0; begin < length; begin += chunk)
      items.push_back({s, begin, std::min(length, begin + chunk), false});
    const int64_t tail = tails[s / kv_heads];
    if (tail > 0) items.push_back({s, 0, tail, true});
  }
  first_item[segments] = static_cast<int64_t>(items.size());
  return first_item;
}

// Everything but the reading of the context: work items, the tail, the merge. tail_keys / tail_values: unit stride
// along head_dim, fp32 / bf16 / half.
at::Tensor attend_items(const at::Tensor& query, const Context& ctx, int64_t n_entries, const at::Tensor& cu_seqlens,
                        const at::Tensor& tail_keys, const at::Tensor& tail_values, int64_t tail_len, double scale) {
  const int64_t batch = query.size(0), q_len = query.size(2), d = query.size(3);
  const int64_t kv_heads = tail_keys.size(1), segments = batch * kv_heads, rows = query.size(1) / kv_heads * q_len;
  const at::Tensor cu = cu_seqlens.contiguous();
  const int64_t* cu_ptr = cu.const_data_ptr<int64_t>();
  TORCH_CHECK(cu_ptr[0] == 0 && cu_ptr[segments] == n_entries, "kvpress_critical: cu_seqlens must start at 0 and end "
              "at the number of packed entries (", n_entries, "), got ", cu_ptr[0], " .. ", cu_ptr[segments]);
  const std::vector<int64_t> tails(batch, tail_len);
  std::vector<Item> items;
  const std::vector<int64_t> first_item =
      segment_items(segments, n_entries + segments * tail_len, nullptr, cu_ptr, tails.data(), kv_heads, items);

  const AttentionIsa& isa = attention_isa();
  const auto tail_type = tail_keys.scalar_type();
  const AttendFn attend_tail = tail_type == at::kFloat ? isa.f32 : tail_type == at::kBFloat16 ? isa.bf16 : isa.f16;
  const int64_t tsize = tail_keys.element_size();
  const char* tk_base = static_cast<const char*>(tail_keys.const_data_ptr());
  const char* tv_base = static_cast<const char*>(tail_values.const_data_ptr());
  return run_items(query, kv_heads, items, first_item, scale,
                   [&](const Item& item, int64_t b, int64_t kv, const float* qs, float* m, float* l, float* acc,
                       float* space, int64_t* last, std::vector<char>&) {
    if (item.tail) {  // query i sees tail positions <= tail_len - q_len + i (causal among the new tokens)
      for (int64_t r = 0; r < rows; ++r) last[r] = tail_len - q_len + r % q_len;
      const char* tk = tk_base + (b * tail_keys.stride(0) + kv * tail_keys.stride(1)) * tsize;
      const char* tv = tv_base + (b * tail_values.stride(0) + kv * tail_values.stride(1)) * tsize;
      attend_tail(qs, rows, d, tk, tail_keys.stride(2), tv, tail_values.stride(2), tail_len, last, m, l, acc, space,
                  0.0f);
    } else {
      const int64_t first = cu_ptr[item.segment] + item.begin, n = item.end - item.begin;
      if (ctx.attend_codes != nullptr)
        ctx.attend_codes(qs, rows, d, ctx.k_codes, ctx.v_codes, first, n, m, l, acc, space);
      else
        ctx.attend(qs, rows, d, ctx.k + first * ctx.ldk * ctx.esize, ctx.ldk, ctx.v + first * ctx.ldv * ctx.esize,
                   ctx.ldv, n, nullptr, m, l, acc, space, 0.0f);
    }
  });
}

at::Tensor ragged_attention_cpu(const at::Tensor& query, const at::Tensor& keys_in, const at::Tensor& values_in,
                                const at::Tensor& cu_seqlens, const at::Tensor& tail_keys_in,
                                const at::Tensor& tail_values_in, int64_t tail_len, double scale) {
  check_args(query, keys_in, values_in, cu_seqlens, tail_keys_in, tail_values_in, tail_len);
  // one element type for the whole cache (the context's, usually the model's), unit stride along head_dim
  const at::Tensor keys = kernel_layout(keys_in);
  const at::Tensor values = kernel_layout(values_in).to(keys.scalar_type());
  const at::Tensor tail_keys = kernel_layout(tail_keys_in).to(keys.scalar_type());
  const at::Tensor tail_values = kernel_layout(tail_values_in).to(keys.scalar_type());
  const AttentionIsa& isa = attention_isa();
  const auto type = keys.scalar_type();
  Context ctx;
  ctx.k = static_cast<const char*>(keys.const_data_ptr());
  ctx.v = static_cast<const char*>(values.const_data_ptr());
  ctx.ldk = keys.stride(0);
  ctx.ldv = values.stride(0);
  ctx.esize = keys.element_size();
  ctx.attend = type == at::kFloat ? isa.f32 : type == at::kBFloat16 ? isa.bf16 : isa.f16;
  return attend_items(query, ctx, keys.size(0), cu_seqlens, tail_keys, tail_values, tail_len, scale);
}

// One tensor's codes checked against the query's head_dim: dtype and width of the codes, shapes of the scales, zeros
// and groups (codes.py); `what` names the tensor in messages.
CodeView code_view(const char* what, const at::Tensor& codes, const at::Tensor& scales,
                   const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& groups, int64_t bits,
                   int64_t d) {
  const int64_t width = bits == 8 ? d : (d + 1) / 2;
  const bool symmetric = !zeros.has_value();
  const auto code_type = bits == 8 && symmetric ? at::kChar : at::kByte;
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) == width && codes.scalar_type() == code_type && codes.device().is_cpu() &&
                  codes.stride(1) == 1,
              "kvpress_critical: ", what, ": ", bits, "-bit ", symmetric ? "symmetric" : "asymmetric",
              " codes of head_dim ", d, " must be ", code_type, " (N, ", width, ") CPU tensors with unit stride, got ",
              codes.scalar_type(), " ", codes.sizes());
  const int64_t n = codes.size(0);
  if (groups.has_value()) {
    TORCH_CHECK(groups->dim() == 1 && groups->size(0) == n && groups->scalar_type() == at::kInt &&
                    groups->is_contiguous() && groups->device().is_cpu(),
                "kvpress_critical: ", what, ": groups must be a contiguous int32 CPU tensor (", n, ",)");
    TORCH_CHECK(scales.dim() == 2 && scales.size(1) == d, "kvpress_critical: ", what,
                ": per-channel scales must be (groups, ", d, "), got ", scales.sizes());
    if (n > 0) {
      const int32_t* g = groups->const_data_ptr<int32_t>();
      const auto [lo, hi] = std::minmax_element(g, g + n);
      TORCH_CHECK(*lo >= 0 && *hi < scales.size(0), "kvpress_critical: ", what, ": groups index rows outside the ",
                  scales.size(0), " rows of the scales");
    }
  } else {
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "kvpress_critical: ", what,
                ": per-entry scales must be (", n, ",), got ", scales.sizes());
  }
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.device().is_cpu(),
              "kvpress_critical: ", what, ": scales must be a contiguous float32 CPU tensor");
  if (zeros.has_value())
    TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->scalar_type() == at::kFloat && zeros->is_contiguous() &&
                    zeros->device().is_cpu(),
                "kvpress_critical: ", what, ": zeros must be a contiguous float32 CPU tensor of the scales' shape");
  return CodeView{static_cast<const uint8_t*>(codes.const_data_ptr()), codes.stride(0), scales.const_data_ptr<float>(),
                  zeros.has_value() ? zeros->const_data_ptr<float>() : nullptr,
                  groups.has_value() ? groups->const_data_ptr<int32_t>() : nullptr, static_cast<int>(bits)};
}

// ragged_attention over quantized context entries (codes.py): keys and values each as codes, scales, optional zeros
// (asymmetric codes) and optional groups (per-channel scales); the tail in any float dtype.
at::Tensor ragged_attention_quantized_cpu(const at::Tensor& query, const at::Tensor& key_codes,
                                          const at::Tensor& key_scales, const std::optional<at::Tensor>& key_zeros,
                                          const std::optional<at::Tensor>& key_groups, const at::Tensor& value_codes,
                                          const at::Tensor& value_scales, const std::optional<at::Tensor>& value_zeros,
                                          const std::optional<at::Tensor>& value_groups, int64_t bits,
                                          const at::Tensor& cu_seqlens, const at::Tensor& tail_keys_in,
                                          const at::Tensor& tail_values_in, int64_t tail_len, double scale) {
  TORCH_CHECK(bits == 8 || bits == 4, "kvpress_critical: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(query.dim() == 4, "kvpress_critical: query must be (batch, heads, q_len, head_dim), got ", query.sizes());
  const int64_t d = query.size(3);
  Context ctx;
  ctx.k_codes = code_view("keys", key_codes, key_scales, key_zeros, key_groups, bits, d);
  ctx.v_codes = code_view("values", value_codes, value_scales, value_zeros, value_groups, bits, d);
  TORCH_CHECK(value_codes.size(0) == key_codes.size(0), "kvpress_critical: keys and values have different entries");
  // check the query, offsets and tail as for float entries (a stride-0 view stands in for the context's shape)
  const at::Tensor shape_only = at::empty({1, 1}, query.options().dtype(at::kFloat)).expand({key_codes.size(0), d});
  check_args(query, shape_only, shape_only, cu_seqlens, tail_keys_in, tail_values_in, tail_len);
  const at::Tensor tail_keys = kernel_layout(tail_keys_in);
  const at::Tensor tail_values = kernel_layout(tail_values_in).to(tail_keys.scalar_type());
  ctx.attend_codes = attention_isa().codes;
  return attend_items(query, ctx, key_codes.size(0), cu_seqlens, tail_keys, tail_values, tail_len, scale);
}


// fp8 codes are read by the micro-kernels as value / 2^8 (e4m3) or value (e5m2): cpu_attention_kernel.inc
constexpr float fp8_factor(bool e4m3) { return e4m3 ? 256.0f : 1.0f; }

// A tail's entries kept in one block, slots slot0 .. slot0 + n - 1 of a KV head, copied into n rows of d elements:
// `offsets` (d per slot) and `runs` (run[k]: the elements from k on that lie one after the other) are the first
// slot's. Slot-major entries go run by run (one memcpy per entry when a key is contiguous); dimension-major ones
// (`by_dims`: dimension k of consecutive slots adjacent, as in vLLM's CPU key cache) are transposed one dimension at
// a time, E an unsigned integer of the element's size (a memcpy per element would cost more than the attention).
template <typename E>
void copy_by_dims(const char* block, const int64_t* offsets, int64_t n, int64_t d, char* dst) {
  const E* b = reinterpret_cast<const E*>(block);
  E* o = reinterpret_cast<E*>(dst);
  for (int64_t k = 0; k < d; ++k) {  // the block read in its order (the n rows written, a few KiB, stay in L1)
    const E* src = b + offsets[k];  // dimension k of the n slots
    for (int64_t i = 0; i < n; ++i) o[i * d + k] = src[i];
  }
}

void copy_tail_rows(const char* block, const int64_t* offsets, const int64_t* runs, bool by_dims, int64_t n, int64_t d,
                    int64_t esize, char* dst) {
  if (by_dims) {
    switch (esize) {
      case 4: return copy_by_dims<uint32_t>(block, offsets, n, d, dst);
      case 2: return copy_by_dims<uint16_t>(block, offsets, n, d, dst);
      default: return copy_by_dims<uint8_t>(block, offsets, n, d, dst);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* o = offsets + i * d;
    const int64_t* r = runs + i * d;
    for (int64_t k = 0; k < d; k += r[k]) std::memcpy(dst + (i * d + k) * esize, block + o[k] * esize, r[k] * esize);
  }
}

// paged_ragged_attention: the same attention over head-wise entries kept inside a paged cache
// (kvpress_critical/ops/paged_ragged_attention). A segment's region entries are read in place, run by run (a run:
// the entries of one region block, consecutive rows), through the row's region table; a row's tail is gathered
// once per (row, KV head) into the thread's scratch through the tail's block table and element offsets (the
// engine's own in-block order), a block's entries at a time (copy_tail_rows), then attended with its causal
// limits. Work items and the merge are ragged_attention's.
at::Tensor paged_ragged_attention_cpu(const at::Tensor& query, const at::Tensor& region_keys,
                                      const at::Tensor& region_values, const at::Tensor& region_table_in,
                                      const at::Tensor& seg_start_in, const at::Tensor& seg_len_in,
                                      const at::Tensor& tail_keys, const at::Tensor& tail_values,
                                      const at::Tensor& tail_table_in, const at::Tensor& tail_len_in,
                                      const at::Tensor& key_offsets_in, const at::Tensor& value_offsets_in,
                                      double scale, double k_scale, double v_scale, double soft_cap,
                                      const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.dim() == 4, "kvpress_critical: query must be (batch, heads, q_len, head_dim), got ", query.sizes());
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), d = query.size(3);
  TORCH_CHECK(key_offsets_in.dim() == 3 && key_offsets_in.sizes() == value_offsets_in.sizes() &&
                  key_offsets_in.size(2) == d,
              "kvpress_critical: key / value offsets must be (kv_heads, block_size, head_dim), got ",
              key_offsets_in.sizes());
  const int64_t kv_heads = key_offsets_in.size(0), block_size = key_offsets_in.size(1);
  TORCH_CHECK(heads % kv_heads == 0, "kvpress_critical: the query's ", heads, " heads are not a multiple of the ",
              kv_heads, " KV heads");
  const auto type = region_keys.scalar_type();
  const bool fp8 = type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
  for (const at::Tensor* t : {&region_keys, &region_values, &tail_keys, &tail_values})
    TORCH_CHECK(t->scalar_type() == type &&
                    (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || fp8) && t->device().is_cpu(),
                "kvpress_critical: the paged cache must be one float32 / bfloat16 / half / fp8 (e4m3fn, e5m2) CPU "
                "tensor");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0),
              "kvpress_critical: k_scale / v_scale scale fp8 codes; a float cache's entries are read as they are");
  TORCH_CHECK(soft_cap >= 0.0 && std::isfinite(soft_cap), "kvpress_critical: soft_cap must be finite and >= 0, got ",
              soft_cap);
  const float cap = static_cast<float>(soft_cap);
  at::Tensor sink_tensor;  // one logit per query head, fp32 (the merge adds exp(sink - max) to each row's sum)
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == heads && sinks->is_floating_point() && sinks->device().is_cpu(),
                "kvpress_critical: sinks must be a (", heads, ",) float CPU tensor, one logit per query head, got ",
                sinks->sizes());
    sink_tensor = sinks->to(at::kFloat).contiguous();
  }
  const float* sink_logits = sinks.has_value() ? sink_tensor.const_data_ptr<float>() : nullptr;
  TORCH_CHECK(region_keys.dim() == 3 && region_keys.sizes() == region_values.sizes() && region_keys.size(2) == d &&
                  region_keys.stride(2) == 1 && region_values.stride(2) == 1,
              "kvpress_critical: region keys / values must be (blocks, rows, head_dim) views with unit stride along "
              "head_dim, got ", region_keys.sizes());
  TORCH_CHECK(tail_keys.dim() == 2 && tail_values.dim() == 2 && tail_keys.stride(1) == 1 && tail_values.stride(1) == 1,
              "kvpress_critical: tail keys / values must be (blocks, elements) views with unit stride");
  const at::Tensor region_table = region_table_in.to(at::kLong).contiguous();
  const at::Tensor tail_table = tail_table_in.to(at::kLong).contiguous();
  const at::Tensor seg_start = seg_start_in.to(at::kLong).contiguous(), seg_len = seg_len_in.to(at::kLong).contiguous();
  const at::Tensor tail_len = tail_len_in.to(at::kLong).contiguous();
  const at::Tensor key_offsets = key_offsets_in.to(at::kLong).contiguous();
  const at::Tensor value_offsets = value_offsets_in.to(at::kLong).contiguous();
  const int64_t segments = batch * kv_heads;
  TORCH_CHECK(region_table.dim() == 2 && region_table.size(0) == batch && tail_table.dim() == 2 &&
                  tail_table.size(0) == batch && seg_start.numel() == segments && seg_len.numel() == segments &&
                  tail_len.numel() == batch,
              "kvpress_critical: tables / segments do not match the batch of ", batch, " rows and ", kv_heads,
              " KV heads");
  const int64_t* rt = region_table.const_data_ptr<int64_t>();
  const int64_t* tt = tail_table.const_data_ptr<int64_t>();
  const int64_t* starts = seg_start.const_data_ptr<int64_t>();
  const int64_t* lengths = seg_len.const_data_ptr<int64_t>();
  const int64_t* tails = tail_len.const_data_ptr<int64_t>();
  const int64_t* koff = key_offsets.const_data_ptr<int64_t>();
  const int64_t* voff = value_offsets.const_data_ptr<int64_t>();
  const int64_t rows_per_block = region_keys.size(1), num_blocks = region_keys.size(0);
  const int64_t rows = heads / kv_heads * q_len;

  // check every block a segment or a tail reads is in the cache (an engine's tables are checked once per call)
  int64_t max_tail = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(tails[b] >= q_len, "kvpress_critical: row ", b, "'s tail (", tails[b], ") must hold its ", q_len,
                " queries");
    TORCH_CHECK((tails[b] + block_size - 1) / block_size <= tail_table.size(1),
                "kvpress_critical: row ", b, "'s tail of ", tails[b], " entries outruns its tail table");
    for (int64_t j = 0; j < (tails[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tt[b * tail_table.size(1) + j] >= 0 && tt[b * tail_table.size(1) + j] < tail_keys.size(0),
                  "kvpress_critical: a tail block outside the cache");
    max_tail = std::max(max_tail, tails[b]);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t s = b * kv_heads + h;
      TORCH_CHECK(starts[s] >= 0 && lengths[s] >= 0, "kvpress_critical: negative region offsets");
      if (lengths[s] == 0) continue;
      const int64_t last_block = (starts[s] + lengths[s] - 1) / rows_per_block;
      TORCH_CHECK(last_block < region_table.size(1), "kvpress_critical: segment ", s, " outruns its region table");
      for (int64_t j = starts[s] / rows_per_block; j <= last_block; ++j)
        TORCH_CHECK(rt[b * region_table.size(1) + j] >= 0 && rt[b * region_table.size(1) + j] < num_blocks,
                    "kvpress_critical: a region block outside the cache");
    }
  }
  for (const int64_t* offsets : {koff, voff}) {
    const auto [lo, hi] = std::minmax_element(offsets, offsets + key_offsets.numel());
    TORCH_CHECK(*lo >= 0 && *hi < tail_keys.size(1) && *hi < tail_values.size(1),
                "kvpress_critical: key / value offsets outside a block");
  }
  // per KV head: whether its entries are dimension-major in a block (dimension k of slot j + 1 right after slot j's,
  // for every k and j) rather than runs along the head dimension (a first entry not contiguous)
  const auto by_dims_of = [&](const int64_t* offsets) {
    std::vector<char> by_dims(kv_heads, 0);
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      const int64_t* o = offsets + kv * block_size * d;
      bool contiguous = true;
      for (int64_t k = 0; contiguous && k + 1 < d; ++k) contiguous = o[k + 1] == o[k] + 1;
      bool adjacent = block_size > 1 && !contiguous;
      for (int64_t j = 0; adjacent && j + 1 < block_size; ++j)
        for (int64_t k = 0; adjacent && k < d; ++k) adjacent = o[(j + 1) * d + k] == o[j * d + k] + 1;
      by_dims[kv] = adjacent;
    }
    return by_dims;
  };
  const std::vector<char> key_by_dims = by_dims_of(koff), value_by_dims = by_dims_of(voff);
  // runs of consecutive element offsets (the heads not copied by dimension): run[(kv * block_size + slot) * d + k]
  // elements from k on lie one after the other, so a slot-major tail entry is copied run by run (one memcpy per entry
  // when it is contiguous, one per vector of a vector-blocked layout) instead of element by element
  const auto runs_of = [&](const int64_t* offsets, const std::vector<char>& by_dims) {
    std::vector<int64_t> run(key_offsets.numel());
    for (int64_t slot = 0; slot < kv_heads * block_size; ++slot) {
      if (by_dims[slot / block_size]) continue;
      const int64_t* o = offsets + slot * d;
      int64_t* r = run.data() + slot * d;
      r[d - 1] = 1;
      for (int64_t k = d - 2; k >= 0; --k) r[k] = o[k + 1] == o[k] + 1 ? r[k + 1] + 1 : 1;
    }
    return run;
  };
  const std::vector<int64_t> key_runs = runs_of(koff, key_by_dims), value_runs = runs_of(voff, value_by_dims);

  int64_t total = 0;
  for (int64_t s = 0; s < segments; ++s) total += lengths[s] + tails[s / kv_heads];
  std::vector<Item> items;
  const std::vector<int64_t> first_item = segment_items(segments, total, lengths, nullptr, tails, kv_heads, items);

  const AttentionIsa& isa = attention_isa();
  // fp8 codes are read in place by their micro-kernels; their factor and the per-tensor scales go into the softmax
  // scale (keys) and onto the output (values)
  const bool e4m3 = type == at::kFloat8_e4m3fn;
  const AttendFn attend = type == at::kFloat      ? isa.f32
                          : type == at::kBFloat16 ? isa.bf16
                          : type == at::kHalf     ? isa.f16
                          : e4m3                  ? isa.fp8_e4m3
                                                  : isa.fp8_e5m2;
  const int64_t esize = region_keys.element_size();
  const double key_factor = fp8 ? fp8_factor(e4m3) * k_scale : 1.0;
  const float value_factor = fp8 ? static_cast<float>(fp8_factor(e4m3) * v_scale) : 1.0f;
  const char* rk = static_cast<const char*>(region_keys.const_data_ptr());
  const char* rv = static_cast<const char*>(region_values.const_data_ptr());
  const char* tk = static_cast<const char*>(tail_keys.const_data_ptr());
  const char* tv = static_cast<const char*>(tail_values.const_data_ptr());
  return run_items(query, kv_heads, items, first_item, scale * key_factor,
                   [&](const Item& item, int64_t b, int64_t kv, const float* qs, float* m, float* l, float* acc,
                       float* space, int64_t* last, std::vector<char>& gathered) {
    if (item.tail) {  // the row's tail for this KV head, gathered in the cache's element type: keys, then values
      const int64_t length = item.end;
      gathered.resize(2 * max_tail * d * esize);
      char* gk = gathered.data();
      char* gv = gk + length * d * esize;
      for (int64_t t = 0; t < length;) {  // the entries held in one block at a time
        const int64_t block = tt[b * tail_table.size(1) + t / block_size];
        const int64_t n = std::min(block_size - t % block_size, length - t);
        const int64_t slot = (kv * block_size + t % block_size) * d;  // the first entry's offsets and runs
        copy_tail_rows(tk + block * tail_keys.stride(0) * esize, koff + slot, key_runs.data() + slot, key_by_dims[kv],
                       n, d, esize, gk + t * d * esize);
        copy_tail_rows(tv + block * tail_values.stride(0) * esize, voff + slot, value_runs.data() + slot,
                       value_by_dims[kv], n, d, esize, gv + t * d * esize);
        t += n;
      }
      for (int64_t r = 0; r < rows; ++r) last[r] = length - q_len + r % q_len;
      attend(qs, rows, d, gk, d, gv, d, length, last, m, l, acc, space, cap);
    } else {  // the region entries [begin, end) of the segment, one run (region block) at a time
      int64_t e = starts[item.segment] + item.begin;
      const int64_t stop = starts[item.segment] + item.end;
      while (e < stop) {
        const int64_t column = e / rows_per_block, row = e % rows_per_block;
        const int64_t n = std::min(stop, (column + 1) * rows_per_block) - e;
        const int64_t block = rt[b * region_table.size(1) + column];
        attend(qs, rows, d, rk + (block * region_keys.stride(0) + row * region_keys.stride(1)) * esize,
               region_keys.stride(1), rv + (block * region_values.stride(0) + row * region_values.stride(1)) * esize,
               region_values.stride(1), n, nullptr, m, l, acc, space, cap);
        e += n;
      }
    }
  }, value_factor, sink_logits);
}

std::string attention_kernel_isa() { return attention_isa().name; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpress_critical, m) {
  m.def(
      "ragged_attention(Tensor query, Tensor keys, Tensor values, Tensor cu_seqlens, Tensor tail_keys, "
      "Tensor tail_values, int tail_len, float scale) -> Tensor");
  m.def(
      "ragged_attention_quantized(Tensor query, Tensor key_codes, Tensor key_scales, Tensor? key_zeros, "
      "Tensor? key_groups, Tensor value_codes, Tensor value_scales, Tensor? value_zeros, Tensor? value_groups, "
      "int bits, Tensor cu_seqlens, Tensor tail_keys, Tensor tail_values, int tail_len, float scale) -> Tensor");
  m.def(
      "paged_ragged_attention(Tensor query, Tensor region_keys, Tensor region_values, Tensor region_table, "
      "Tensor seg_start, Tensor seg_len, Tensor tail_keys, Tensor tail_values, Tensor tail_table, Tensor tail_len, "
      "Tensor key_offsets, Tensor value_offsets, float scale, float k_scale=1.0, float v_scale=1.0, "
      "float soft_cap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("attention_kernel_isa() -> str", &attention_kernel_isa);
}

TORCH_LIBRARY_IMPL(kvpress_critical, CPU, m) {
  m.impl("ragged_attention", &ragged_attention_cpu);
  m.impl("ragged_attention_quantized", &ragged_attention_quantized_cpu);
  m.impl("paged_ragged_attention", &paged_ragged_attention_cpu);
}

}  // namespace kvpress_critical
