// Registers the extension's functions; validation and dispatch live in quantize.cpp.
#include <torch/extension.h>

#include "copy_segments.h"
#include "elementwise.h"
#include "quantize.h"
#include "rms_norm.h"
#include "rope.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-jetrl kernels: fused FP8 E4M3 block quantization, batched 2-D byte copies";
  m.def("quantize_1x128", &jetrl::quantize_1x128, "1x128-group FP8 quantization, rowwise and/or columnwise",
        py::arg("x"), py::arg("rowwise"), py::arg("columnwise"), py::arg("pow2_scales"), py::arg("eps"));
  m.def("quantize_128x128", &jetrl::quantize_128x128, "128x128-block FP8 quantization, optional transposed copy",
        py::arg("x"), py::arg("with_transpose"), py::arg("pow2_scales"), py::arg("eps"));
  m.def("copy_segments", &jetrl::copy_segments, "batched 2-D byte copies (int64 table [S, 8], see copy_segments.h)",
        py::arg("srcs"), py::arg("dsts"), py::arg("table"));
  m.def("rms_norm", &jetrl::rms_norm, "batch-invariant RMSNorm, fixed reduction order (see rms_norm.h)",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("add_rms_norm", &jetrl::add_rms_norm, "residual add + batch-invariant RMSNorm in one launch (CUDA)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rms_norm_quant", &jetrl::rms_norm_quant,
        "(residual add +) batch-invariant RMSNorm + 1x128 FP8 quantization in one launch (CUDA)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("pow2_scales"), py::arg("quant_eps"),
        py::arg("m_align"));
  m.def("qk_norm_rope", &jetrl::qk_norm_rope, "the exact forward's q/k norms + rotary embedding in one launch (CUDA)",
        py::arg("q"), py::arg("k"), py::arg("wq"), py::arg("wk"), py::arg("eps_q"), py::arg("eps_k"),
        py::arg("positions"), py::arg("inv_freq"));
  m.def("silu_mul_quant", &jetrl::silu_mul_quant, "SiLU(gate) * up + 1x128 FP8 quantization in one launch (CUDA)",
        py::arg("x"), py::arg("pow2_scales"), py::arg("quant_eps"), py::arg("m_align"));
  m.def("ordered_sum", &jetrl::ordered_sum, "the TP ranks' partial results summed in rank order in fp32 (CUDA)",
        py::arg("parts"));
  m.def("silu_mul", &jetrl::silu_mul, "SiLU(gate) * up of the exact forward, torch's rounding (CUDA)", py::arg("x"));
  m.def("static_fp8_quant", &jetrl::static_fp8_quant, "E4M3 codes of x / scale, one fp32 scale (CUDA)",
        py::arg("x"), py::arg("scale"));
  m.def("rope", &jetrl::rope, "rotary embedding of the exact forward, megatron's rounding (see rope.h)",
        py::arg("x"), py::arg("positions"), py::arg("inv_freq"));
  m.def("with_cuda", &jetrl::with_cuda, "whether the CUDA kernels were compiled in");
}
