// The element types of the extension's CUDA kernels (bf16, fp16, fp32): conversion to and from fp32
// with round-to-nearest-even, and the launch of a kernel template for a tensor's dtype.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jetrl {

template <typename T>
struct Round;

template <>
struct Round<__nv_bfloat16> {
  __device__ static __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Round<__half> {
  __device__ static __forceinline__ float to_float(__half v) { return __half2float(v); }
  __device__ static __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Round<float> {
  __device__ static __forceinline__ float to_float(float v) { return v; }
  __device__ static __forceinline__ float from_float(float v) { return v; }
};

// v rounded to T and back to fp32 (the value a T tensor holds).
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  return Round<T>::to_float(Round<T>::from_float(v));
}

// launch(T{}) with T the CUDA type of dtype (bf16, fp16 or fp32); another dtype is an error naming op.
template <typename Launch>
void by_dtype(at::ScalarType dtype, const char* op, Launch&& launch) {
  switch (dtype) {
    case at::kBFloat16: return launch(__nv_bfloat16{});
    case at::kHalf: return launch(__half{});
    case at::kFloat: return launch(float{});
    default: TORCH_CHECK(false, op, ": unsupported dtype ", dtype);
  }
}

// launch(T{}, stream) on x's device and its current stream, T the CUDA type of dtype: the entry of
// every kernel file's launcher.
template <typename Launch>
void by_dtype_on_stream(const at::Tensor& x, at::ScalarType dtype, const char* op, Launch&& launch) {
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  by_dtype(dtype, op, [&](auto t) { launch(t, stream); });
}

}  // namespace jetrl
