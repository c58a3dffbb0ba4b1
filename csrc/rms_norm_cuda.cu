// Batch-invariant RMSNorm on CUDA: one block of 128 threads per row, lane = threadIdx.x.
//
// The order is the contract of megatron_jetrl/ops/rms_norm.py, the same for any number of rows:
// - lane t sums sq(x[t]), sq(x[t + 128]), ... sequentially in fp32 (__fmul_rn / __fadd_rn: the
//   compiler may not fuse them into an FMA, which would skip the product's rounding);
// - the 128 lane sums meet in a halving tree acc[t] += acc[t + s], s = 64, 32 through shared
//   memory, then s = 16 .. 1 inside warp 0 with __shfl_down_sync (lane t receives lane t + s:
//   the same pairing);
// - lane 0 computes inv = 1 / sqrt(sum / H + eps) with correctly rounded division and sqrt (not
//   rsqrtf) and shares it through shared memory;
// - y = dtype(float(dtype(x * inv)) * w), both products rounded to fp32 first.
// With a residual (add_rms_norm) the lanes first form total = dtype(float(x) + float(residual)) (torch's
// add of two tensors of that dtype), store it, and norm it: one launch for the add and the norm.
// rms_norm_quant_kernel fuses the norm with the 1x128 FP8 quantization of its output (the codes and
// scales quantize_cuda.cu makes from the plain kernel's output, shared through quantize_cuda.cuh);
// qk_norm_rope_kernel fuses the q/k norms with the rotary embedding (rope_cuda.cuh's arithmetic);
// qk_norm_rope_head_kernel does it a warp a head for heads of 128 values.
// rms_norm_head_kernel computes rows of 128 values (a head) with that order, a warp a row.
// Nothing depends on blockIdx beyond the row's address, so a row gets the same bits alone or among
// thousands. At decode sizes (a hundred rows, one block each) a row is bound by memory latency, so each
// lane issues all its loads before it sums, and rms_norm_quant's second pass reads the row back from
// shared memory. No host syncs and no allocations besides the output: capturable in a CUDA graph.
#include <c10/cuda/CUDAException.h>

#include <string>

#include "cuda_dtypes.cuh"
#include "quantize_cuda.cuh"
#include "rms_norm.h"
#include "rope_cuda.cuh"

