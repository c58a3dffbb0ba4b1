// Validation, dispatch and the CPU kernel of the batch-invariant RMSNorm (see rms_norm.h).
//
// The CPU kernel follows the documented order literally, one row at a time (rows in parallel).
// Its float arithmetic must be plain IEEE single precision, one rounding per operation:
// - no excess precision: FLT_EVAL_METHOD must be 0 (SSE on x86-64, any aarch64), checked below;
// - no fused multiply-add: every product is its own statement, so clang's default contraction
//   (within one expression) has nothing to fuse, and the build (-std=c++17, ISO mode) leaves
//   GCC's -ffp-contract at off; setup.py enables neither -ffast-math nor -ffp-contract=fast;
// - std::sqrt(float) and float division are correctly rounded (IEEE 754).
#include "dtypes.h"
#include "messages.h"
#include "quantize.h"
#include "rms_norm.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cfloat>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "rms_norm.cpp needs float arithmetic without excess precision (FLT_EVAL_METHOD == 0)"
#endif

namespace jetrl {
namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.defined(), "rms_norm: x is undefined");
  TORCH_CHECK(x.dim() == 2, "rms_norm: x must be 2-D [R, H]; got ", std::to_string(x.dim()), "-D shape ",
              dims(x.sizes()));
  const int64_t H = x.size(1);
  TORCH_CHECK(H > 0 && H % kNormLanes == 0, "rms_norm: H (x's last dim) must be a positive multiple of ",
              std::to_string(kNormLanes), " (one lane per column modulo 128); got H = ", std::to_string(H));
  TORCH_CHECK(float_dtype(x.scalar_type()), "rms_norm: x must be bfloat16, float16 or float32; got ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, "rms_norm: x's last dim must be contiguous (stride 1); got strides ",
              dims(x.strides()), ". Call .contiguous() first");
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), "rms_norm: x must be on CPU or CUDA; got ", x.device().str());
#ifndef JETRL_WITH_CUDA
  TORCH_CHECK(!x.is_cuda(),
              "rms_norm: x is on CUDA but megatron_jetrl._C was built without CUDA kernels; rebuild on a "
              "machine with nvcc and a CUDA build of torch: pip install --no-build-isolation -e .");
#endif
  TORCH_CHECK(x.size(0) < std::numeric_limits<int32_t>::max(), "rms_norm: x has too many rows for one launch: ",
              dims(x.sizes()));
  TORCH_CHECK(weight.defined(), "rms_norm: weight is undefined");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight must be 1-D [H] = [", std::to_string(H),
              "]; got shape ", dims(weight.sizes()));
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight must have x's dtype ", x.scalar_type(),
              "; got ", weight.scalar_type());
  TORCH_CHECK(weight.is_contiguous(), "rms_norm: weight must be contiguous; got strides ", dims(weight.strides()));
  TORCH_CHECK(weight.device() == x.device(), "rms_norm: weight is on ", weight.device().str(),
              "; it must be on x's device ", x.device().str());
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "rms_norm: eps must be a finite number >= 0; got ",
              std::to_string(eps));
}

// One row, in the documented order: lane sums, halving tree, mean, 1/sqrt, two roundings.
template <typename T>
void norm_row(const T* x, const T* w, T* y, int64_t H, float eps) {
  float acc[kNormLanes];
  for (int t = 0; t < kNormLanes; ++t) {
    const float v = static_cast<float>(x[t]);
    acc[t] = v * v;
  }
  for (int64_t c = kNormLanes; c < H; c += kNormLanes) {
    for (int t = 0; t < kNormLanes; ++t) {
      const float v = static_cast<float>(x[c + t]);
      const float sq = v * v;
      acc[t] = acc[t] + sq;
    }
  }
  for (int s = kNormLanes / 2; s >= 1; s /= 2) {
    for (int t = 0; t < s; ++t) acc[t] = acc[t] + acc[t + s];
  }
  const float mean = acc[0] / static_cast<float>(H);
  const float root = std::sqrt(mean + eps);
  const float inv = 1.0f / root;
  for (int64_t c = 0; c < H; ++c) {
    const float scaled = static_cast<float>(x[c]) * inv;
    const T normed = static_cast<T>(scaled);
    const float out = static_cast<float>(normed) * static_cast<float>(w[c]);
    y[c] = static_cast<T>(out);
  }
}

