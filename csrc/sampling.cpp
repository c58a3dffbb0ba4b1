// Validation and dispatch of the seeded exponential noise kernel (see sampling.h).
#include "sampling.h"

#include "messages.h"

namespace jetrl {

void exponential_noise_(at::Tensor& q, const at::Tensor& table) {
  TORCH_CHECK(q.defined() && table.defined(), "exponential_noise_: q and table must be defined");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "exponential_noise_: q must be float32; got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 2, "exponential_noise_: q must be 2-D [rows, vocab]; got shape ", dims(q.sizes()));
  TORCH_CHECK(q.stride(1) == 1 || q.size(1) <= 1, "exponential_noise_: q's last dim must be contiguous; got strides ",
              dims(q.strides()));
  TORCH_CHECK(table.scalar_type() == at::kLong, "exponential_noise_: table must be int64; got ", table.scalar_type());
  TORCH_CHECK(table.dim() == 2 && table.size(1) == 3,
              "exponential_noise_: table must be [B, 3] (row, seed, offset); got shape ", dims(table.sizes()));
  TORCH_CHECK(table.is_contiguous(), "exponential_noise_: table must be contiguous; got strides ",
              dims(table.strides()));
  TORCH_CHECK(q.is_cuda(), "exponential_noise_: the kernel runs on CUDA; q is on ", q.device().str(),
              " (ops.sampling computes the reference elsewhere)");
  TORCH_CHECK(table.device() == q.device(), "exponential_noise_: table is on ", table.device().str(),
              "; it must be on q's device ", q.device().str());
#ifndef JETRL_WITH_CUDA
  TORCH_CHECK(false, "exponential_noise_: megatron_jetrl._C was built without CUDA kernels; rebuild on a machine "
              "with nvcc and a CUDA build of torch: pip install --no-build-isolation -e .");
#else
  if (table.size(0) == 0 || q.size(1) == 0) return;
  ExponentialNoiseArgs args;
  args.q = q.data_ptr<float>();
  args.table = table.data_ptr<int64_t>();
  args.B = table.size(0);
  args.V = q.size(1);
  args.q_stride = q.stride(0);
  exponential_noise_cuda(args, q);
#endif
}

}  // namespace jetrl