namespace jetrl {
namespace {

constexpr uint32_t kFull = 0xffffffffu;
constexpr int kWarp = 32;
constexpr int kLoads = 32;  // a lane's columns loaded before any is summed (H = 4096: all of its 32)
constexpr int kQuantBatch = 8;  // rms_norm_quant: the groups a warp loads before it encodes them
constexpr int kMaxStashBytes = 48 * 1024;  // rms_norm_quant's row in shared memory (H * sizeof(T))

// The row's inv = 1 / sqrt(sum / H + eps), in the order above, computed by the block's 128 lanes and
// returned to every lane; with kAdd each lane also stores its columns' total, and with a stash each
// lane also keeps its columns' input values (x's, or the rounded sums) there for the block. Two
// barriers. A lane issues the loads of kBatch columns before it sums any: a row is bound by latency,
// not bandwidth, so one round trip to memory instead of one per column. A column past H reads as 0,
// and acc + 0 * 0 is acc (acc >= 0, or NaN / inf): the sum's bits are those of the lane's columns
// summed one after another, as 0 + sq(x[t]) is sq(x[t]).
template <typename T, bool kAdd, int kBatch = kLoads>
__device__ __forceinline__ float row_inv_rms(const T* __restrict__ xr, const T* __restrict__ rr, T* __restrict__ sr,
                                             int64_t H, float eps, float* lanes, float* inv_shared,
                                             T* __restrict__ stash = nullptr) {
  using C = Round<T>;
  const int t = threadIdx.x;
  float acc = 0.0f;
  for (int64_t c0 = t; c0 < H; c0 += kBatch * kNormLanes) {
    T xs[kBatch], rs[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t c = c0 + u * kNormLanes;
      if (c < H) {
        xs[u] = xr[c];
        if constexpr (kAdd) rs[u] = rr[c];
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t c = c0 + u * kNormLanes;
      float v = 0.0f;
      if (c < H) {
        T in = xs[u];
        if constexpr (kAdd) {
          in = C::from_float(__fadd_rn(C::to_float(xs[u]), C::to_float(rs[u])));
          sr[c] = in;
        }
        if (stash != nullptr) stash[c] = in;
        v = C::to_float(in);
      }
      acc = __fadd_rn(acc, __fmul_rn(v, v));
    }
  }

  lanes[t] = acc;
  __syncthreads();
  if (t < 64) lanes[t] = __fadd_rn(acc, lanes[t + 64]);
  __syncthreads();
  if (t < kWarp) {
    float sum = __fadd_rn(lanes[t], lanes[t + 32]);
#pragma unroll
    for (int s = 16; s >= 1; s /= 2) sum = __fadd_rn(sum, __shfl_down_sync(kFull, sum, s));
    if (t == 0) {
      const float mean = __fdiv_rn(sum, static_cast<float>(H));
      *inv_shared = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
    }
  }
  __syncthreads();  // also makes the stash visible to the whole block
  return *inv_shared;
}

constexpr int kMaxHeadDim = 512;  // qk_norm_rope: a head's normed values wait in shared memory

// The normed value of an input value v (x's, or the rounded sum): y = dtype(float(dtype(v * inv)) * w).
template <typename T>
__device__ __forceinline__ T normed_value(float v, float inv, T w) {
  using C = Round<T>;
  const T normed = C::from_float(__fmul_rn(v, inv));
  return C::from_float(__fmul_rn(C::to_float(normed), C::to_float(w)));
}

template <typename T, bool kAdd>
__global__ void __launch_bounds__(kNormLanes)
    rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, const T* __restrict__ residual,
                    T* __restrict__ total, int64_t H, int64_t x_stride, int64_t r_stride, float eps) {
  using C = Round<T>;
  __shared__ float lanes[kNormLanes];
  __shared__ float inv_shared;

  const int t = threadIdx.x;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const T* rr = kAdd ? residual + row * r_stride : nullptr;
  T* sr = kAdd ? total + row * H : nullptr;
  T* yr = y + row * H;

  const float inv = row_inv_rms<T, kAdd>(xr, rr, sr, H, eps, lanes, &inv_shared);
  const T* in = kAdd ? sr : xr;  // this lane's own stores: visible to it without a barrier
#pragma unroll 4
  for (int64_t c = t; c < H; c += kNormLanes) yr[c] = normed_value<T>(C::to_float(in[c]), inv, w[c]);
}

// A row of exactly 128 values held by one warp (lane l: columns l, l + 32, l + 64, l + 96, loaded into
// xs): its inv = 1 / sqrt(sum / 128 + eps) in row_inv_rms's order, returned to every lane (see below).
template <typename T>
__device__ __forceinline__ float head_inv_rms(const T* __restrict__ xr, int l, float eps, T (&xs)[4]) {
  using C = Round<T>;
#pragma unroll
  for (int m = 0; m < 4; ++m) xs[m] = xr[l + m * kWarp];
  float acc[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float v = C::to_float(xs[m]);
    acc[m] = __fadd_rn(0.0f, __fmul_rn(v, v));
  }
  float sum = __fadd_rn(__fadd_rn(acc[0], acc[2]), __fadd_rn(acc[1], acc[3]));
#pragma unroll
  for (int s = 16; s >= 1; s /= 2) sum = __fadd_rn(sum, __shfl_down_sync(kFull, sum, s));
  float inv = 0.0f;
  if (l == 0) {
    const float mean = __fdiv_rn(sum, static_cast<float>(kNormLanes));
    inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
  }
  return __shfl_sync(kFull, inv, 0);
}

// Rows of exactly 128 values (the q/k norms of a head, head dim 128), a warp a row and four rows a block:
// lane l holds columns l, l + 32, l + 64, l + 96, i.e. the values of the block-per-row kernel's lanes l,
// l + 32, l + 64, l + 96 (one column each), and adds them as that kernel's tree pairs those lanes: s = 64
// gives (l) + (l + 64) and (l + 32) + (l + 96), s = 32 adds those two, and s = 16 .. 1 is the same
// __shfl_down_sync. The same bits with a quarter of the blocks and four values a lane (a training
// micro-batch's q/k norms are hundreds of thousands of such rows).
template <typename T>
__global__ void __launch_bounds__(kNormLanes)
    rms_norm_head_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int64_t R,
                         int64_t x_stride, float eps) {
  using C = Round<T>;
  constexpr int kRowsPerBlock = kNormLanes / kWarp;
  const int l = threadIdx.x % kWarp;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= R) return;  // a whole warp: the shuffles below involve its own lanes only
  const T* xr = x + row * x_stride;
  T* yr = y + row * kNormLanes;
  T xs[4];
  const float inv = head_inv_rms<T>(xr, l, eps, xs);
#pragma unroll
  for (int m = 0; m < 4; ++m) yr[l + m * kWarp] = normed_value<T>(C::to_float(xs[m]), inv, w[l + m * kWarp]);
}

