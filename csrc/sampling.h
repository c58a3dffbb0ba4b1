// Seeded exponential noise for the rollout engine's sampler, all seeded rows in one launch.
//
// vLLM samples a token as argmax(probs / q), q ~ Exp(1) per vocabulary entry. A request with its own
// seed has its own torch.Generator, and vLLM fills its row of q with one exponential_ call per row,
// a Python loop of one launch per request every decode step. This kernel fills every seeded row at
// once: row `row` gets, at column j, q = -log(u) with u = (2 * (x >> 9) + 1) * 2^-24 in (0, 1) and x
// word j % 4 of Philox4x32-10 with key (seed low, seed high) and counter (j / 4, 0, offset low,
// offset high). The noise of a row depends on its seed, its offset and the column only: never on
// the other rows of the batch. megatron_jetrl/ops/sampling.py holds the pure-torch reference
// (exponential_noise_reference) the kernel agrees with bit for bit.
#pragma once

#include <ATen/ATen.h>

namespace jetrl {

// One launch of exponential_noise_: q [R, V] fp32 with row stride q_stride (last dim contiguous);
// table [B, 3] int64 (row, seed, offset) on q's device, rows distinct and in [0, R).
struct ExponentialNoiseArgs {
  float* q = nullptr;
  const int64_t* table = nullptr;
  int64_t B = 0, V = 0, q_stride = 0;
};

#ifdef JETRL_WITH_CUDA
void exponential_noise_cuda(const ExponentialNoiseArgs& args, const at::Tensor& q);
#endif

// q [R, V] float32 on CUDA, last dim contiguous; table [B, 3] int64 contiguous on q's device, each
// entry (row, seed, offset) with seed and offset read as unsigned 64-bit: fills q[row] in place.
// No host sync (the rows are not range-checked on the device: the caller's table must hold rows < R).
void exponential_noise_(at::Tensor& q, const at::Tensor& table);

}  // namespace jetrl
