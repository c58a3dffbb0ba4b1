// The exact forward's elementwise kernels on CUDA. Each reproduces, element by element, the eager
// torch ops it replaces (megatron_jetrl/ops/exact.py), with the same roundings:
// - silu_mul: s = dtype(g / (1 + expf(-g))) with g = float(gate): torch's silu kernel (fp32 opmath,
//   the CUDA math library's expf, an IEEE division), rounded to x's dtype as its output is; then
//   y = dtype(float(s) * float(up)): torch's mul of two tensors of that dtype;
// - static_fp8_quant: v = float(x) / scale (an IEEE division, tensor by tensor), clamped to ±448 with
//   NaN passed through (torch's clamp), then torch's own float -> e4m3 conversion
//   (c10::Float8_e4m3fn, the header torch's `.to(torch.float8_e4m3fn)` runs).
// - silu_mul_quant: silu_mul's values quantized in 1x128 groups in the same launch, with the bytes
//   quantize_cuda.cu's kernel makes of silu_mul's output (the encoding is quantize_cuda.cuh's).
// - ordered_sum: y = dtype(((float(p0) + float(p1)) + ...) + float(p[tp-1])), the TP ranks' partial
//   results in rank order: torch's float copy of p0 then an in-place fp32 add of each next part, then
//   the rounding to the dtype (ordered_sum_reference), in one launch instead of tp + 1.
// __fdiv_rn / __fadd_rn / __fmul_rn keep every operation one IEEE rounding (no FMA contraction).
// Each thread handles VEC consecutive elements (16-byte loads where the layout allows, else one);
// nothing depends on other rows or on the grid, so an element gets the same bits in any batch. No host
// syncs and no allocations besides the output: capturable in a CUDA graph.
#include <c10/cuda/CUDAException.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cstdint>

#include "cuda_dtypes.cuh"
#include "elementwise.h"
#include "quantize_cuda.cuh"

namespace jetrl {
namespace {

constexpr int kThreads = 256;

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T>
__device__ __forceinline__ float silu_rounded(float g) {
  return rounded<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    silu_mul_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t R, int64_t I, int64_t x_stride) {
  const int64_t packs = I / VEC;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= R * packs) return;
  const int64_t row = i / packs, col = (i % packs) * VEC;
  const T* xr = x + row * x_stride;
  const Pack<T, VEC> gate = *reinterpret_cast<const Pack<T, VEC>*>(xr + col);
  const Pack<T, VEC> up = *reinterpret_cast<const Pack<T, VEC>*>(xr + I + col);
  Pack<T, VEC> out;
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const float s = silu_rounded<T>(Round<T>::to_float(gate.v[e]));
    out.v[e] = Round<T>::from_float(__fmul_rn(s, Round<T>::to_float(up.v[e])));
  }
  *reinterpret_cast<Pack<T, VEC>*>(y + row * I + col) = out;
}

// SiLU·mul fused with the 1x128 FP8 quantization of its output (the exact forward's activation before
// the down projection): warp k of the grid encodes group k of the [R, I] output (lane l: its columns
// 4l .. 4l + 3), each value silu_mul_kernel's and each group encoded as the quantization kernel
// encodes it (quantize_cuda.cuh).
constexpr int kQuantWarps = 4;

template <typename T, bool kVec4>
__global__ void __launch_bounds__(kQuantWarps * 32) silu_mul_quant_kernel(SiluMulQuantArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t groups = a.I / 128;
  const int64_t group = static_cast<int64_t>(blockIdx.x) * kQuantWarps + threadIdx.x / 32;
  if (group >= a.R * groups) return;  // whole warps: the shuffles inside see every lane of theirs
  const int64_t row = group / groups, g = group % groups, c0 = g * 128 + 4 * lane;
  const T* xr = static_cast<const T*>(a.x) + row * a.x_stride;
  Pack<T, 4> gate, up;  // one 4-value load each where the layout is aligned to it
  if constexpr (kVec4) {
    gate = *reinterpret_cast<const Pack<T, 4>*>(xr + c0);
    up = *reinterpret_cast<const Pack<T, 4>*>(xr + a.I + c0);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      gate.v[e] = xr[c0 + e];
      up.v[e] = xr[a.I + c0 + e];
    }
  }
  T v[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float s = silu_rounded<T>(Round<T>::to_float(gate.v[e]));
    v[e] = Round<T>::from_float(__fmul_rn(s, Round<T>::to_float(up.v[e])));
  }
  float scale_inv;
  const uint32_t codes = quant::encode_warp_group<T>(v, a.pow2, a.quant_eps, &scale_inv);
  *reinterpret_cast<uint32_t*>(a.q + row * a.I + c0) = codes;
  if (lane == 0) a.s[g * a.s_stride + row] = scale_inv;
}