// The norm fused with the 1x128 quantization of its output (the exact forward's norm before an FP8
// linear): row_inv_rms keeps the row's input values (x's, or the rounded sums) in shared memory, then
// warp k encodes groups k, k + 4, ... (lane l: columns 4l .. 4l + 3 of the group), each value the
// normed_value the plain kernel stores and each group encoded as the quantization kernel encodes it
// (quantize_cuda.cuh). A warp loads kQuantBatch groups' values and weights before it encodes any.
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kNormLanes) rms_norm_quant_kernel(NormQuantArgs a) {
  extern __shared__ __align__(16) unsigned char stash_bytes[];
  __shared__ float lanes[kNormLanes];
  __shared__ float inv_shared;
  constexpr int kWarps = kNormLanes / kWarp;

  T* stash = reinterpret_cast<T*>(stash_bytes);
  const int t = threadIdx.x, lane = t % kWarp, warp = t / kWarp;
  const int64_t row = blockIdx.x;
  const T* xr = static_cast<const T*>(a.x) + row * a.x_stride;
  const T* rr = kAdd ? static_cast<const T*>(a.residual) + row * a.r_stride : nullptr;
  T* sr = kAdd ? static_cast<T*>(a.total) + row * a.H : nullptr;
  const T* __restrict__ w = static_cast<const T*>(a.w);

  const float inv = row_inv_rms<T, kAdd>(xr, rr, sr, a.H, a.eps, lanes, &inv_shared, stash);
  const int64_t groups = a.H / kNormLanes;
  for (int64_t g0 = warp; g0 < groups; g0 += kQuantBatch * kWarps) {
    T in[kQuantBatch][4], wv[kQuantBatch][4];
#pragma unroll
    for (int b = 0; b < kQuantBatch; ++b) {
      const int64_t c0 = (g0 + b * kWarps) * kNormLanes + 4 * lane;
      if (g0 + b * kWarps < groups) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          in[b][e] = stash[c0 + e];
          wv[b][e] = w[c0 + e];
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kQuantBatch; ++b) {
      const int64_t g = g0 + b * kWarps, c0 = g * kNormLanes + 4 * lane;
      if (g >= groups) break;  // g is the warp's own: its shuffles see every lane
      T v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = normed_value<T>(Round<T>::to_float(in[b][e]), inv, wv[b][e]);
      float scale_inv;
      const uint32_t codes = quant::encode_warp_group<T>(v, a.pow2, a.quant_eps, &scale_inv);
      *reinterpret_cast<uint32_t*>(a.q + row * a.H + c0) = codes;
      if (lane == 0) a.s[g * a.s_stride + row] = scale_inv;
    }
  }
}

