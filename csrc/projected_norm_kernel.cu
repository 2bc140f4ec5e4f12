// CUDA kernels of kvpress_critical::head_projected_norm. Pure CUDA: compiles with nvcc alone (no torch headers).
//
// Problem (docs/kernels.md): for values V (B, H_kv, T, d) and per-head projections P_h (N, d), h < H = H_kv * G,
//   out[b, kv, t] = 1/G * sum_{g < G} || V[b, kv, t, :] @ P_{kv*G+g}^T ||_p        (p = 1 or 2), float32.
// L1 of the projected values: P_h = W_O^h^T = o_proj.weight[:, h*d:(h+1)*d] (N = D, the hidden size).
// Exact L2 through the Gram factors: P_h = R_h (N = d), R_h^T R_h = W_O^h W_O^h^T.
//
// One thread block per (token tile, batch row, KV head): the value tile is loaded once into shared memory and
// reused for every query head of the group and every feature tile; |V P^T| is reduced over features in fp32
// and never written to global memory. Every load is masked (any T, any N, any d up to the shared-memory limit)
// and zero-filled, so padded rows/columns add |0| = 0.
//
// Two kernels:
//  * tc_kernel   : values and projection both fp16 or both bf16 -> WMMA tensor cores, fp32 accumulators.
//  * simt_kernel : any other dtype combination (fp32, mixed, the fp32 Gram factors of L2) -> fp32 FMA.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include "projected_norm_kernel.h"

