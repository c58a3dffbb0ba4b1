// Fused one-pass FP8 block quantization on CUDA.
//
// One thread block owns one 128x128 tile of x and reads it from global memory exactly once
// (16-byte loads). From those registers it produces, as requested:
//   rowwise    1x128 groups along K: codes q [M,K] + scale_inv s_row (group-major [Kb][M])
//   columnwise 1x128 groups along M: codes of x^T qt [K,M] + s_col (group-major [Mb][K])
//   block      128x128: codes q [M,K], optionally the same codes transposed qt [K,M], + s_blk
// The scale rule is quantize_math.h (shared with the CPU kernels); the torch reference is
// megatron_jetrl/precision/blockwise.py, and tests compare all three bit for bit.
//
// Why it looks like this (the kernel is memory-bound only if the per-element work is tiny):
// - amax runs on the raw bits: |x| is a mask, and for IEEE formats max(|x|) as unsigned integers
//   is max(|x|) as floats, with Inf/NaN above every finite value. bf16/fp16 pairs go through one
//   16x2 integer max (__vmaxu2). Exact, and it also detects Inf/NaN for free.
// - values stay packed in registers until they are encoded (fewer registers, more blocks per SM);
//   the cast is cvt.rn.satfinite, whose saturation equals the rule's clamp to +-448.
// - a row's scale is computed once, by one lane, after a reduce-scatter across the lanes of the
//   row, then shuffled back: one IEEE division per lane instead of one per row per lane.
// - transposed codes pass through a chunk-swizzled shared tile so smem stores are conflict-free and
//   global stores of qt are 16-byte and coalesced.
//
// Thread layout: 256 threads; a thread owns ROWS consecutive rows x VEC consecutive columns
// (bf16/fp16: 8x8, fp32: 16x4); TPR = 128/VEC threads span a tile row.
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "cuda_dtypes.cuh"
#include "quantize.h"
#include "quantize_cuda.cuh"

namespace jetrl {
namespace {

using namespace quant;  // the shared encoding: Fmt, scale_of_bits, inv_scale, cvt2, nan_fill, kFull

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Reduce-scatter max over lanes: N values per lane; after log2(N) halving exchanges lane l holds in
// v[0] the max over its lane group of value index (l % N).
template <int N>
__device__ __forceinline__ void reduce_scatter_max(uint32_t* v, int lane) {
  if constexpr (N >= 2) {
    constexpr int kHalf = N / 2;
    const bool upper = lane & kHalf;
#pragma unroll
    for (int k = 0; k < kHalf; ++k) {
      const uint32_t send = upper ? v[k] : v[k + kHalf];
      const uint32_t keep = upper ? v[k + kHalf] : v[k];
      v[k] = max(keep, __shfl_xor_sync(kFull, send, kHalf));
    }
    reduce_scatter_max<kHalf>(v, lane);
  }
}

template <typename T>
struct Tile {
  using F = Fmt<T>;
  static constexpr int VEC = 16 / sizeof(T);            // elements per 16-byte load
  static constexpr int TPR = kBlock / VEC;              // threads across a tile row
  static constexpr int ROWS = kBlock * TPR / kThreads;  // consecutive rows per thread
  static constexpr int NCHUNK = kBlock / ROWS;          // ROWS-byte chunks per transposed row
  static constexpr int WORDS = kBlock / F::kPerWord;    // 32-bit words per tile row
  static_assert(ROWS % 4 == 0 && VEC % 4 == 0, "codes are packed in 4-byte words");
  // Chunk position of row-chunk `chunk` in transposed row c: spreads a warp's smem accesses over all
  // banks on both the store (fixed c%VEC, varying c/VEC) and the load (4 consecutive c) side.
  __device__ static __forceinline__ int slot(int chunk, int c) { return chunk ^ (((c / VEC) ^ (c & 1)) % NCHUNK); }

