// The element types the extension's ops take (bf16, fp16, fp32): the check of a tensor's dtype and
// the CPU kernels' dispatch on it (the CUDA kernels' dispatch is cuda_dtypes.cuh's by_dtype).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace jetrl {

inline bool float_dtype(at::ScalarType dt) { return dt == at::kBFloat16 || dt == at::kHalf || dt == at::kFloat; }

// launch(T{}) with T the CPU type of dtype (bf16, fp16 or fp32); another dtype is an error naming op.
template <typename Launch>
void by_cpu_dtype(at::ScalarType dtype, const char* op, Launch&& launch) {
  switch (dtype) {
    case at::kBFloat16: return launch(c10::BFloat16{});
    case at::kHalf: return launch(c10::Half{});
    case at::kFloat: return launch(float{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

}  // namespace jetrl
