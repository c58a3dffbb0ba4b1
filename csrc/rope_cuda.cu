// Rotary embedding of the exact forward on CUDA: one thread per (token, frequency j), looping over
// the heads. The arithmetic is rope_reference's (megatron_jetrl/ops/exact.py), op by op, written out in
// rope_cuda.cuh. Nothing depends on other tokens, so a token gets the same bits in any batch. No host
// syncs and no allocations besides the output: capturable in a CUDA graph.
#include <c10/cuda/CUDAException.h>

#include "cuda_dtypes.cuh"
#include "rope.h"
#include "rope_cuda.cuh"

namespace jetrl {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const T* __restrict__ x, const int64_t* __restrict__ positions, const float* __restrict__ inv_freq,
                T* __restrict__ y, int64_t T_, int64_t H, int64_t half, int64_t token_stride, int64_t head_stride) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= T_ * half) return;
  const int64_t token = i / half, j = i % half;
  float c, s;
  rope_cos_sin<T>(positions[token], inv_freq[j], &c, &s);
#pragma unroll 4
  for (int64_t h = 0; h < H; ++h) {
    const T* xr = x + token * token_stride + h * head_stride;
    T* yr = y + (token * H + h) * 2 * half;
    const float x1 = Round<T>::to_float(xr[j]), x2 = Round<T>::to_float(xr[j + half]);
    yr[j] = rope_first<T>(x1, x2, c, s);
    yr[j + half] = rope_second<T>(x1, x2, c, s);
  }
}

template <typename T>
void launch_typed(const RopeArgs& a, cudaStream_t stream) {
  const int64_t threads = a.T * a.half;
  const auto blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  rope_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(a.x), a.positions, a.inv_freq,
                                                  static_cast<T*>(a.y), a.T, a.H, a.half, a.token_stride,
                                                  a.head_stride);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void rope_cuda(const RopeArgs& args, at::ScalarType dtype, const at::Tensor& x) {
  by_dtype_on_stream(x, dtype, "rope",
                     [&](auto t, cudaStream_t stream) { launch_typed<decltype(t)>(args, stream); });
}

}  // namespace jetrl
