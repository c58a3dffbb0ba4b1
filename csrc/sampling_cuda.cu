// The seeded exponential noise kernel (sampling.h): one thread per row and group of 4 columns runs
// Philox4x32-10 once (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the
// generator of curand and torch) and writes the 4 values. Integer math gives every word exactly;
// the uniform is exact in fp32 (an odd integer below 2^24 times 2^-24) and logf is CUDA's
// correctly-rounded-within-1-ulp log, the function torch's own log runs for fp32 on CUDA, so the
// reference (ops/sampling.py) computed on the GPU has the same bits. No host sync, no allocation.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "sampling.h"

namespace jetrl {
namespace {

constexpr int kThreads = 256;
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

__device__ __forceinline__ uint4 philox_round(uint4 c, uint2 k) {
  const uint32_t hi0 = __umulhi(kPhiloxM0, c.x), lo0 = kPhiloxM0 * c.x;
  const uint32_t hi1 = __umulhi(kPhiloxM1, c.z), lo1 = kPhiloxM1 * c.z;
  return make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
}

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int r = 0; r < 9; ++r) {
    c = philox_round(c, k);
    k.x += kPhiloxW0;
    k.y += kPhiloxW1;
  }
  return philox_round(c, k);
}

__device__ __forceinline__ float exponential(uint32_t x) {
  const float u = __fmul_rn(__uint2float_rn(((x >> 9) << 1) | 1u), 0x1p-24f);
  return -logf(u);
}

template <bool VEC4>
__global__ void __launch_bounds__(kThreads) exponential_noise_kernel(ExponentialNoiseArgs a) {
  const int64_t groups = (a.V + 3) / 4;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= a.B * groups) return;
  const int64_t b = i / groups, g = i % groups;
  const auto row = a.table[3 * b];
  const auto seed = static_cast<uint64_t>(a.table[3 * b + 1]);
  const auto offset = static_cast<uint64_t>(a.table[3 * b + 2]);
  const uint4 x = philox4x32_10(
      make_uint4(static_cast<uint32_t>(g), 0u, static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)),
      make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
  float* out = a.q + row * a.q_stride + 4 * g;
  const float4 v = make_float4(exponential(x.x), exponential(x.y), exponential(x.z), exponential(x.w));
  if (VEC4) {
    *reinterpret_cast<float4*>(out) = v;
  } else {
    const int64_t left = a.V - 4 * g;
    out[0] = v.x;
    if (left > 1) out[1] = v.y;
    if (left > 2) out[2] = v.z;
    if (left > 3) out[3] = v.w;
  }
}

}  // namespace

void exponential_noise_cuda(const ExponentialNoiseArgs& args, const at::Tensor& q) {
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t threads = args.B * ((args.V + 3) / 4);
  const auto blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  const bool vec4 = args.V % 4 == 0 && args.q_stride % 4 == 0 && reinterpret_cast<uintptr_t>(args.q) % 16 == 0;
  if (vec4) {
    exponential_noise_kernel<true><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    exponential_noise_kernel<false><<<blocks, kThreads, 0, stream>>>(args);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace jetrl
