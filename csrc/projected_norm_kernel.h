// Plain C++ interface of the CUDA kernels of kvpress_critical::head_projected_norm (projected_norm_kernel.cu).
// No torch headers: the .cu compiles with nvcc alone (`make check-cuda`); projected_norm_cuda.cpp binds it to torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvpress_critical {
namespace cuda {

enum class DType : int { Float32 = 0, Float16 = 1, BFloat16 = 2 };

// out[b, kv, t] = mean over g < group of || values[b, kv, t, :] @ proj[kv * group + g].T ||_p
// Strides are in elements; any strides (including zero and negative-free broadcasts) are allowed.
struct NormProblem {
  const void* values;  // (batch, kv_heads, tokens, head_dim)
  int64_t sv_b, sv_h, sv_t, sv_d;
  DType values_dtype;
  const void* proj;  // (kv_heads * group, features, head_dim)
  int64_t sp_h, sp_n, sp_d;
  DType proj_dtype;
  float* out;  // (batch, kv_heads, tokens) float32
  int64_t so_b, so_h, so_t;
  int batch, kv_heads, tokens, head_dim, features, group;
  int norm;  // 1 (L1) or 2 (L2)
};

// What the launcher needs to know about the device: compute capability and opt-in shared memory per block.
struct DeviceInfo {
  int major, minor;
  int max_shared_bytes;
};

// Launches the kernels on `stream`. Returns cudaErrorInvalidValue when the problem does not fit (head_dim too
// large for shared memory, too many (batch, kv_head) pairs for the grid), else the launch status.
cudaError_t launch_head_projected_norm(const NormProblem& problem, const DeviceInfo& device, cudaStream_t stream);

}  // namespace cuda
}  // namespace kvpress_critical