namespace kvpress_critical {
namespace cuda {
namespace {

using namespace nvcuda;

constexpr int kWarp = 32;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float load_as_float(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::Float16:
      return __half2float(static_cast<const __half*>(base)[index]);
    case DType::BFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
    default:
      return static_cast<const float*>(base)[index];
  }
}

template <typename T>
__device__ __forceinline__ T zero_value();
template <>
__device__ __forceinline__ __half zero_value<__half>() {
  return __float2half(0.0f);
}
template <>
__device__ __forceinline__ __nv_bfloat16 zero_value<__nv_bfloat16>() {
  return __float2bfloat16(0.0f);
}

__device__ __forceinline__ float norm_term(float x, int norm) { return norm == 1 ? fabsf(x) : x * x; }

// Copies a (rows, cols) tile of 16-bit elements, element (r, c) at src[r * s_row + c * s_col], into shared memory
// dst[r * ld_dst + c] for r < rows_pad, c < cols_pad, with zeros outside (rows_valid, cols_valid).
// `vec`: 16-byte loads, valid when s_col == 1, cols_valid % 8 == 0, s_row % 8 == 0 and src is 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load_tile_16bit(T* dst, int ld_dst, const T* src, int64_t s_row, int64_t s_col,
                                                int rows_valid, int cols_valid, int rows_pad, int cols_pad, bool vec) {
  const int tid = threadIdx.x, nthreads = blockDim.x;
  if (vec) {
    const int chunks = cols_pad / 8;  // cols_pad is a multiple of 16
    for (int i = tid; i < rows_pad * chunks; i += nthreads) {
      const int r = i / chunks, c = (i % chunks) * 8;
      uint4 x = make_uint4(0u, 0u, 0u, 0u);
      if (r < rows_valid && c < cols_valid) x = *reinterpret_cast<const uint4*>(src + r * s_row + c);
      *reinterpret_cast<uint4*>(dst + r * ld_dst + c) = x;
    }
  } else {
    const T zero = zero_value<T>();
    for (int i = tid; i < rows_pad * cols_pad; i += nthreads) {
      const int r = i / cols_pad, c = i % cols_pad;
      dst[r * ld_dst + c] = (r < rows_valid && c < cols_valid) ? src[r * s_row + c * s_col] : zero;
    }
  }
}

// ------------------------------------------------------------------------------------------------------------
// Tensor-core kernel. Block = WARPS warps; tile = BT tokens x BN features; warp w owns token rows [16w, 16w+16)
// (BT == 16 * WARPS) and all BN feature columns (BN / 16 accumulator fragments).
// Shared memory (dynamic, dpad = head_dim rounded up to 16, ld = dpad + 8 halves to spread banks):
//   vs[BT][ld] (T)  value tile          ws[BN][ld] (T)  projection tile (row n = output feature n)
//   cs[BT][BN + 4] (fp32) products      head_acc[BT], group_acc[BT] (fp32)
template <typename T, int BT, int BN, int WARPS>
__global__ void __launch_bounds__(WARPS* kWarp) tc_kernel(NormProblem p, int dpad, bool vec_v, bool vec_p) {
  static_assert(BT == 16 * WARPS, "one 16-row strip of tokens per warp");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 WMMA needs sm_80+; the launcher never picks this kernel below sm_80
#else
  static_assert(BN % 16 == 0, "whole fragments of features");
  extern __shared__ __align__(128) unsigned char smem[];
  const int ld = dpad + 8;
  constexpr int ldc = BN + 4;
  T* vs = reinterpret_cast<T*>(smem);
  T* ws = vs + BT * ld;
  float* cs = reinterpret_cast<float*>(ws + BN * ld);
  float* head_acc = cs + BT * ldc;
  float* group_acc = head_acc + BT;

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp, nthreads = blockDim.x;
  const int t0 = blockIdx.x * BT;
  const int b = blockIdx.y / p.kv_heads, kv = blockIdx.y % p.kv_heads;
  const int tokens_valid = min(BT, p.tokens - t0);

  // value tile (BT, dpad): loaded once, reused by every head of the group and every feature tile
  const T* vsrc = static_cast<const T*>(p.values) + b * p.sv_b + kv * p.sv_h + t0 * p.sv_t;
  load_tile_16bit<T>(vs, ld, vsrc, p.sv_t, p.sv_d, tokens_valid, p.head_dim, BT, dpad, vec_v);
  for (int i = tid; i < BT; i += nthreads) group_acc[i] = 0.0f;

  for (int g = 0; g < p.group; ++g) {
    const T* psrc = static_cast<const T*>(p.proj) + (int64_t)(kv * p.group + g) * p.sp_h;
    for (int i = tid; i < BT; i += nthreads) head_acc[i] = 0.0f;
    for (int n0 = 0; n0 < p.features; n0 += BN) {
      // projection tile (BN, dpad) of head kv*G+g, features [n0, n0 + BN)
      load_tile_16bit<T>(ws, ld, psrc + n0 * p.sp_n, p.sp_n, p.sp_d, min(BN, p.features - n0), p.head_dim, BN, dpad,
                         vec_p);
      __syncthreads();

      // (16 x BN) strip of V_tile @ P_tile^T for this warp, fp32 accumulation on tensor cores
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[BN / 16];
#pragma unroll
      for (int j = 0; j < BN / 16; ++j) wmma::fill_fragment(acc[j], 0.0f);
      for (int k = 0; k < dpad; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::load_matrix_sync(a, vs + warp * 16 * ld + k, ld);
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
          // B(k, n) = ws[n][k]: column-major with leading dimension ld
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bfrag;
          wmma::load_matrix_sync(bfrag, ws + j * 16 * ld + k, ld);
          wmma::mma_sync(acc[j], a, bfrag, acc[j]);
        }
      }
      float* cw = cs + warp * 16 * ldc;
#pragma unroll
      for (int j = 0; j < BN / 16; ++j) wmma::store_matrix_sync(cw + j * 16, acc[j], ldc, wmma::mem_row_major);
      __syncwarp();
      // reduce this warp's 16 rows over the BN features (lanes stride the columns: no bank conflicts)
      for (int r = 0; r < 16; ++r) {
        float s = 0.0f;
        for (int c = lane; c < BN; c += kWarp) s += norm_term(cw[r * ldc + c], p.norm);
        s = warp_sum(s);
        if (lane == 0) head_acc[warp * 16 + r] += s;  // row owned by this warp only
      }
      __syncthreads();  // ws and cs are overwritten by the next tile
    }
    for (int i = tid; i < BT; i += nthreads) group_acc[i] += p.norm == 1 ? head_acc[i] : sqrtf(head_acc[i]);
  }
  const float inv_group = 1.0f / p.group;
  for (int i = tid; i < tokens_valid; i += nthreads)
    p.out[b * p.so_b + kv * p.so_h + (t0 + i) * p.so_t] = group_acc[i] * inv_group;
#endif
}

