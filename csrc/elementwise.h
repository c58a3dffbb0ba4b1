// The exact forward's elementwise ops as single CUDA kernels: SiLU·mul (megatron's SwiGLU rounding),
// the static FP8 quantization of an FP8 KV cache's query, and the ordered sum of the TP ranks' partial
// results (ordered_sum_reference). Each computes, element by element, the
// value of the eager torch ops it replaces (megatron_jetrl/ops/exact.py: silu_mul_reference,
// static_fp8_quant_reference), so kernel and reference agree bit for bit; one launch instead of
// two (SiLU·mul) or four (the quantization). Validated in elementwise.cpp; CUDA only (elsewhere
// ops.exact computes the references).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace jetrl {

// One launch of silu_mul: y [R, I] (contiguous) = silu(x[:, :I]) * x[:, I:], x [R, 2I] with row
// stride x_stride and its last dim contiguous.
struct SiluMulArgs {
  const void* x = nullptr;
  void* y = nullptr;
  int64_t R = 0, I = 0, x_stride = 0;
};

// One launch of static_fp8_quant: y [N] e4m3 = e4m3(clamp(float(x) / *scale, -448, 448)), x [N]
// contiguous, scale one fp32 on the device (read by the kernel: no host sync).
struct StaticQuantArgs {
  const void* x = nullptr;
  const float* scale = nullptr;
  void* y = nullptr;
  int64_t N = 0;
};

// One launch of silu_mul_quant: silu_mul's [R, I] values quantized in 1x128 groups: codes q [R, I]
// e4m3 (contiguous) and scale_inv s [R, I / 128] fp32, column-major with column stride s_stride.
struct SiluMulQuantArgs {
  const void* x = nullptr;
  uint8_t* q = nullptr;
  float* s = nullptr;
  int64_t R = 0, I = 0, x_stride = 0, s_stride = 0;
  bool pow2 = false;
  float quant_eps = 0.0f;
};

// One launch of ordered_sum: y [N] = dtype(((float(p[0]) + float(p[1])) + ...) + float(p[tp - 1])) for
// parts p [tp, N] contiguous: the fp32 sum in rank order, rounded once.
struct OrderedSumArgs {
  const void* parts = nullptr;
  void* y = nullptr;
  int64_t tp = 0, N = 0;
};

#ifdef JETRL_WITH_CUDA
void ordered_sum_cuda(const OrderedSumArgs& args, at::ScalarType dtype, const at::Tensor& parts);
void silu_mul_cuda(const SiluMulArgs& args, at::ScalarType dtype, const at::Tensor& x);
void silu_mul_quant_cuda(const SiluMulQuantArgs& args, at::ScalarType dtype, const at::Tensor& x);
void static_fp8_quant_cuda(const StaticQuantArgs& args, at::ScalarType dtype, const at::Tensor& x);
#endif

// x [R, 2I] bf16/fp16/fp32 on CUDA, last dim contiguous -> new contiguous [R, I].
at::Tensor silu_mul(const at::Tensor& x);

// silu_mul fused with the 1x128 FP8 quantization of its output: x [R, 2I] as for silu_mul, I a multiple
// of 128 -> (q [R, I] float8_e4m3fn, scale_inv [R, I / 128] fp32 with strides (1, R rounded up to
// m_align)): the bytes of quantize_1x128(silu_mul(x)) with these scale options.
std::tuple<at::Tensor, at::Tensor> silu_mul_quant(const at::Tensor& x, bool pow2_scales, double quant_eps,
                                                  int64_t m_align);

// parts [tp, ...] bf16/fp16/fp32 on CUDA, contiguous, tp >= 1 -> new contiguous [...]: the TP ranks' partial
// results summed in rank order in fp32 and rounded once (the exact mode's TP reduction).
at::Tensor ordered_sum(const at::Tensor& parts);

// x bf16/fp16/fp32 on CUDA, contiguous, any shape; scale fp32 with one element on x's device -> new
// float8_e4m3fn tensor of x's shape.
at::Tensor static_fp8_quant(const at::Tensor& x, const at::Tensor& scale);

}  // namespace jetrl