template <typename T>
void run_cpu(const RmsNormArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.w);
  T* y = static_cast<T*>(a.y);
  at::parallel_for(0, a.R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(x + r * a.x_stride, w, y + r * a.H, a.H, a.eps);
  });
}

void rms_norm_cpu(const RmsNormArgs& args, at::ScalarType dtype) {
  by_cpu_dtype(dtype, "rms_norm", [&](auto t) { run_cpu<decltype(t)>(args); });
}

// The launch arguments of y = rms_norm(x) (add_rms_norm adds its residual's).
RmsNormArgs norm_args(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y, double eps) {
  RmsNormArgs args;
  args.x = x.data_ptr();
  args.w = weight.data_ptr();
  args.y = y.data_ptr();
  args.R = x.size(0);
  args.H = x.size(1);
  args.x_stride = x.stride(0);
  args.eps = static_cast<float>(eps);
  return args;
}

void check_residual(const at::Tensor& x, const at::Tensor& residual, const char* op) {
  TORCH_CHECK(residual.defined() && residual.sizes() == x.sizes(), op, ": residual must have x's shape ",
              dims(x.sizes()), "; got ", residual.defined() ? dims(residual.sizes()) : std::string("undefined"));
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), op, ": residual must have x's dtype ", x.scalar_type(),
              "; got ", residual.scalar_type());
  TORCH_CHECK(residual.stride(1) == 1, op, ": residual's last dim must be contiguous (stride 1); got strides ",
              dims(residual.strides()));
  TORCH_CHECK(residual.device() == x.device(), op, ": residual is on ", residual.device().str(),
              "; it must be on x's device ", x.device().str());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_inputs(x, weight, eps);
  TORCH_CHECK(x.is_cuda(), "add_rms_norm: the fused kernel runs on CUDA; x is on ", x.device().str(),
              " (ops.rms_norm.add_rms_norm adds, then norms, elsewhere)");
  check_residual(x, residual, "add_rms_norm");
  const int64_t R = x.size(0), H = x.size(1);
  const auto options = x.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor y = at::empty({R, H}, options), total = at::empty({R, H}, options);
  if (R == 0) return {y, total};
#ifdef JETRL_WITH_CUDA
  RmsNormArgs args = norm_args(x, weight, y, eps);
  args.residual = residual.data_ptr();
  args.total = total.data_ptr();
  args.r_stride = residual.stride(0);
  rms_norm_cuda(args, x.scalar_type(), x);
#endif
  return {y, total};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_quant(const at::Tensor& x,
                                                              const std::optional<at::Tensor>& residual,
                                                              const at::Tensor& weight, double eps, bool pow2_scales,
                                                              double quant_eps, int64_t m_align) {
  check_inputs(x, weight, eps);
  TORCH_CHECK(x.is_cuda(), "rms_norm_quant: the fused kernel runs on CUDA; x is on ", x.device().str(),
              " (ops.exact.rms_norm_quant norms, then quantizes, elsewhere)");
  const bool add = residual.has_value() && residual->defined();
  if (add) check_residual(x, *residual, "rms_norm_quant");
  const int64_t R = x.size(0), H = x.size(1);
  auto [q, s, ld] = rows_quantized_output(x, R, H, quant_eps, m_align, "rms_norm_quant");
  at::Tensor total = add ? at::empty({R, H}, x.options().memory_format(at::MemoryFormat::Contiguous)) : at::Tensor();
  if (R == 0) return {q, s, total};
#ifdef JETRL_WITH_CUDA
  NormQuantArgs args;
  args.x = x.data_ptr();
  args.w = weight.data_ptr();
  if (add) {
    args.residual = residual->data_ptr();
    args.total = total.data_ptr();
    args.r_stride = residual->stride(0);
  }
  args.q = static_cast<uint8_t*>(q.data_ptr());
  args.s = s.data_ptr<float>();
  args.R = R;
  args.H = H;
  args.x_stride = x.stride(0);
  args.s_stride = ld;
  args.eps = static_cast<float>(eps);
  args.pow2 = pow2_scales;
  args.quant_eps = static_cast<float>(quant_eps);
  rms_norm_quant_cuda(args, x.scalar_type(), x);
#endif
  return {q, s, total};
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& wq,
                                                const at::Tensor& wk, double eps_q, double eps_k,
                                                const at::Tensor& positions, const at::Tensor& inv_freq) {
  TORCH_CHECK(inv_freq.defined() && inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat &&
              inv_freq.is_contiguous(), "qk_norm_rope: inv_freq must be a contiguous 1-D float32 tensor [D / 2]");
  const int64_t D = 2 * inv_freq.size(0);
  TORCH_CHECK(D > 0 && D % kNormLanes == 0 && D <= 512, "qk_norm_rope: the head dim D = 2 * len(inv_freq) must be a "
              "multiple of ", std::to_string(kNormLanes), " up to 512; got ", std::to_string(D));
  for (const auto& [x, w, eps, name] : {std::make_tuple(q, wq, eps_q, "q"), std::make_tuple(k, wk, eps_k, "k")}) {
    TORCH_CHECK(x.defined() && x.dim() == 2 && x.size(1) > 0 && x.size(1) % D == 0, "qk_norm_rope: ", name,
                " must be 2-D [T, heads * ", std::to_string(D), "]; got ",
                x.defined() ? dims(x.sizes()) : std::string("undefined"));
    TORCH_CHECK(float_dtype(x.scalar_type()), "qk_norm_rope: ", name, " must be bfloat16, float16 or float32; got ",
                x.scalar_type());
    TORCH_CHECK(x.stride(1) == 1, "qk_norm_rope: ", name, "'s last dim must be contiguous (stride 1); got strides ",
                dims(x.strides()));
    TORCH_CHECK(w.defined() && w.dim() == 1 && w.size(0) == D && w.scalar_type() == x.scalar_type() &&
                w.is_contiguous() && w.device() == x.device(), "qk_norm_rope: ", name, "'s norm weight must be a "
                "contiguous [", std::to_string(D), "] of ", name, "'s dtype on its device");
    TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, "qk_norm_rope: eps must be a finite number >= 0; got ",
                std::to_string(eps));
  }
