// Argument checks shared by the CPU and CUDA implementations of kvpress_critical::head_projected_norm.
// Every failure names the argument, what was expected and what was received.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <string>
#include <string_view>

namespace kvpress_critical {

enum class Norm { L1, L2 };

inline Norm parse_norm(std::string_view norm) {
  TORCH_CHECK(norm == "l1" || norm == "l2", "kvpress_critical: norm must be 'l1' or 'l2', got '", std::string(norm),
              "'");
  return norm == "l1" ? Norm::L1 : Norm::L2;
}

// values: (B, H_kv, T, d); head_proj: (H, N, d) with H a multiple of H_kv; out: (B, H_kv, T) float32.
inline void check_head_projected_norm_args(const at::Tensor& values, const at::Tensor& head_proj,
                                           const at::Tensor& out) {
  TORCH_CHECK(values.dim() == 4, "kvpress_critical: values must be (batch, kv_heads, tokens, head_dim), got shape ",
              values.sizes());
  TORCH_CHECK(head_proj.dim() == 3,
              "kvpress_critical: head_proj must be (heads, out_features, head_dim), got shape ", head_proj.sizes());
  TORCH_CHECK(values.is_floating_point() && head_proj.is_floating_point(),
              "kvpress_critical: values and head_proj must be floating point, got ", values.scalar_type(), " and ",
              head_proj.scalar_type());
  TORCH_CHECK(values.size(3) == head_proj.size(2), "kvpress_critical: head_dim of values (", values.size(3),
              ") differs from the last dimension of head_proj (", head_proj.size(2), ")");
  const int64_t kv_heads = values.size(1), heads = head_proj.size(0);
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0, "kvpress_critical: the number of query heads (",
              heads, ", dim 0 of head_proj) must be a positive multiple of the number of KV heads (", kv_heads,
              ", dim 1 of values)");
  TORCH_CHECK(values.device() == head_proj.device(), "kvpress_critical: values are on ", values.device(),
              " but head_proj is on ", head_proj.device());
  TORCH_CHECK(out.scalar_type() == at::kFloat, "kvpress_critical: out must be float32, got ", out.scalar_type());
  TORCH_CHECK(out.device() == values.device(), "kvpress_critical: out is on ", out.device(), " but values are on ",
              values.device());
  TORCH_CHECK(out.dim() == 3 && out.size(0) == values.size(0) && out.size(1) == kv_heads &&
                  out.size(2) == values.size(2),
              "kvpress_critical: out must have shape (batch, kv_heads, tokens) = ",
              at::IntArrayRef({values.size(0), kv_heads, values.size(2)}), ", got ", out.sizes());
}

// A new (B, H_kv, T) float32 output for values (B, H_kv, T, d), on the values' device.
inline at::Tensor new_output(const at::Tensor& values) {
  TORCH_CHECK(values.dim() == 4, "kvpress_critical: values must be (batch, kv_heads, tokens, head_dim), got shape ",
              values.sizes());
  return at::empty({values.size(0), values.size(1), values.size(2)}, values.options().dtype(at::kFloat));
}

}  // namespace kvpress_critical
