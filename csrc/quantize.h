// Fused FP8 block quantization entry points (validated in quantize.cpp, kernels in quantize_cpu.cpp
// and quantize_cuda.cu). Every output equals megatron_jetrl.precision.quantize_fp8_blockwise.
#pragma once

#include <ATen/ATen.h>
#include <vector>

namespace jetrl {

// Where one launch writes. Any output pointer may be null (not requested).
//   q      [M, K]   codes, row-major (1x128 rowwise, or 128x128 block)
//   s_row  [Kb, M]  1x128 rowwise scale_inv, group-major
//   qt     [K, M]   codes of x^T (1x128 along M, or the 128x128 block codes transposed)
//   s_col  [Mb, K]  1x128 columnwise scale_inv, group-major
//   s_blk  [Mb, Kb] 128x128 scale_inv, row-major
struct QuantizeArgs {
  const void* x = nullptr;
  int64_t M = 0, K = 0;
  uint8_t* q = nullptr;
  float* s_row = nullptr;
  uint8_t* qt = nullptr;
  float* s_col = nullptr;
  float* s_blk = nullptr;
  bool pow2 = false;
  float eps = 0.0f;
};

void quantize_cpu(const QuantizeArgs& args, at::ScalarType dtype);
#ifdef JETRL_WITH_CUDA
void quantize_cuda(const QuantizeArgs& args, at::ScalarType dtype, const at::Tensor& x);
#endif

// x [M, K] -> {q [M,K] | undefined, s_row view [M,Kb] | undefined, qt [K,M] | undefined,
//              s_col view [K,Mb] | undefined}; scale views have strides (1, rows).
std::vector<at::Tensor> quantize_1x128(const at::Tensor& x, bool rowwise, bool columnwise, bool pow2_scales,
                                       double eps);

// x [M, K] -> {q [M,K], s_blk [Mb,Kb], qt [K,M] | undefined}
std::vector<at::Tensor> quantize_128x128(const at::Tensor& x, bool with_transpose, bool pow2_scales, double eps);

bool with_cuda();

// The outputs of a fused op that quantizes its [R, K] result in 1x128 groups along K (the exact
// forward's norm + quantization and SiLU·mul + quantization): codes [R, K] row-major, and scales
// [R, K / 128] with strides (1, ld), ld = R rounded up to m_align (at least 1): the layout the
// engine's block-FP8 GEMM reads (ops.quantize.rows_scale_layout). Checks quant_eps and m_align,
// naming `op`.
struct RowsQuantized {
  at::Tensor q, s;
  int64_t ld;
};
RowsQuantized rows_quantized_output(const at::Tensor& x, int64_t R, int64_t K, double quant_eps, int64_t m_align,
                                    const char* op);

}  // namespace jetrl
