// Validation and dispatch of the batched 2-D byte copy (see copy_segments.h).
#include "copy_segments.h"

#include <c10/util/Exception.h>

#include <cstring>
#include <string>

namespace jetrl {
namespace {

// Numbers go through std::to_string, never streamed into TORCH_CHECK (see quantize.cpp).
std::string seg_name(int64_t s) { return "copy_segments: segment " + std::to_string(s); }

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

void check_tensors(const std::vector<at::Tensor>& ts, const char* what, const at::Device& device) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    const std::string name = std::string("copy_segments: ") + what + "[" + std::to_string(i) + "]";
    TORCH_CHECK(t.defined(), name, " is undefined");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(t.device() == device, name, " is on ", t.device().str(), "; every tensor must be on ",
                device.str());
  }
}

// Last byte touched by rows x row_bytes at offset with stride, or -1 for an empty copy.
int64_t extent(int64_t offset, int64_t stride, int64_t row_bytes, int64_t rows) {
  if (rows == 0 || row_bytes == 0) return -1;
  return offset + (rows - 1) * stride + row_bytes;
}

int64_t widest_unit(uintptr_t src, uintptr_t dst, int64_t src_stride, int64_t dst_stride, int64_t row_bytes) {
  for (int64_t unit : {16, 4}) {
    if (src % unit == 0 && dst % unit == 0 && src_stride % unit == 0 && dst_stride % unit == 0 &&
        row_bytes % unit == 0)
      return unit;
  }
  return 1;
}

}  // namespace

void copy_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts, const at::Tensor& table) {
  TORCH_CHECK(table.defined() && table.is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 &&
                  table.size(1) == kSegCols && table.is_contiguous(),
              "copy_segments: table must be a contiguous CPU int64 tensor [S, 8]");
  if (table.size(0) == 0) return;
  TORCH_CHECK(!srcs.empty() && !dsts.empty(), "copy_segments: a non-empty table needs sources and destinations");
  const at::Device device = dsts[0].device();
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "copy_segments: tensors must be on CPU or CUDA");
#ifndef JETRL_WITH_CUDA
  TORCH_CHECK(!device.is_cuda(), "copy_segments: CUDA tensors but megatron_jetrl._C was built without CUDA kernels");
#endif
  check_tensors(srcs, "srcs", device);
  check_tensors(dsts, "dsts", device);
  const int64_t* t = table.data_ptr<int64_t>();
  std::vector<CopySegment> segs;
  segs.reserve(table.size(0));
  for (int64_t s = 0; s < table.size(0); ++s) {
    const int64_t* r = t + s * kSegCols;
    const int64_t src = r[0], src_off = r[1], src_stride = r[2], dst = r[3], dst_off = r[4], dst_stride = r[5],
                  row_bytes = r[6], rows = r[7];
    TORCH_CHECK(src >= 0 && src < static_cast<int64_t>(srcs.size()), seg_name(s), ": src id ", std::to_string(src),
                " out of range (", std::to_string(srcs.size()), " sources)");
    TORCH_CHECK(dst >= 0 && dst < static_cast<int64_t>(dsts.size()), seg_name(s), ": dst id ", std::to_string(dst),
                " out of range (", std::to_string(dsts.size()), " destinations)");
    TORCH_CHECK(src_off >= 0 && dst_off >= 0 && row_bytes >= 0 && rows >= 0, seg_name(s),
                ": offsets, row bytes and rows must be >= 0");
    TORCH_CHECK(rows <= 1 || (src_stride >= row_bytes && dst_stride >= row_bytes), seg_name(s),
                ": row strides must be >= row bytes (rows would overlap)");
    const int64_t src_end = extent(src_off, src_stride, row_bytes, rows);
    const int64_t dst_end = extent(dst_off, dst_stride, row_bytes, rows);
    if (src_end < 0) continue;
    TORCH_CHECK(src_end <= nbytes(srcs[src]), seg_name(s), " reads up to byte ", std::to_string(src_end),
                " of a source of ", std::to_string(nbytes(srcs[src])), " bytes");
    TORCH_CHECK(dst_end <= nbytes(dsts[dst]), seg_name(s), " writes up to byte ", std::to_string(dst_end),
                " of a destination of ", std::to_string(nbytes(dsts[dst])), " bytes");
    const auto* sp = static_cast<const uint8_t*>(srcs[src].data_ptr()) + src_off;
    auto* dp = static_cast<uint8_t*>(dsts[dst].data_ptr()) + dst_off;
    const int64_t unit = widest_unit(reinterpret_cast<uintptr_t>(sp), reinterpret_cast<uintptr_t>(dp), src_stride,
                                     dst_stride, row_bytes);
    segs.push_back({sp, dp, src_stride, dst_stride, row_bytes / unit, rows, /*first_block=*/0, unit});
  }
  if (segs.empty()) return;
#ifdef JETRL_WITH_CUDA
  if (device.is_cuda()) {
    copy_segments_cuda(segs, device);
    return;
  }
#endif
  for (const auto& sg : segs) {
    const int64_t row_bytes = sg.row_units * sg.unit;
    if (sg.src_stride == row_bytes && sg.dst_stride == row_bytes) {
      std::memcpy(sg.dst, sg.src, static_cast<size_t>(row_bytes * sg.rows));
      continue;
    }
    for (int64_t r = 0; r < sg.rows; ++r)
      std::memcpy(sg.dst + r * sg.dst_stride, sg.src + r * sg.src_stride, static_cast<size_t>(row_bytes));
  }
}

}  // namespace jetrl