__device__ __forceinline__ uint8_t e4m3_code(float v, float scale) {
  float q = __fdiv_rn(v, scale);
  if (!isnan(q)) q = fminf(fmaxf(q, -448.0f), 448.0f);
  return c10::Float8_e4m3fn(q).x;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    static_fp8_quant_kernel(const T* __restrict__ x, const float* __restrict__ scale, uint8_t* __restrict__ y,
                            int64_t N) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  if (i >= N) return;
  const float s = *scale;
  const Pack<T, VEC> in = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
  Pack<uint8_t, VEC> out;
#pragma unroll
  for (int e = 0; e < VEC; ++e) out.v[e] = e4m3_code(Round<T>::to_float(in.v[e]), s);
  *reinterpret_cast<Pack<uint8_t, VEC>*>(y + i) = out;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    ordered_sum_kernel(const T* __restrict__ parts, T* __restrict__ y, int64_t tp, int64_t N) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  if (i >= N) return;
  const Pack<T, VEC> first = *reinterpret_cast<const Pack<T, VEC>*>(parts + i);
  float acc[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc[e] = Round<T>::to_float(first.v[e]);
  for (int64_t r = 1; r < tp; ++r) {
    const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(parts + r * N + i);
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = __fadd_rn(acc[e], Round<T>::to_float(p.v[e]));
  }
  Pack<T, VEC> out;
#pragma unroll
  for (int e = 0; e < VEC; ++e) out.v[e] = Round<T>::from_float(acc[e]);
  *reinterpret_cast<Pack<T, VEC>*>(y + i) = out;
}

// Elements per thread: 16 bytes of T where every access stays aligned, else 1.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

unsigned blocks_for(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

template <typename T>
void launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
  constexpr int V = kVec<T>;
  const auto* x = static_cast<const T*>(a.x);
  auto* y = static_cast<T*>(a.y);
  if (a.I % V == 0 && a.x_stride % V == 0 && aligned(x, 16) && aligned(y, 16)) {
    silu_mul_kernel<T, V><<<blocks_for(a.R * (a.I / V)), kThreads, 0, stream>>>(x, y, a.R, a.I, a.x_stride);
  } else {
    silu_mul_kernel<T, 1><<<blocks_for(a.R * a.I), kThreads, 0, stream>>>(x, y, a.R, a.I, a.x_stride);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_static_fp8_quant(const StaticQuantArgs& a, cudaStream_t stream) {
  constexpr int V = kVec<T>;
  const auto* x = static_cast<const T*>(a.x);
  auto* y = static_cast<uint8_t*>(a.y);
  if (a.N % V == 0 && aligned(x, 16) && aligned(y, V)) {
    static_fp8_quant_kernel<T, V><<<blocks_for(a.N / V), kThreads, 0, stream>>>(x, a.scale, y, a.N);
  } else {
    static_fp8_quant_kernel<T, 1><<<blocks_for(a.N), kThreads, 0, stream>>>(x, a.scale, y, a.N);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_ordered_sum(const OrderedSumArgs& a, cudaStream_t stream) {
  constexpr int V = kVec<T>;
  const auto* parts = static_cast<const T*>(a.parts);
  auto* y = static_cast<T*>(a.y);
  if (a.N % V == 0 && aligned(parts, 16) && aligned(y, 16)) {  // every part's row starts aligned too
    ordered_sum_kernel<T, V><<<blocks_for(a.N / V), kThreads, 0, stream>>>(parts, y, a.tp, a.N);
  } else {
    ordered_sum_kernel<T, 1><<<blocks_for(a.N), kThreads, 0, stream>>>(parts, y, a.tp, a.N);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void ordered_sum_cuda(const OrderedSumArgs& args, at::ScalarType dtype, const at::Tensor& parts) {
  by_dtype_on_stream(parts, dtype, "ordered_sum",
                     [&](auto t, cudaStream_t stream) { launch_ordered_sum<decltype(t)>(args, stream); });
}

void silu_mul_quant_cuda(const SiluMulQuantArgs& args, at::ScalarType dtype, const at::Tensor& x) {
  by_dtype_on_stream(x, dtype, "silu_mul_quant", [&](auto t, cudaStream_t stream) {
    const int64_t warps = args.R * (args.I / 128);
    using T = decltype(t);
    const auto blocks = static_cast<unsigned>((warps + kQuantWarps - 1) / kQuantWarps);
    if (args.x_stride % 4 == 0 && aligned(args.x, 4 * sizeof(T))) {  // I is a multiple of 128
      silu_mul_quant_kernel<T, true><<<blocks, kQuantWarps * 32, 0, stream>>>(args);
    } else {
      silu_mul_quant_kernel<T, false><<<blocks, kQuantWarps * 32, 0, stream>>>(args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void silu_mul_cuda(const SiluMulArgs& args, at::ScalarType dtype, const at::Tensor& x) {
  by_dtype_on_stream(x, dtype, "silu_mul",
                     [&](auto t, cudaStream_t stream) { launch_silu_mul<decltype(t)>(args, stream); });
}

void static_fp8_quant_cuda(const StaticQuantArgs& args, at::ScalarType dtype, const at::Tensor& x) {
  by_dtype_on_stream(x, dtype, "static_fp8_quant",
                     [&](auto t, cudaStream_t stream) { launch_static_fp8_quant<decltype(t)>(args, stream); });
}

}  // namespace jetrl
