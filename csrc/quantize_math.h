// The FP8 block-scaling rule shared by the CPU and CUDA kernels; the definition lives in
// megatron_jetrl/precision/blockwise.py and both implementations are tested bit for bit against it.
//
//   amax  = max |x| over the block, +inf if the block holds NaN/Inf ("bad" block)
//   amax  = eps if amax < eps
//   scale = 1 if amax == 0; FLT_MAX if 448/amax overflows; else 448/amax   (fp32, IEEE division)
//   scale = 2^floor(log2 scale) if pow2 (clear the mantissa bits)
//   code  = e4m3(clamp(x*scale, -448, 448)) rounded to nearest even; scale_inv = 1/scale
//   bad block: scale = scale_inv = NaN and every code 0x7F
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define JETRL_HD __host__ __device__ __forceinline__
#else
#define JETRL_HD inline
#endif

namespace jetrl {

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kNaNCode = 0x7F;
constexpr int kBlock = 128;

JETRL_HD uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JETRL_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// |x| for the amax reduction; NaN/Inf map to +inf so one max() also carries the bad-block flag.
JETRL_HD float amax_term(float x) {
  return (x - x == 0.0f) ? fabsf(x) : INFINITY;
}

JETRL_HD float scale_from_amax(float amax, bool pow2, float eps) {
  if (amax == INFINITY) return NAN;
  if (amax < eps) amax = eps;
  if (amax == 0.0f) return 1.0f;
  float scale = kE4M3Max / amax;
  if (scale == INFINITY) scale = FLT_MAX;
  if (pow2) scale = bits_float(float_bits(scale) & 0x7F800000u);
  return scale;
}

JETRL_HD float scale_inv_of(float scale) {
  return scale != scale ? scale : 1.0f / scale;
}

JETRL_HD float clamp_e4m3(float v) {
  return fminf(fmaxf(v, -kE4M3Max), kE4M3Max);
}

}  // namespace jetrl