#ifndef JETRL_WITH_CUDA
  TORCH_CHECK(!q.is_cuda(), "qk_norm_rope: megatron_jetrl._C was built without CUDA kernels; rebuild on a machine "
              "with nvcc and a CUDA build of torch: pip install --no-build-isolation -e .");
#endif
  TORCH_CHECK(q.is_cuda(), "qk_norm_rope: the fused kernel runs on CUDA; q is on ", q.device().str(),
              " (ops.exact.qk_norm_rope norms, then rotates, elsewhere)");
  TORCH_CHECK(k.size(0) == q.size(0) && k.scalar_type() == q.scalar_type() && k.device() == q.device(),
              "qk_norm_rope: k must have q's tokens, dtype and device; got ", dims(k.sizes()), " ", k.scalar_type());
  TORCH_CHECK(positions.defined() && positions.dim() == 1 && positions.size(0) == q.size(0) &&
              positions.scalar_type() == at::kLong && positions.is_contiguous(), "qk_norm_rope: positions must be "
              "contiguous int64 [T] = [", std::to_string(q.size(0)), "]");
  TORCH_CHECK(positions.device() == q.device() && inv_freq.device() == q.device(),
              "qk_norm_rope: positions and inv_freq must be on q's device ", q.device().str());
  const auto contiguous = q.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor yq = at::empty(q.sizes(), contiguous), yk = at::empty(k.sizes(), contiguous);
  if (q.size(0) == 0) return {yq, yk};
#ifdef JETRL_WITH_CUDA
  QkNormRopeArgs args;
  args.q = q.data_ptr();
  args.k = k.data_ptr();
  args.wq = wq.data_ptr();
  args.wk = wk.data_ptr();
  args.positions = positions.data_ptr<int64_t>();
  args.inv_freq = inv_freq.data_ptr<float>();
  args.yq = yq.data_ptr();
  args.yk = yk.data_ptr();
  args.T = q.size(0);
  args.Hq = q.size(1) / D;
  args.Hk = k.size(1) / D;
  args.D = D;
  args.q_stride = q.stride(0);
  args.k_stride = k.stride(0);
  args.eps_q = static_cast<float>(eps_q);
  args.eps_k = static_cast<float>(eps_k);
  qk_norm_rope_cuda(args, q.scalar_type(), q);
#endif
  return {yq, yk};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs(x, weight, eps);
  const int64_t R = x.size(0), H = x.size(1);
  at::Tensor y = at::empty({R, H}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (R == 0) return y;
  const RmsNormArgs args = norm_args(x, weight, y, eps);
#ifdef JETRL_WITH_CUDA
  if (x.is_cuda()) {
    rms_norm_cuda(args, x.scalar_type(), x);
    return y;
  }
#endif
  rms_norm_cpu(args, x.scalar_type());
  return y;
}

}  // namespace jetrl
