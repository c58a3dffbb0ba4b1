// Input validation, output allocation and device dispatch for the quantization kernels.
#include "dtypes.h"
#include "messages.h"
#include "quantize.h"
#include "quantize_math.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace jetrl {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_input(const at::Tensor& x, double eps, const char* op) {
  TORCH_CHECK(x.defined(), op, ": x is undefined");
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K]; got ", std::to_string(x.dim()), "-D shape ", dims(x.sizes()));
  const auto dt = x.scalar_type();
  TORCH_CHECK(float_dtype(dt), op, ": x must be bfloat16, float16 or float32; got ", dt);
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous (row-major); got strides ", dims(x.strides()),
              ". Call .contiguous() first");
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), op, ": x must be on CPU or CUDA; got ", x.device().str());
#ifndef JETRL_WITH_CUDA
  TORCH_CHECK(!x.is_cuda(), op,
              ": x is on CUDA but megatron_jetrl._C was built without CUDA kernels; rebuild on a "
              "machine with nvcc and a CUDA build of torch: pip install --no-build-isolation -e .");
#endif
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps must be a finite number >= 0; got ", std::to_string(eps));
  TORCH_CHECK(ceil_div(x.size(0), kBlock) * ceil_div(x.size(1), kBlock) < std::numeric_limits<int32_t>::max(), op,
              ": x has too many 128x128 tiles for one launch: ", dims(x.sizes()));
}

QuantizeArgs input_args(const at::Tensor& x, bool pow2_scales, double eps) {
  QuantizeArgs args;
  args.x = x.data_ptr();
  args.M = x.size(0);
  args.K = x.size(1);
  args.pow2 = pow2_scales;
  args.eps = static_cast<float>(eps);
  return args;
}

void launch(const QuantizeArgs& args, const at::Tensor& x) {
  if (args.M == 0 || args.K == 0) return;
#ifdef JETRL_WITH_CUDA
  if (x.is_cuda()) {
    quantize_cuda(args, x.scalar_type(), x);
    return;
  }
#endif
  quantize_cpu(args, x.scalar_type());
}

}  // namespace

std::vector<at::Tensor> quantize_1x128(const at::Tensor& x, bool rowwise, bool columnwise, bool pow2_scales,
                                       double eps) {
  check_input(x, eps, "quantize_1x128");
  TORCH_CHECK(rowwise || columnwise, "quantize_1x128: ask for rowwise, columnwise or both");
  const int64_t M = x.size(0), K = x.size(1);
  const auto codes = x.options().dtype(at::kFloat8_e4m3fn);
  const auto scales = x.options().dtype(at::kFloat);
  at::Tensor q, s_row, qt, s_col;
  QuantizeArgs args = input_args(x, pow2_scales, eps);
  if (rowwise) {
    q = at::empty({M, K}, codes);
    s_row = at::empty({ceil_div(K, kBlock), M}, scales);
    args.q = static_cast<uint8_t*>(q.data_ptr());
    args.s_row = s_row.data_ptr<float>();
  }
  if (columnwise) {
    qt = at::empty({K, M}, codes);
    s_col = at::empty({ceil_div(M, kBlock), K}, scales);
    args.qt = static_cast<uint8_t*>(qt.data_ptr());
    args.s_col = s_col.data_ptr<float>();
  }
  launch(args, x);
  return {q, rowwise ? s_row.t() : s_row, qt, columnwise ? s_col.t() : s_col};
}

std::vector<at::Tensor> quantize_128x128(const at::Tensor& x, bool with_transpose, bool pow2_scales, double eps) {
  check_input(x, eps, "quantize_128x128");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor s = at::empty({ceil_div(M, kBlock), ceil_div(K, kBlock)}, x.options().dtype(at::kFloat));
  at::Tensor qt;
  QuantizeArgs args = input_args(x, pow2_scales, eps);
  args.q = static_cast<uint8_t*>(q.data_ptr());
  args.s_blk = s.data_ptr<float>();
  if (with_transpose) {
    qt = at::empty({K, M}, x.options().dtype(at::kFloat8_e4m3fn));
    args.qt = static_cast<uint8_t*>(qt.data_ptr());
  }
  launch(args, x);
  return {q, s, qt};
}

bool with_cuda() {
#ifdef JETRL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

RowsQuantized rows_quantized_output(const at::Tensor& x, int64_t R, int64_t K, double quant_eps, int64_t m_align,
                                    const char* op) {
  TORCH_CHECK(std::isfinite(quant_eps) && quant_eps >= 0.0, op, ": quant_eps must be a finite number >= 0; got ",
              std::to_string(quant_eps));
  TORCH_CHECK(m_align >= 1, op, ": m_align must be >= 1; got ", std::to_string(m_align));
  const int64_t ld = std::max<int64_t>((R + m_align - 1) / m_align * m_align, 1);
  at::Tensor q = at::empty({R, K}, x.options().dtype(at::kFloat8_e4m3fn).memory_format(at::MemoryFormat::Contiguous));
  at::Tensor s = at::empty_strided({R, K / kBlock}, {1, ld}, x.options().dtype(at::kFloat));
  return {q, s, ld};
}

}  // namespace jetrl
