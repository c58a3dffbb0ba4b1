// The 1x128 encoding shared by the CUDA kernels that quantize (quantize_cuda.cu's tile kernel and
// the fused norm / SiLU-mul + quantization kernels of the exact forward in rms_norm_cuda.cu and
// elementwise_cuda.cu): one definition of the amax, the scale and the codes, so that a fused kernel
// gives the bytes the quantization kernel gives for the same input (tests compare them bit for bit).
// The rule itself is quantize_math.h's (shared with the CPU kernels).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda_dtypes.cuh"
#include "quantize_math.h"

namespace jetrl {
namespace quant {

constexpr uint32_t kFull = 0xffffffffu;

// Per input format: elements per 32-bit word, the |x| mask, the first non-finite |x| bit pattern,
// how to get floats out of a word, and the |x| bits of one value.
template <typename T>
struct Fmt;

template <>
struct Fmt<__nv_bfloat16> {
  static constexpr int kPerWord = 2;
  static constexpr uint32_t kAbsMask = 0x7FFF7FFFu;
  static constexpr uint32_t kNonFinite = 0x7F80u;
  __device__ static __forceinline__ uint32_t vmax(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }
  __device__ static __forceinline__ uint32_t fold(uint32_t w) { return max(w & 0xFFFFu, w >> 16); }
  __device__ static __forceinline__ float abs_value(uint32_t bits) { return __uint_as_float(bits << 16); }
  __device__ static __forceinline__ float elem(uint32_t w, int half) {
    return __uint_as_float(half ? (w & 0xFFFF0000u) : (w << 16));
  }
  __device__ static __forceinline__ uint32_t abs_bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v) & 0x7FFFu; }
};

template <>
struct Fmt<__half> {
  static constexpr int kPerWord = 2;
  static constexpr uint32_t kAbsMask = 0x7FFF7FFFu;
  static constexpr uint32_t kNonFinite = 0x7C00u;
  __device__ static __forceinline__ uint32_t vmax(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }
  __device__ static __forceinline__ uint32_t fold(uint32_t w) { return max(w & 0xFFFFu, w >> 16); }
  __device__ static __forceinline__ float abs_value(uint32_t bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
  }
  __device__ static __forceinline__ float elem(uint32_t w, int half) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(half ? (w >> 16) : (w & 0xFFFFu))));
  }
  __device__ static __forceinline__ uint32_t abs_bits(__half v) { return __half_as_ushort(v) & 0x7FFFu; }
};

template <>
struct Fmt<float> {
  static constexpr int kPerWord = 1;
  static constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
  static constexpr uint32_t kNonFinite = 0x7F800000u;
  __device__ static __forceinline__ uint32_t vmax(uint32_t a, uint32_t b) { return max(a, b); }
  __device__ static __forceinline__ uint32_t fold(uint32_t w) { return w; }
  __device__ static __forceinline__ float abs_value(uint32_t bits) { return __uint_as_float(bits); }
  __device__ static __forceinline__ float elem(uint32_t w, int) { return __uint_as_float(w); }
  __device__ static __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }
};

// amax bits (already folded) -> the fp32 scale; non-finite |x| gives NaN (the bad-block marker).
template <typename T>
__device__ __forceinline__ float scale_of_bits(uint32_t amax_bits, bool pow2, float eps) {
  const float amax = amax_bits >= Fmt<T>::kNonFinite ? INFINITY : Fmt<T>::abs_value(amax_bits);
  return scale_from_amax(amax, pow2, eps);
}

__device__ __forceinline__ float inv_scale(float scale) {
  return scale != scale ? scale : __frcp_rn(scale);
}

// Two codes, a in the low byte. satfinite saturates to +-448 exactly like the rule's clamp.
__device__ __forceinline__ uint32_t cvt2(float a, float b, float scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * scale, b * scale), __NV_SATFINITE, __NV_E4M3);
}

__device__ __forceinline__ uint32_t nan_fill(uint32_t word, bool bad) { return bad ? 0x7F7F7F7Fu : word; }

// One 1x128 group held by a whole warp, four consecutive values a lane (lane l: elements 4l .. 4l + 3,
// values of T): returns this lane's four codes as one word (element 4l in the low byte) and gives
// every lane the group's scale_inv. The amax, scale and codes of the tile kernel's rowwise groups.
template <typename T>
__device__ __forceinline__ uint32_t encode_warp_group(const T (&v)[4], bool pow2, float eps, float* scale_inv) {
  uint32_t amax = Fmt<T>::abs_bits(v[0]);
#pragma unroll
  for (int e = 1; e < 4; ++e) amax = max(amax, Fmt<T>::abs_bits(v[e]));
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) amax = max(amax, __shfl_xor_sync(kFull, amax, off));
  const float scale = scale_of_bits<T>(amax, pow2, eps);
  *scale_inv = inv_scale(scale);
  using C = Round<T>;
  const uint32_t word = cvt2(C::to_float(v[0]), C::to_float(v[1]), scale) |
                        (cvt2(C::to_float(v[2]), C::to_float(v[3]), scale) << 16);
  return nan_fill(word, scale != scale);
}

}  // namespace quant
}  // namespace jetrl
