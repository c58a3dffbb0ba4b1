// Batch-invariant RMSNorm: a row's output depends on that row alone, through one fixed reduction
// order (128 lanes, then a halving tree) spelled out in megatron_jetrl/ops/rms_norm.py and
// reproduced bit for bit by rms_norm_reference there. Validated in rms_norm.cpp; kernels in
// rms_norm.cpp (CPU) and rms_norm_cuda.cu.
#pragma once

#include <ATen/ATen.h>

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

#ifdef JETRL_WITH_CUDA
void rms_norm_cuda(const RmsNormArgs& args, at::ScalarType dtype, const at::Tensor& x);
#endif

// x [R, H] bf16/fp16/fp32, weight [H] of x's dtype, H a multiple of 128 -> new contiguous [R, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// The residual add before the norm in the same launch (CUDA only; the exact forward's decoder
// layers): x and residual [R, H] of one dtype, each with its last dim contiguous ->
// (rms_norm(x + residual), x + residual), both new and contiguous.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);

}  // namespace jetrl