// ------------------------------------------------------------------------------------------------------------
// FMA kernel for fp32 and mixed dtypes. 256 threads as 16 x 16 (tx, ty); tile = 64 tokens x 64 features; thread
// (tx, ty) computes tokens 4*ty + i and features tx + 16*j (i, j < 4). Shared memory (fp32, ld = head_dim + 1 so
// that the 16 feature rows read at once fall in distinct banks):
//   vs[64][ld] value tile, ws[64][ld] projection tile, head_acc[64], group_acc[64]
constexpr int kSimtTokens = 64, kSimtFeatures = 64, kSimtThreads = 256;

__global__ void __launch_bounds__(kSimtThreads) simt_kernel(NormProblem p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int d = p.head_dim, ld = d + 1;
  float* vs = reinterpret_cast<float*>(smem);
  float* ws = vs + kSimtTokens * ld;
  float* head_acc = ws + kSimtFeatures * ld;
  float* group_acc = head_acc + kSimtTokens;

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int t0 = blockIdx.x * kSimtTokens;
  const int b = blockIdx.y / p.kv_heads, kv = blockIdx.y % p.kv_heads;
  const int tokens_valid = min(kSimtTokens, p.tokens - t0);

  const int64_t vbase = b * p.sv_b + kv * p.sv_h + t0 * p.sv_t;
  for (int i = tid; i < kSimtTokens * d; i += kSimtThreads) {
    const int r = i / d, k = i % d;
    vs[r * ld + k] = r < tokens_valid ? load_as_float(p.values, vbase + r * p.sv_t + k * p.sv_d, p.values_dtype) : 0.f;
  }
  for (int i = tid; i < kSimtTokens; i += kSimtThreads) group_acc[i] = 0.0f;

  for (int g = 0; g < p.group; ++g) {
    const int64_t pbase = (int64_t)(kv * p.group + g) * p.sp_h;
    for (int i = tid; i < kSimtTokens; i += kSimtThreads) head_acc[i] = 0.0f;
    for (int n0 = 0; n0 < p.features; n0 += kSimtFeatures) {
      const int features_valid = min(kSimtFeatures, p.features - n0);
      for (int i = tid; i < kSimtFeatures * d; i += kSimtThreads) {
        const int r = i / d, k = i % d;
        ws[r * ld + k] = r < features_valid
                             ? load_as_float(p.proj, pbase + (n0 + r) * p.sp_n + k * p.sp_d, p.proj_dtype)
                             : 0.f;
      }
      __syncthreads();
      float acc[4][4] = {};
      for (int k = 0; k < d; ++k) {
        float v[4], w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = vs[(4 * ty + i) * ld + k];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = ws[(tx + 16 * j) * ld + k];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(v[i], w[j], acc[i][j]);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; ++j) s += norm_term(acc[i][j], p.norm);
        // sum over the 16 tx lanes of this half-warp (xor offsets < 16 stay inside it)
#pragma unroll
        for (int offset = 8; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (tx == 0) head_acc[4 * ty + i] += s;  // row owned by this ty only
      }
      __syncthreads();
    }
    for (int i = tid; i < kSimtTokens; i += kSimtThreads)
      group_acc[i] += p.norm == 1 ? head_acc[i] : sqrtf(head_acc[i]);
  }
  const float inv_group = 1.0f / p.group;
  for (int i = tid; i < tokens_valid; i += kSimtThreads)
    p.out[b * p.so_b + kv * p.so_h + (t0 + i) * p.so_t] = group_acc[i] * inv_group;
}

// ------------------------------------------------------------------------------------------------------------
// Launch configuration: tensor-core tiles by device (Hopper: 128-token tiles, 8 warps; Ampere/Ada: 64-token tiles,
// 4 warps; smaller feature tiles when the opt-in shared memory is small, e.g. sm86/sm89 with head_dim 256).

