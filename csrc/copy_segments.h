// Batched 2-D byte copies: the weight sync's reshard (QKV de-interleave, gate/up split, TP column
// joins) and bucket packing in one launch. Validated in copy_segments.cpp; the pure-torch
// reference is megatron_jetrl/ops/copy.py:copy_segments_reference.
#pragma once

#include <ATen/ATen.h>
#include <vector>

namespace jetrl {

// One row of the segment table (int64 [S, 8], on the CPU), all in bytes:
//   src id, src offset, src row stride, dst id, dst offset, dst row stride, row bytes, rows
// copies rows x row_bytes from srcs[src id] to dsts[dst id].
constexpr int kSegCols = 8;

struct CopySegment {
  const uint8_t* src;
  uint8_t* dst;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t row_units;  // row bytes / unit
  int64_t rows;
  int64_t first_block;
  int64_t unit;  // 16, 4 or 1 bytes: the widest that divides every address, stride and row size
};

void copy_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts, const at::Tensor& table);

#ifdef JETRL_WITH_CUDA
void copy_segments_cuda(std::vector<CopySegment>& segs, const at::Device& device);
#endif

}  // namespace jetrl
