// Batched 2-D byte copies on CUDA: one launch for every segment of a sync bucket.
//
// Each thread block copies kUnitsPerBlock units of one segment; a block finds its segment by a
// binary search over the segments' first block. Units are 16, 4 or 1 bytes, the widest that every
// address, stride and row size of the segment allows (16-byte loads and stores for the large
// codes and scales of aligned pieces). Memory-bound: per unit one division for the 2-D index.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "copy_segments.h"

namespace jetrl {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kUnitsPerBlock = kThreads * kUnroll * 4;  // 64 KiB of 16-byte units per block

// Each thread moves kUnroll units per iteration: all loads are issued before any store, so a
// thread keeps kUnroll independent reads in flight (a plain load-store loop serialises on each
// load's latency and reaches about half the copy bandwidth).
template <typename U>
__device__ __forceinline__ void copy_units(const CopySegment& sg, int64_t start, int64_t end) {
  const uint8_t* __restrict__ src = sg.src;
  uint8_t* __restrict__ dst = sg.dst;
  for (int64_t base = start + threadIdx.x; base < end; base += kThreads * kUnroll) {
    U v[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int64_t u = base + i * kThreads;
      if (u < end) {
        const int64_t r = u / sg.row_units;
        v[i] = *reinterpret_cast<const U*>(src + r * sg.src_stride + (u - r * sg.row_units) * sizeof(U));
      }
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int64_t u = base + i * kThreads;
      if (u < end) {
        const int64_t r = u / sg.row_units;
        *reinterpret_cast<U*>(dst + r * sg.dst_stride + (u - r * sg.row_units) * sizeof(U)) = v[i];
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) copy_segments_kernel(const CopySegment* segs, int nseg) {
  const int64_t b = blockIdx.x;
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segs[mid].first_block <= b) lo = mid; else hi = mid - 1;
  }
  const CopySegment sg = segs[lo];
  const int64_t start = (b - sg.first_block) * kUnitsPerBlock;
  const int64_t total = sg.rows * sg.row_units;
  const int64_t end = start + kUnitsPerBlock < total ? start + kUnitsPerBlock : total;
  if (sg.unit == 16) copy_units<uint4>(sg, start, end);
  else if (sg.unit == 4) copy_units<uint32_t>(sg, start, end);
  else copy_units<uint8_t>(sg, start, end);
}

}  // namespace

void copy_segments_cuda(std::vector<CopySegment>& segs, const at::Device& device) {
  int64_t blocks = 0;
  std::vector<CopySegment> live;
  live.reserve(segs.size());
  for (auto sg : segs) {
    const int64_t units = sg.rows * sg.row_units;
    if (units == 0) continue;
    sg.first_block = blocks;
    blocks += (units + kUnitsPerBlock - 1) / kUnitsPerBlock;
    live.push_back(sg);
  }
  if (live.empty()) return;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "copy_segments: too many bytes for one launch; use smaller buckets");
  const c10::cuda::CUDAGuard guard(device);
  const int64_t bytes = static_cast<int64_t>(live.size() * sizeof(CopySegment));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), live.data(), static_cast<size_t>(bytes));
  // non_blocking from pinned memory: the caching host allocator keeps `host` alive until the copy ran.
  at::Tensor table = host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  copy_segments_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const CopySegment*>(table.data_ptr()), static_cast<int>(live.size()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace jetrl
