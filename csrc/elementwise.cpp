// Validation and dispatch of the exact forward's elementwise kernels (see elementwise.h).
#include "elementwise.h"

#include "dtypes.h"
#include "messages.h"
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace jetrl {
namespace {

void check_cuda_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(float_dtype(x.scalar_type()), op, ": x must be bfloat16, float16 or float32; got ", x.scalar_type());
  TORCH_CHECK(x.is_cuda(), op, ": the kernel runs on CUDA; x is on ", x.device().str(),
              " (ops.exact computes the reference elsewhere)");
#ifndef JETRL_WITH_CUDA
  TORCH_CHECK(false, op, ": megatron_jetrl._C was built without CUDA kernels; rebuild on a machine with nvcc and a "
              "CUDA build of torch: pip install --no-build-isolation -e .");
#endif
}

}  // namespace

at::Tensor ordered_sum(const at::Tensor& parts) {
  check_cuda_input(parts, "ordered_sum");
  TORCH_CHECK(parts.dim() >= 1 && parts.size(0) >= 1, "ordered_sum: parts must be [tp, ...] with tp >= 1; got shape ",
              dims(parts.sizes()));
  TORCH_CHECK(parts.is_contiguous(), "ordered_sum: parts must be contiguous; got strides ", dims(parts.strides()));
  at::Tensor y = at::empty(parts.sizes().slice(1), parts.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
#ifdef JETRL_WITH_CUDA
  OrderedSumArgs args;
  args.parts = parts.data_ptr();
  args.y = y.data_ptr();
  args.tp = parts.size(0);
  args.N = y.numel();
  ordered_sum_cuda(args, parts.scalar_type(), parts);
#endif
  return y;
}

at::Tensor silu_mul(const at::Tensor& x) {
  check_cuda_input(x, "silu_mul");
  TORCH_CHECK(x.dim() == 2, "silu_mul: x must be 2-D [R, 2I]; got shape ", dims(x.sizes()));
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_mul: x's last dim must be even ([gate | up]); got ", dims(x.sizes()));
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "silu_mul: x's last dim must be contiguous (stride 1); got strides ",
              dims(x.strides()));
  const int64_t R = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({R, I}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
#ifdef JETRL_WITH_CUDA
  SiluMulArgs args;
  args.x = x.data_ptr();
  args.y = y.data_ptr();
  args.R = R;
  args.I = I;
  args.x_stride = x.stride(0);
  silu_mul_cuda(args, x.scalar_type(), x);
#endif
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_quant(const at::Tensor& x, bool pow2_scales, double quant_eps,
                                                  int64_t m_align) {
  check_cuda_input(x, "silu_mul_quant");
  TORCH_CHECK(x.dim() == 2, "silu_mul_quant: x must be 2-D [R, 2I]; got shape ", dims(x.sizes()));
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % 256 == 0, "silu_mul_quant: x's last dim must be 2I with I a positive "
              "multiple of 128 (whole 1x128 groups); got ", dims(x.sizes()));
  TORCH_CHECK(x.stride(1) == 1, "silu_mul_quant: x's last dim must be contiguous (stride 1); got strides ",
              dims(x.strides()));
  const int64_t R = x.size(0), I = x.size(1) / 2;
  auto [q, s, ld] = rows_quantized_output(x, R, I, quant_eps, m_align, "silu_mul_quant");
  if (R == 0) return {q, s};
#ifdef JETRL_WITH_CUDA
  SiluMulQuantArgs args;
  args.x = x.data_ptr();
  args.q = static_cast<uint8_t*>(q.data_ptr());
  args.s = s.data_ptr<float>();
  args.R = R;
  args.I = I;
  args.x_stride = x.stride(0);
  args.s_stride = ld;
  args.pow2 = pow2_scales;
  args.quant_eps = static_cast<float>(quant_eps);
  silu_mul_quant_cuda(args, x.scalar_type(), x);
#endif
  return {q, s};
}

at::Tensor static_fp8_quant(const at::Tensor& x, const at::Tensor& scale) {
  check_cuda_input(x, "static_fp8_quant");
  TORCH_CHECK(x.is_contiguous(), "static_fp8_quant: x must be contiguous; got strides ", dims(x.strides()),
              ". Call .contiguous() first");
  TORCH_CHECK(scale.defined() && scale.numel() == 1, "static_fp8_quant: scale must hold one value; got shape ",
              scale.defined() ? dims(scale.sizes()) : std::string("undefined"));
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "static_fp8_quant: scale must be float32; got ", scale.scalar_type());
  TORCH_CHECK(scale.device() == x.device(), "static_fp8_quant: scale is on ", scale.device().str(),
              "; it must be on x's device ", x.device().str());
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn).memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return y;
#ifdef JETRL_WITH_CUDA
  StaticQuantArgs args;
  args.x = x.data_ptr();
  args.scale = scale.data_ptr<float>();
  args.y = y.data_ptr();
  args.N = x.numel();
  static_fp8_quant_cuda(args, x.scalar_type(), x);
#endif
  return y;
}

}  // namespace jetrl
