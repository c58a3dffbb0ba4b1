// The rotary embedding's arithmetic, shared by rope_cuda.cu's kernel and the fused q/k norm + rotary
// kernel in rms_norm_cuda.cu, so that both give rope_reference's bits (megatron_jetrl/ops/exact.py):
// - f = float(position) * inv_freq[j] (one fp32 product; the reference's outer product);
// - c = dtype(cosf(f)), s = dtype(sinf(f)): the CUDA math library's correctly implemented cosf / sinf
//   (not __cosf), which torch's cos / sin kernels call, rounded to x's dtype as `.to(dtype)` does;
// - with x1 = x[j], x2 = x[j + D/2]: y[j] = dtype(dtype(x1 * c) + dtype(-x2 * s)) and
//   y[j + D/2] = dtype(dtype(x2 * c) + dtype(x1 * s)): `t * cos + rotate_half(t) * sin`, each product
//   and the sum rounded to x's dtype, as separate eager kernels round them (__fmul_rn / __fadd_rn: no
//   FMA contraction).
#pragma once

#include <cstdint>

#include "cuda_dtypes.cuh"

namespace jetrl {

// c and s of a position at frequency inv_freq, each rounded to T (returned as floats).
template <typename T>
__device__ __forceinline__ void rope_cos_sin(int64_t position, float inv_freq, float* c, float* s) {
  const float f = __fmul_rn(static_cast<float>(position), inv_freq);
  *c = rounded<T>(cosf(f));
  *s = rounded<T>(sinf(f));
}

// y[j] of the pair (x1, x2) = (x[j], x[j + D/2]).
template <typename T>
__device__ __forceinline__ T rope_first(float x1, float x2, float c, float s) {
  return Round<T>::from_float(__fadd_rn(rounded<T>(__fmul_rn(x1, c)), rounded<T>(__fmul_rn(-x2, s))));
}

// y[j + D/2] of the pair (x1, x2) = (x[j], x[j + D/2]).
template <typename T>
__device__ __forceinline__ T rope_second(float x1, float x2, float c, float s) {
  return Round<T>::from_float(__fadd_rn(rounded<T>(__fmul_rn(x2, c)), rounded<T>(__fmul_rn(x1, s))));
}

}  // namespace jetrl
