// Validation and dispatch of the exact forward's rotary embedding (see rope.h).
#include "dtypes.h"
#include "messages.h"
#include "rope.h"

#include <string>

namespace jetrl {
namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq) {
  TORCH_CHECK(x.defined() && positions.defined() && inv_freq.defined(), "rope: x, positions or inv_freq is undefined");
  TORCH_CHECK(x.dim() == 3, "rope: x must be 3-D [T, H, D]; got shape ", dims(x.sizes()));
  const int64_t D = x.size(2);
  TORCH_CHECK(D > 0 && D % 2 == 0, "rope: the head dim D must be even and positive; got D = ", std::to_string(D));
  TORCH_CHECK(float_dtype(x.scalar_type()), "rope: x must be bfloat16, float16 or float32; got ", x.scalar_type());
  TORCH_CHECK(x.stride(2) == 1, "rope: x's last dim must be contiguous (stride 1); got strides ", dims(x.strides()));
  TORCH_CHECK(x.is_cuda(), "rope: the kernel runs on CUDA; x is on ", x.device().str(),
              " (ops.exact.rope computes the reference elsewhere)");
#ifndef JETRL_WITH_CUDA
  TORCH_CHECK(false, "rope: megatron_jetrl._C was built without CUDA kernels; rebuild on a machine with nvcc and a "
              "CUDA build of torch: pip install --no-build-isolation -e .");
#endif
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == x.size(0), "rope: positions must be 1-D [T] = [",
              std::to_string(x.size(0)), "]; got shape ", dims(positions.sizes()));
  TORCH_CHECK(positions.scalar_type() == at::kLong, "rope: positions must be int64; got ", positions.scalar_type());
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.size(0) == D / 2, "rope: inv_freq must be 1-D [D / 2] = [",
              std::to_string(D / 2), "]; got shape ", dims(inv_freq.sizes()));
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, "rope: inv_freq must be float32; got ", inv_freq.scalar_type());
  TORCH_CHECK(positions.is_contiguous() && inv_freq.is_contiguous(), "rope: positions and inv_freq must be contiguous");
  TORCH_CHECK(positions.device() == x.device() && inv_freq.device() == x.device(),
              "rope: positions and inv_freq must be on x's device ", x.device().str());
}

}  // namespace

at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq) {
  check_inputs(x, positions, inv_freq);
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return y;
#ifdef JETRL_WITH_CUDA
  RopeArgs args;
  args.x = x.data_ptr();
  args.positions = positions.data_ptr<int64_t>();
  args.inv_freq = inv_freq.data_ptr<float>();
  args.y = y.data_ptr();
  args.T = x.size(0);
  args.H = x.size(1);
  args.half = x.size(2) / 2;
  args.token_stride = x.stride(0);
  args.head_stride = x.stride(1);
  rope_cuda(args, x.scalar_type(), x);
#endif
  return y;
}

}  // namespace jetrl
