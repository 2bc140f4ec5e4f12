// CUDA implementation of kvpress_critical::head_projected_norm: argument checks, device guard, current stream,
// and the translation of tensors into the plain NormProblem of projected_norm_kernel.cu.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "checks.h"
#include "projected_norm_kernel.h"

namespace kvpress_critical {
namespace {

cuda::DType to_kernel_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return cuda::DType::Float32;
    case at::kHalf:
      return cuda::DType::Float16;
    case at::kBFloat16:
      return cuda::DType::BFloat16;
    default:
      TORCH_CHECK(false, "kvpress_critical: the CUDA kernel supports float32, float16 and bfloat16 ", name, ", got ",
                  t.scalar_type(), "; convert it first (e.g. .float())");
  }
  return cuda::DType::Float32;
}

cuda::DeviceInfo device_info(int device) {
  cuda::DeviceInfo info{};
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.max_shared_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return info;
}

int checked_int(int64_t x, const char* what) {
  TORCH_CHECK(x <= std::numeric_limits<int>::max(), "kvpress_critical: ", what, " = ", x,
              " is too large for the CUDA kernel");
  return static_cast<int>(x);
}

void head_projected_norm_out_cuda(const at::Tensor& values, const at::Tensor& head_proj,
                                         c10::string_view norm, at::Tensor out) {
  const Norm p = parse_norm(norm);
  check_head_projected_norm_args(values, head_proj, out);
  TORCH_CHECK(values.is_cuda(), "kvpress_critical: the CUDA kernel got values on ", values.device());
  const c10::cuda::CUDAGuard guard(values.device());

  cuda::NormProblem problem;
  problem.values = values.const_data_ptr();
  problem.sv_b = values.stride(0);
  problem.sv_h = values.stride(1);
  problem.sv_t = values.stride(2);
  problem.sv_d = values.stride(3);
  problem.values_dtype = to_kernel_dtype(values, "values");
  problem.proj = head_proj.const_data_ptr();
  problem.sp_h = head_proj.stride(0);
  problem.sp_n = head_proj.stride(1);
  problem.sp_d = head_proj.stride(2);
  problem.proj_dtype = to_kernel_dtype(head_proj, "projections");
  problem.out = out.mutable_data_ptr<float>();
  problem.so_b = out.stride(0);
  problem.so_h = out.stride(1);
  problem.so_t = out.stride(2);
  problem.batch = checked_int(values.size(0), "batch");
  problem.kv_heads = checked_int(values.size(1), "kv_heads");
  problem.tokens = checked_int(values.size(2), "tokens");
  problem.head_dim = checked_int(values.size(3), "head_dim");
  problem.features = checked_int(head_proj.size(1), "out_features");
  problem.group = checked_int(head_proj.size(0) / values.size(1), "group size");
  problem.norm = p == Norm::L1 ? 1 : 2;
  if (out.numel() == 0) return;
  if (problem.features == 0 || problem.head_dim == 0) {
    out.zero_();
    return;
  }

  const cuda::DeviceInfo device = device_info(values.device().index());
  const cudaError_t err =
      cuda::launch_head_projected_norm(problem, device, c10::cuda::getCurrentCUDAStream(values.device().index()));
  TORCH_CHECK(err != cudaErrorInvalidValue,
              "kvpress_critical: the CUDA kernel cannot run this problem (head_dim ", problem.head_dim,
              " needs more shared memory than the device's ", device.max_shared_bytes, " bytes, or batch * kv_heads = ",
              int64_t(problem.batch) * problem.kv_heads, " exceeds 65535); use backend='triton' or backend='torch'");
  TORCH_CHECK(err == cudaSuccess, "kvpress_critical: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor head_projected_norm_cuda(const at::Tensor& values, const at::Tensor& head_proj, c10::string_view norm) {
  at::Tensor out = new_output(values);
  head_projected_norm_out_cuda(values, head_proj, norm, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvpress_critical, CUDA, m) {
  m.impl("head_projected_norm", &head_projected_norm_cuda);
  m.impl("head_projected_norm.out", &head_projected_norm_out_cuda);
}

}  // namespace kvpress_critical
