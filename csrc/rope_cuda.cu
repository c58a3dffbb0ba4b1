// Rotary embedding of the exact forward on CUDA: one thread per (token, frequency j), looping over
// the heads. The arithmetic is rope_reference's (megatron_jetrl/ops/exact.py), op by op:
// - f = float(position) * inv_freq[j] (one fp32 product; the reference's outer product);
// - c = dtype(cosf(f)), s = dtype(sinf(f)): the CUDA math library's correctly implemented cosf / sinf
//   (not __cosf), which torch's cos / sin kernels call, rounded to x's dtype as `.to(dtype)` does;
// - with x1 = x[j], x2 = x[j + D/2]: y[j] = dtype(dtype(x1 * c) + dtype(-x2 * s)) and
//   y[j + D/2] = dtype(dtype(x2 * c) + dtype(x1 * s)): `t * cos + rotate_half(t) * sin`, each product
//   and the sum rounded to x's dtype, as separate eager kernels round them (__fmul_rn / __fadd_rn: no
//   FMA contraction).
// Nothing depends on other tokens, so a token gets the same bits in any batch. No host syncs and no
// allocations besides the output: capturable in a CUDA graph.
#include <c10/cuda/CUDAException.h>

#include "cuda_dtypes.cuh"
#include "rope.h"

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
  const float f = __fmul_rn(static_cast<float>(positions[token]), inv_freq[j]);
  const float c = rounded<T>(cosf(f)), s = rounded<T>(sinf(f));
  for (int64_t h = 0; h < H; ++h) {
    const T* xr = x + token * token_stride + h * head_stride;
    T* yr = y + (token * H + h) * 2 * half;
    const float x1 = Round<T>::to_float(xr[j]), x2 = Round<T>::to_float(xr[j + half]);
    yr[j] = Round<T>::from_float(__fadd_rn(rounded<T>(__fmul_rn(x1, c)), rounded<T>(__fmul_rn(-x2, s))));
    yr[j + half] = Round<T>::from_float(__fadd_rn(rounded<T>(__fmul_rn(x2, c)), rounded<T>(__fmul_rn(x1, s))));
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
