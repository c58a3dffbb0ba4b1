// CPU kernels: the rule of quantize_math.h in plain loops, parallel over groups. They give the
// CPU build real kernels to test bit for bit against the torch reference in CI.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "dtypes.h"
#include "quantize.h"
#include "quantize_math.h"

namespace jetrl {
namespace {

inline uint8_t encode(float v, float scale) {
  if (scale != scale) return kNaNCode;
  return c10::Float8_e4m3fn(clamp_e4m3(v * scale)).x;
}

// Quantizes the group x[r0:r1, c0:c1] (at most 128x128) with one scale; writes codes row-major
// into q (if set) and transposed into qt (if set); returns scale_inv.
template <typename T>
float quantize_group(const T* x, int64_t M, int64_t K, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                     uint8_t* q, uint8_t* qt, bool pow2, float eps) {
  float amax = 0.0f;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, amax_term(static_cast<float>(x[r * K + c])));
  const float scale = scale_from_amax(amax, pow2, eps);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      const uint8_t code = encode(static_cast<float>(x[r * K + c]), scale);
      if (q) q[r * K + c] = code;
      if (qt) qt[c * M + r] = code;
    }
  }
  return scale_inv_of(scale);
}

template <typename T>
void run(const QuantizeArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const int64_t M = a.M, K = a.K;
  const int64_t Mb = (M + kBlock - 1) / kBlock, Kb = (K + kBlock - 1) / kBlock;
  if (a.s_blk) {
    at::parallel_for(0, Mb * Kb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t mb = t / Kb, kb = t % Kb;
        a.s_blk[t] = quantize_group(x, M, K, mb * kBlock, std::min(M, (mb + 1) * kBlock), kb * kBlock,
                                    std::min(K, (kb + 1) * kBlock), a.q, a.qt, a.pow2, a.eps);
      }
    });
    return;
  }
  if (a.q) {
    at::parallel_for(0, M * Kb, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t m = t / Kb, kb = t % Kb;
        a.s_row[kb * M + m] = quantize_group(x, M, K, m, m + 1, kb * kBlock, std::min(K, (kb + 1) * kBlock),
                                             a.q, nullptr, a.pow2, a.eps);
      }
    });
  }
  if (a.qt) {
    at::parallel_for(0, K * Mb, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t k = t / Mb, mb = t % Mb;
        a.s_col[mb * K + k] = quantize_group(x, M, K, mb * kBlock, std::min(M, (mb + 1) * kBlock), k, k + 1,
                                             nullptr, a.qt, a.pow2, a.eps);
      }
    });
  }
}

}  // namespace

void quantize_cpu(const QuantizeArgs& args, at::ScalarType dtype) {
  by_cpu_dtype(dtype, "quantize", [&](auto t) { run<decltype(t)>(args); });
}

}  // namespace jetrl