// The exact forward's q/k norms and rotary embedding in one launch: one block per (token, head), q's
// heads first, then k's. The head's norm is rms_norm's (row_inv_rms, normed_value: the same arithmetic
// for a head of D values as for any row), its normed values wait in shared memory for their partners
// (j and j + D/2), and the rotation is rope's (rope_cuda.cuh). Equal bit for bit to rms_norm of each
// head followed by rope of the rounded result.
template <typename T>
__global__ void __launch_bounds__(kNormLanes) qk_norm_rope_kernel(QkNormRopeArgs a) {
  using C = Round<T>;
  __shared__ float lanes[kNormLanes];
  __shared__ float inv_shared;
  __shared__ T head[kMaxHeadDim];

  const int t = threadIdx.x;
  const int64_t heads = a.Hq + a.Hk, token = blockIdx.x / heads, h = blockIdx.x % heads;
  const bool is_q = h < a.Hq;
  const int64_t D = a.D, half = D / 2, hh = is_q ? h : h - a.Hq;
  const T* xr = static_cast<const T*>(is_q ? a.q : a.k) + token * (is_q ? a.q_stride : a.k_stride) + hh * D;
  const T* w = static_cast<const T*>(is_q ? a.wq : a.wk);
  T* yr = static_cast<T*>(is_q ? a.yq : a.yk) + (token * (is_q ? a.Hq : a.Hk) + hh) * D;

  // a head's few columns a lane in one batch: kLoads' registers would cost the many small blocks occupancy
  const float inv = row_inv_rms<T, false, kMaxHeadDim / kNormLanes>(xr, nullptr, nullptr, D, is_q ? a.eps_q : a.eps_k,
                                                                    lanes, &inv_shared);
  for (int64_t c = t; c < D; c += kNormLanes) head[c] = normed_value<T>(C::to_float(xr[c]), inv, w[c]);
  __syncthreads();
  const int64_t position = a.positions[token];
  for (int64_t c = t; c < D; c += kNormLanes) {
    const int64_t j = c % half;
    float cs, sn;
    rope_cos_sin<T>(position, a.inv_freq[j], &cs, &sn);
    const float x1 = C::to_float(head[j]), x2 = C::to_float(head[j + half]);
    yr[c] = c < half ? rope_first<T>(x1, x2, cs, sn) : rope_second<T>(x1, x2, cs, sn);
  }
}

// qk_norm_rope_kernel for heads of exactly 128 values (Qwen3's and Llama's head dim), a warp a (token,
// head) and four a block: lane l holds columns l, l + 32, l + 64, l + 96 and sums them as
// rms_norm_head_kernel does (head_inv_rms: the block kernel's tree, so the same inv), and the rotary
// pairs (j, j + 64) are (l, l + 64) and (l + 32, l + 96), both the lane's own: no shared memory and no barrier. Each
// value is the block kernel's (normed_value, rope_cos_sin, rope_first / rope_second on the same inputs).
// At decode a block kernel spends a whole block's tree and barriers on one head.
template <typename T>
__global__ void __launch_bounds__(kNormLanes) qk_norm_rope_head_kernel(QkNormRopeArgs a) {
  using C = Round<T>;
  constexpr int kRowsPerBlock = kNormLanes / kWarp;
  constexpr int kHalf = kNormLanes / 2;
  const int l = threadIdx.x % kWarp;
  const int64_t heads = a.Hq + a.Hk;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= a.T * heads) return;  // a whole warp: the shuffles below involve its own lanes only
  const int64_t token = row / heads, h = row % heads;
  const bool is_q = h < a.Hq;
  const int64_t hh = is_q ? h : h - a.Hq;
  const T* xr = static_cast<const T*>(is_q ? a.q : a.k) + token * (is_q ? a.q_stride : a.k_stride) + hh * kNormLanes;
  const T* w = static_cast<const T*>(is_q ? a.wq : a.wk);
  T* yr = static_cast<T*>(is_q ? a.yq : a.yk) + (token * (is_q ? a.Hq : a.Hk) + hh) * kNormLanes;

  T xs[4];
  const float inv = head_inv_rms<T>(xr, l, is_q ? a.eps_q : a.eps_k, xs);
  float normed[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) normed[m] = C::to_float(normed_value<T>(C::to_float(xs[m]), inv, w[l + m * kWarp]));
  const int64_t position = a.positions[token];