struct TcConfig {
  int bt, bn, warps;
  const char* name;
};

constexpr TcConfig kTcConfigs[] = {
    {128, 128, 8, "tc_bt128_bn128_w8"},
    {64, 128, 4, "tc_bt64_bn128_w4"},
    {64, 64, 4, "tc_bt64_bn64_w4"},
};

int round_up(int x, int m) { return (x + m - 1) / m * m; }

size_t tc_smem_bytes(const TcConfig& c, int dpad) {
  const size_t ld = dpad + 8;
  return (c.bt + c.bn) * ld * 2 + (size_t)c.bt * (c.bn + 4) * 4 + 2 * c.bt * 4;
}

size_t simt_smem_bytes(int head_dim) {
  return (size_t)(kSimtTokens + kSimtFeatures) * (head_dim + 1) * 4 + 2 * kSimtTokens * 4;
}

bool uses_tensor_cores(const NormProblem& p, const DeviceInfo& dev) {
  return dev.major >= 8 && p.values_dtype == p.proj_dtype && p.values_dtype != DType::Float32;
}

const TcConfig* pick_tc_config(const NormProblem& p, const DeviceInfo& dev) {
  const int dpad = round_up(p.head_dim, 16);
  for (const TcConfig& c : kTcConfigs) {
    if (c.bt == 128 && dev.major < 9) continue;  // 128-token tiles only pay off with Hopper's shared memory
    if (tc_smem_bytes(c, dpad) <= (size_t)dev.max_shared_bytes) return &c;
  }
  return nullptr;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

template <typename T, int BT, int BN, int WARPS>
cudaError_t launch_tc(const NormProblem& p, dim3 grid, size_t smem, cudaStream_t stream) {
  const int dpad = round_up(p.head_dim, 16);
  const bool vec_v = p.sv_d == 1 && p.head_dim % 8 == 0 && p.sv_t % 8 == 0 && p.sv_h % 8 == 0 && p.sv_b % 8 == 0 &&
                     aligned16(p.values);
  const bool vec_p = p.sp_d == 1 && p.head_dim % 8 == 0 && p.sp_n % 8 == 0 && p.sp_h % 8 == 0 && aligned16(p.proj);
  auto kernel = tc_kernel<T, BT, BN, WARPS>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, WARPS * kWarp, smem, stream>>>(p, dpad, vec_v, vec_p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t dispatch_tc(const NormProblem& p, const TcConfig& c, size_t smem, cudaStream_t stream) {
  const dim3 grid((p.tokens + c.bt - 1) / c.bt, p.batch * p.kv_heads);
  if (c.bt == 128) return launch_tc<T, 128, 128, 8>(p, grid, smem, stream);
  if (c.bn == 128) return launch_tc<T, 64, 128, 4>(p, grid, smem, stream);
  return launch_tc<T, 64, 64, 4>(p, grid, smem, stream);
}

}  // namespace

cudaError_t launch_head_projected_norm(const NormProblem& p, const DeviceInfo& dev, cudaStream_t stream) {
  if (p.batch == 0 || p.kv_heads == 0 || p.tokens == 0) return cudaSuccess;
  if ((int64_t)p.batch * p.kv_heads > 65535) return cudaErrorInvalidValue;  // grid.y limit
  if (uses_tensor_cores(p, dev)) {
    const TcConfig* c = pick_tc_config(p, dev);
    if (c != nullptr) {
      const size_t smem = tc_smem_bytes(*c, round_up(p.head_dim, 16));
      if (p.values_dtype == DType::BFloat16) return dispatch_tc<__nv_bfloat16>(p, *c, smem, stream);
      return dispatch_tc<__half>(p, *c, smem, stream);
    }
  }
  const size_t smem = simt_smem_bytes(p.head_dim);
  if (smem > (size_t)dev.max_shared_bytes) return cudaErrorInvalidValue;
  cudaError_t err = cudaFuncSetAttribute(simt_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  const dim3 grid((p.tokens + kSimtTokens - 1) / kSimtTokens, p.batch * p.kv_heads);
  simt_kernel<<<grid, kSimtThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace kvpress_critical
