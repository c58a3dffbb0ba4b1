// Batch-invariant RMSNorm: a row's output depends on that row alone, through one fixed reduction
// order (128 lanes, then a halving tree) spelled out in megatron_jetrl/ops/rms_norm.py and
// reproduced bit for bit by rms_norm_reference there. Validated in rms_norm.cpp; kernels in
// rms_norm.cpp (CPU) and rms_norm_cuda.cu.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace jetrl {

// Lanes per row: lane t sums the squares of columns t, t + 128, t + 256, ... in order.
constexpr int kNormLanes = 128;

// One launch: y [R, H] (contiguous) = rms_norm(x [R, H], row stride x_stride, last dim
// contiguous; w [H]); x, w and y share one dtype. With a residual (add_rms_norm): first
// total [R, H] (contiguous) = dtype(float(x) + float(residual)), torch's add of two such tensors,
// residual [R, H] with row stride r_stride; then y = rms_norm(total).
struct RmsNormArgs {
  const void* x = nullptr;
  const void* w = nullptr;
  void* y = nullptr;
  const void* residual = nullptr;
  void* total = nullptr;
  int64_t R = 0, H = 0, x_stride = 0, r_stride = 0;
  float eps = 0.0f;
};

// One launch of rms_norm_quant: the norm of rms_norm (with a residual: of the rounded sum, which it
// also stores to total) quantized in 1x128 groups as quantize_1x128 quantizes it: codes q [R, H]
// e4m3 (contiguous) and scale_inv s [R, H / 128] fp32, column-major with column stride s_stride
// (>= R): s[g * s_stride + r].
struct NormQuantArgs {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* residual = nullptr;
  void* total = nullptr;
  uint8_t* q = nullptr;
  float* s = nullptr;
  int64_t R = 0, H = 0, x_stride = 0, r_stride = 0, s_stride = 0;
  float eps = 0.0f;
  bool pow2 = false;
  float quant_eps = 0.0f;
};

// One launch of qk_norm_rope: every head of q [T, Hq * D] (row stride q_stride) and k [T, Hk * D] (row
// stride k_stride) normed as rms_norm norms a row of D (weights wq / wk [D], eps_q / eps_k), then rotated
// as rope rotates it (positions [T] int64, inv_freq [D / 2] fp32) into yq [T, Hq * D] and yk [T, Hk * D]
// (contiguous). D a multiple of 128, at most 512.
struct QkNormRopeArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* wq = nullptr;
  const void* wk = nullptr;
  const int64_t* positions = nullptr;
  const float* inv_freq = nullptr;
  void* yq = nullptr;
  void* yk = nullptr;
  int64_t T = 0, Hq = 0, Hk = 0, D = 0, q_stride = 0, k_stride = 0;
  float eps_q = 0.0f, eps_k = 0.0f;
};

#ifdef JETRL_WITH_CUDA
void rms_norm_cuda(const RmsNormArgs& args, at::ScalarType dtype, const at::Tensor& x);
void qk_norm_rope_cuda(const QkNormRopeArgs& args, at::ScalarType dtype, const at::Tensor& q);
void rms_norm_quant_cuda(const NormQuantArgs& args, at::ScalarType dtype, const at::Tensor& x);
#endif

// x [R, H] bf16/fp16/fp32, weight [H] of x's dtype, H a multiple of 128 -> new contiguous [R, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The residual add before the norm in the same launch (CUDA only; the exact forward's decoder
// layers): x and residual [R, H] of one dtype, each with its last dim contiguous ->
// (rms_norm(x + residual), x + residual), both new and contiguous.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

// The exact forward's q/k norms and rotary embedding in one launch (CUDA only): q [T, Hq * D] and
// k [T, Hk * D] of one dtype (rows of any stride, the last dim contiguous; D = 2 * inv_freq's length, a
// multiple of 128 up to 512), wq / wk [D] of that dtype, positions [T] int64, inv_freq [D / 2] fp32 ->
// (rope(rms_norm(q's heads)), rope(rms_norm(k's heads))), new and contiguous: the bytes of the norm
// kernel on each head and the rope kernel on its output.
std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& wq,
                                                const at::Tensor& wk, double eps_q, double eps_k,
                                                const at::Tensor& positions, const at::Tensor& inv_freq);

// The norm fused with the 1x128 FP8 quantization of its output (CUDA only; the exact forward's norm
// before an FP8 linear): x [R, H] (and residual, when defined: the residual add first) ->
// (q [R, H] float8_e4m3fn, scale_inv [R, H / 128] fp32 with strides (1, R rounded up to m_align),
// total = x + residual or undefined): the bytes of quantize_1x128(rms_norm(...)) with these scale
// options, the scales in the layout a block-FP8 GEMM reads (m_align 4: DeepGEMM's TMA alignment).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_quant(const at::Tensor& x,
                                                              const std::optional<at::Tensor>& residual,
                                                              const at::Tensor& weight, double eps, bool pow2_scales,
                                                              double quant_eps, int64_t m_align);

}  // namespace jetrl