#pragma unroll
  for (int p = 0; p < 2; ++p) {  // j = l + 32p; its partner j + 64 is the lane's value p + 2
    const int j = l + p * kWarp;
    float cs, sn;
    rope_cos_sin<T>(position, a.inv_freq[j], &cs, &sn);
    yr[j] = rope_first<T>(normed[p], normed[p + 2], cs, sn);
    yr[j + kHalf] = rope_second<T>(normed[p], normed[p + 2], cs, sn);
  }
}

template <typename T>
void launch_typed(const RmsNormArgs& a, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(a.R);
  const auto* x = static_cast<const T*>(a.x);
  const auto* w = static_cast<const T*>(a.w);
  auto* y = static_cast<T*>(a.y);
  if (a.residual != nullptr) {
    rms_norm_kernel<T, true><<<blocks, kNormLanes, 0, stream>>>(x, w, y, static_cast<const T*>(a.residual),
                                                                static_cast<T*>(a.total), a.H, a.x_stride,
                                                                a.r_stride, a.eps);
  } else if (a.H == kNormLanes) {
    constexpr int64_t kRowsPerBlock = kNormLanes / kWarp;
    const auto head_blocks = static_cast<unsigned>((a.R + kRowsPerBlock - 1) / kRowsPerBlock);
    rms_norm_head_kernel<T><<<head_blocks, kNormLanes, 0, stream>>>(x, w, y, a.R, a.x_stride, a.eps);
  } else {
    rms_norm_kernel<T, false><<<blocks, kNormLanes, 0, stream>>>(x, w, y, nullptr, nullptr, a.H, a.x_stride, 0, a.eps);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void rms_norm_cuda(const RmsNormArgs& args, at::ScalarType dtype, const at::Tensor& x) {
  by_dtype_on_stream(x, dtype, "rms_norm",
                     [&](auto t, cudaStream_t stream) { launch_typed<decltype(t)>(args, stream); });
}

void qk_norm_rope_cuda(const QkNormRopeArgs& args, at::ScalarType dtype, const at::Tensor& q) {
  TORCH_CHECK(args.D <= kMaxHeadDim, "qk_norm_rope: head dim ", std::to_string(args.D), " over the kernel's ",
              std::to_string(kMaxHeadDim));
  by_dtype_on_stream(q, dtype, "qk_norm_rope", [&](auto t, cudaStream_t stream) {
    const int64_t heads = args.T * (args.Hq + args.Hk);
    if (args.D == kNormLanes) {  // a warp a head
      constexpr int64_t kRowsPerBlock = kNormLanes / kWarp;
      const auto blocks = static_cast<unsigned>((heads + kRowsPerBlock - 1) / kRowsPerBlock);
      qk_norm_rope_head_kernel<decltype(t)><<<blocks, kNormLanes, 0, stream>>>(args);
    } else {
      qk_norm_rope_kernel<decltype(t)><<<static_cast<unsigned>(heads), kNormLanes, 0, stream>>>(args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void rms_norm_quant_cuda(const NormQuantArgs& args, at::ScalarType dtype, const at::Tensor& x) {
  by_dtype_on_stream(x, dtype, "rms_norm_quant", [&](auto t, cudaStream_t stream) {
    using T = decltype(t);
    const auto blocks = static_cast<unsigned>(args.R);
    const int64_t stash = args.H * static_cast<int64_t>(sizeof(T));
    TORCH_CHECK(stash <= kMaxStashBytes, "rms_norm_quant: a row of ", std::to_string(args.H), " values of ",
                std::to_string(sizeof(T)), " bytes is over the kernel's shared-memory row of ",
                std::to_string(kMaxStashBytes), " bytes");
    const auto bytes = static_cast<size_t>(stash);
    if (args.residual != nullptr) {
      rms_norm_quant_kernel<T, true><<<blocks, kNormLanes, bytes, stream>>>(args);
    } else {
      rms_norm_quant_kernel<T, false><<<blocks, kNormLanes, bytes, stream>>>(args);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace jetrl