  // VEC codes of one row (4 raw words) packed into VEC/4 words.
  __device__ static __forceinline__ void encode_row(const uint32_t (&w)[4], float scale, bool bad,
                                                    uint32_t (&out)[VEC / 4]) {
#pragma unroll
    for (int o = 0; o < VEC / 4; ++o) {
      float e[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = 4 * o + i;
        e[i] = F::elem(w[j / F::kPerWord], j % F::kPerWord);
      }
      out[o] = nan_fill(cvt2(e[0], e[1], scale) | (cvt2(e[2], e[3], scale) << 16), bad);
    }
  }
};

template <typename T, bool kRow, bool kCol, bool kBlk>
__global__ void __launch_bounds__(kThreads) quantize_tile_kernel(QuantizeArgs a, int64_t tiles_k, bool vec_load,
                                                                 bool vec_store_q, bool vec_store_qt) {
  using S = Tile<T>;
  using F = Fmt<T>;
  constexpr int VEC = S::VEC, TPR = S::TPR, ROWS = S::ROWS;
  static_assert(VEC / F::kPerWord == 4, "a thread-row is one 16-byte load: 4 words");

  __shared__ uint32_t red[kWarps][S::WORDS];
  __shared__ float col_scale[kBlock];
  __shared__ __align__(16) uint32_t tq[kBlock][kBlock / 4];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cv = tid % TPR, rg = tid / TPR;
  const int64_t mt = blockIdx.x / tiles_k, kt = blockIdx.x % tiles_k;
  const int64_t m0 = mt * kBlock + rg * ROWS, k0 = kt * kBlock, gk = k0 + cv * VEC;
  const T* x = static_cast<const T*>(a.x);

  uint32_t r[ROWS][4];
  {
    const bool full_cols = vec_load && gk + VEC <= a.K;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int64_t gm = m0 + i;
      if (gm < a.M && full_cols) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + gm * a.K + gk));
        r[i][0] = raw.x, r[i][1] = raw.y, r[i][2] = raw.z, r[i][3] = raw.w;
      } else {
        using Raw = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
        const Raw* xr = reinterpret_cast<const Raw*>(x) + gm * a.K + gk;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          uint32_t word = 0;
#pragma unroll
          for (int h = 0; h < F::kPerWord; ++h) {
            const int j = w * F::kPerWord + h;
            if (gm < a.M && gk + j < a.K) word |= static_cast<uint32_t>(xr[j]) << (16 * h);
          }
          r[i][w] = word;
        }
      }
    }
  }

  // Codes of row i (VEC bytes) -> q. Vector store when the row slice is whole and aligned.
  auto store_row = [&](int i, float scale, bool bad) {
    const int64_t gm = m0 + i;
    uint32_t out[VEC / 4];
    S::encode_row(r[i], scale, bad, out);
    if (gm >= a.M) return;
    uint8_t* dst = a.q + gm * a.K + gk;
    if (vec_store_q && gk + VEC <= a.K) {
      if constexpr (VEC == 8) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(out[0], out[1]);
      } else {
        *reinterpret_cast<uint32_t*>(dst) = out[0];
      }
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (gk + j < a.K) dst[j] = static_cast<uint8_t>(out[j / 4] >> (8 * (j % 4)));
    }
  };

  if constexpr (kRow) {
    // Per-row amax bits over this thread's VEC columns.
    uint32_t am[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      uint32_t m = r[i][0] & F::kAbsMask;
#pragma unroll
      for (int w = 1; w < 4; ++w) m = F::vmax(m, r[i][w] & F::kAbsMask);
      am[i] = F::fold(m);
    }
    reduce_scatter_max<ROWS>(am, lane);
#pragma unroll
    for (int off = ROWS; off < TPR; off *= 2) am[0] = max(am[0], __shfl_xor_sync(kFull, am[0], off));
    const float my_scale = scale_of_bits<T>(am[0], a.pow2, a.eps);
    const int my_row = lane % ROWS;
    if (cv < ROWS && m0 + my_row < a.M) a.s_row[kt * a.M + m0 + my_row] = inv_scale(my_scale);
    const int base = lane & ~(TPR - 1);
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const float s = __shfl_sync(kFull, my_scale, base + i);
      store_row(i, s, s != s);
    }
  }

  float blk_scale = 0.0f;
  if constexpr (kCol) {
    // Column amax words (packed pairs for 16-bit formats) over this thread's ROWS rows.
    uint32_t cm[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      cm[w] = r[0][w] & F::kAbsMask;
#pragma unroll
      for (int i = 1; i < ROWS; ++i) cm[w] = F::vmax(cm[w], r[i][w] & F::kAbsMask);
#pragma unroll
      for (int off = TPR; off < 32; off *= 2) cm[w] = F::vmax(cm[w], __shfl_xor_sync(kFull, cm[w], off));
    }
    if (lane < TPR) {
#pragma unroll
      for (int w = 0; w < 4; ++w) red[warp][cv * 4 + w] = cm[w];
    }
    __syncthreads();
    if (tid < S::WORDS) {
      uint32_t m = red[0][tid];
#pragma unroll
      for (int wp = 1; wp < kWarps; ++wp) m = F::vmax(m, red[wp][tid]);
#pragma unroll
      for (int h = 0; h < F::kPerWord; ++h) {
        const int c = tid * F::kPerWord + h;
        const uint32_t bits = F::kPerWord == 2 ? (h ? m >> 16 : m & 0xFFFFu) : m;
        const float s = scale_of_bits<T>(bits, a.pow2, a.eps);
        col_scale[c] = s;
        if (k0 + c < a.K) a.s_col[mt * a.K + k0 + c] = inv_scale(s);
      }
    }
    __syncthreads();
  }
  if constexpr (kBlk) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
