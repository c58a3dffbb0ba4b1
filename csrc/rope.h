// Rotary embedding of the exact forward, one launch: megatron's formula with each operation rounded
// as the eager torch ops of megatron_jetrl/ops/exact.py's rope_reference round it (written out in
// rope_cuda.cu), so the kernel and the reference agree bit for bit. Validated in rope.cpp; CUDA only
// (the exact forward runs on CUDA; elsewhere ops.exact.rope computes the reference).
#pragma once

#include <ATen/ATen.h>

namespace jetrl {

// One launch: y [T, H, D] (contiguous) = rope(x [T, H, D], strides st / sh per token / head, last dim
// contiguous; positions [T] int64; inv_freq [D / 2] fp32).
struct RopeArgs {
  const void* x = nullptr;
  const int64_t* positions = nullptr;
  const float* inv_freq = nullptr;
  void* y = nullptr;
  int64_t T = 0, H = 0, half = 0, token_stride = 0, head_stride = 0;
};

#ifdef JETRL_WITH_CUDA
void rope_cuda(const RopeArgs& args, at::ScalarType dtype, const at::Tensor& x);
#endif

// x [T, H, D] bf16/fp16/fp32 on CUDA (D even, last dim contiguous), positions [T] int64, inv_freq [D / 2]
// fp32 -> new contiguous [T, H, D].
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& inv_freq);

}  // namespace jetrl