#pragma unroll
      for (int w = 0; w < 4; ++w) m = F::vmax(m, r[i][w] & F::kAbsMask);
    m = F::fold(m);
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) m = max(m, __shfl_xor_sync(kFull, m, off));
    if (lane == 0) red[0][warp] = m;
    __syncthreads();
    m = red[0][0];
#pragma unroll
    for (int wp = 1; wp < kWarps; ++wp) m = max(m, red[0][wp]);
    blk_scale = scale_of_bits<T>(m, a.pow2, a.eps);
    if (tid == 0) a.s_blk[blockIdx.x] = inv_scale(blk_scale);
#pragma unroll
    for (int i = 0; i < ROWS; ++i) store_row(i, blk_scale, blk_scale != blk_scale);
  }

  if (!(kCol || (kBlk && a.qt != nullptr))) return;

  // Column c's ROWS codes -> chunk `rg` of transposed row c in smem.
  uint8_t* tq_bytes = reinterpret_cast<uint8_t*>(tq);
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int c = cv * VEC + j;
    const float s = kCol ? col_scale[c] : blk_scale;
    const bool bad = s != s;
    uint32_t words[ROWS / 4];
#pragma unroll
    for (int o = 0; o < ROWS / 4; ++o) {
      float e[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) e[i] = F::elem(r[4 * o + i][j / F::kPerWord], j % F::kPerWord);
      words[o] = nan_fill(cvt2(e[0], e[1], s) | (cvt2(e[2], e[3], s) << 16), bad);
    }
    uint8_t* dst = tq_bytes + c * kBlock + S::slot(rg, c) * ROWS;
    if constexpr (ROWS == 8) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
  __syncthreads();

  // Transposed rows out in 16-byte pieces, 8 per row of 128 codes.
  const int64_t tile_m0 = mt * kBlock;
  for (int idx = tid; idx < kBlock * 8; idx += kThreads) {
    const int c = idx >> 3, p = idx & 7;
    const int64_t gkc = k0 + c, gm = tile_m0 + p * 16;
    if (gkc >= a.K || gm >= a.M) continue;
    const uint8_t* row = tq_bytes + c * kBlock;
    uint8_t* dst = a.qt + gkc * a.M + gm;
    if (vec_store_qt && gm + 16 <= a.M) {
      uint4 piece;
      if constexpr (ROWS == 8) {
        const uint2 lo = *reinterpret_cast<const uint2*>(row + S::slot(2 * p, c) * 8);
        const uint2 hi = *reinterpret_cast<const uint2*>(row + S::slot(2 * p + 1, c) * 8);
        piece = make_uint4(lo.x, lo.y, hi.x, hi.y);
      } else {
        piece = *reinterpret_cast<const uint4*>(row + S::slot(p, c) * 16);
      }
      *reinterpret_cast<uint4*>(dst) = piece;
    } else {
      for (int b = 0; b < 16 && gm + b < a.M; ++b) {
        const int m = p * 16 + b;
        dst[b] = row[S::slot(m / ROWS, c) * ROWS + m % ROWS];
      }
    }
  }
}

template <typename T>
void launch_typed(const QuantizeArgs& a, cudaStream_t stream) {
  const int64_t tiles_k = (a.K + kBlock - 1) / kBlock;
  const int64_t tiles = ((a.M + kBlock - 1) / kBlock) * tiles_k;
  constexpr int VEC = Tile<T>::VEC;
  const bool vec_load = a.K % VEC == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
  const bool vec_store_q = a.K % VEC == 0;
  const bool vec_store_qt = a.M % 16 == 0;
  const dim3 grid(static_cast<unsigned>(tiles)), block(kThreads);
#define JETRL_LAUNCH(ROW, COL, BLK) \
  quantize_tile_kernel<T, ROW, COL, BLK><<<grid, block, 0, stream>>>(a, tiles_k, vec_load, vec_store_q, vec_store_qt)
  if (a.s_blk) {
    JETRL_LAUNCH(false, false, true);
  } else if (a.q && a.qt) {
    JETRL_LAUNCH(true, true, false);
  } else if (a.q) {
    JETRL_LAUNCH(true, false, false);
  } else {
    JETRL_LAUNCH(false, true, false);
  }
#undef JETRL_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void quantize_cuda(const QuantizeArgs& args, at::ScalarType dtype, const at::Tensor& x) {
  by_dtype_on_stream(x, dtype, "quantize",
                     [&](auto t, cudaStream_t stream) { launch_typed<decltype(t)>(args, stream); });
}

}  // namespace jetrl
