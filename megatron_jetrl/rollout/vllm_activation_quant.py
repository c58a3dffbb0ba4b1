"""The trainer's 1x128 activation quantization inside vLLM (``rollout.vllm.activation_quant: trainer``).

vLLM quantizes the input of each block-FP8 linear itself (``QuantFP8``, dynamic 1x128 groups):
``scale_inv = amax / 448`` and ``q = x / scale_inv``. The trainer uses TE's rule
(``precision/blockwise.py``): ``scale = 448 / amax``, ``q = x * scale``, ``scale_inv = 1 / scale``. On
the same BF16 input about half the groups get a ``scale_inv`` one ulp apart and about 1e-3 of the
codes one E4M3 step apart (docs/rollout.md). With this option vLLM hands that quantization to the
trainer's own kernel (``ops.quantize_1x128``), so the engine multiplies the codes and scales the
trainer's FProp would make from the same BF16 input.

How:
- vLLM's out-of-tree custom-op registry (``CustomOp.register_oot``, vLLM's way to replace one of
  its ops) makes every ``QuantFP8`` built afterwards in this process a ``TrainerQuantFP8``. Dynamic
  1x128 group quantization goes to the trainer's kernel; every other kind (static, per-token,
  per-tensor, power-of-two scales for DeepGEMM) stays vLLM's, except in the exact mode, where the
  static one (an FP8 KV cache's query, one scale) runs ``jetrl::static_fp8_quant``
  (``ops/exact.py``), the op the trainer's exact attention quantizes its queries with.
- The kernel is wrapped as a torch custom op (``jetrl::quantize_1x128_rows``), one opaque call
  for torch.compile and CUDA graphs.
- Under torch.compile vLLM would fuse RMSNorm and SiLU-mul with the quantization into its own
  kernels, which bypass ``QuantFP8``. ``llm_kwargs`` turns ``fuse_norm_quant`` and
  ``fuse_act_quant`` off with this option, so the norm's BF16 output is quantized as the trainer
  quantizes it.

Scale layouts are the ones vLLM's GEMM asked for: row-major, column-major (the trainer kernel's own
group-major layout, strides (1, M)), or column-major with M padded to a multiple of 4 (TMA).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

GROUP = 128
E4M3 = torch.float8_e4m3fn
_op: Any = None


def quantize_rows_op() -> Any:
    """``torch.ops.jetrl.quantize_1x128_rows(x [M, K] bf16, pow2_scales, eps, m_align) -> (q [M, K]
    e4m3, scale_inv [M, K/128] fp32, strides (1, M rounded up to m_align))``: ``ops.quantize_rows``
    as a torch custom op; ``m_align`` 4 gives the TMA-aligned scale layout DeepGEMM reads. The
    aligned copy happens inside the op: traced by torch.compile, ``torch.empty_strided`` of a
    symbolic shape fails (vLLM 0.26.0 + DeepGEMM)."""
    global _op
    if _op is None:
        from megatron_jetrl.ops.quantize import quantize_rows, rows_scale_layout

        @torch.library.custom_op("jetrl::quantize_1x128_rows", mutates_args=())
        def quantize_1x128_rows(x: torch.Tensor, pow2_scales: bool, eps: float,
                                m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
            return quantize_rows(x, pow2_scales=pow2_scales, eps=eps, m_align=m_align)

        @quantize_1x128_rows.register_fake
        def _(x: torch.Tensor, pow2_scales: bool, eps: float, m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.empty(x.shape, dtype=E4M3, device=x.device), rows_scale_layout(x, m_align)

        _op = quantize_1x128_rows
    return _op


def _registry() -> dict:
    from vllm.model_executor.custom_op import CustomOp

    return sys.modules[CustomOp.__module__].op_registry_oot


def install(pow2_scales: bool, eps: float, exact: bool = False) -> None:
    """Make every vLLM ``QuantFP8`` built from now on in this process quantize dynamic 1x128 groups
    with the trainer's kernel and these scale options (the recipe's ``precision.fp8``); with
    ``exact`` (``precision.exact``), static quantization with one scale (an FP8 KV cache's query)
    with ``jetrl::static_fp8_quant``, which the trainer's exact attention calls too. Call before
    ``vllm.LLM`` builds the model. Installing the same options again is a no-op; other options
    while installed raise (one engine per process)."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

    from megatron_jetrl.ops.exact import custom_ops
    from megatron_jetrl.ops.extension import load_extension

    load_extension()  # raises, naming the build command, before vLLM builds anything
    options = (bool(pow2_scales), float(eps))
    exact_ops = custom_ops() if exact else None
    current = _registry().get(QuantFP8.__name__)
    if current is not None:
        if getattr(current, "jetrl_options", None) == (*options, exact):
            return
        raise RuntimeError(f"vLLM's QuantFP8 is already replaced by {current.__qualname__}; one replacement "
                           "per process (one vllm engine per process)")
    op = quantize_rows_op()

    class TrainerQuantFP8(QuantFP8):
        """``QuantFP8`` whose dynamic 1x128 group quantization is the trainer's (module docstring)."""

        jetrl_options = (*options, exact)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.trainer_groups = (not self.static and tuple(self.group_shape) == (1, GROUP)
                                   and not self.use_ue8m0)
            self.jetrl_exact_static = exact and self.static
            """Static quantization through the exact op (an FP8 KV cache's query, ``precision.exact``;
            vLLM asks for per-head groups where the model has one KV head: one scale all the same)."""
            if self.trainer_groups and self.num_token_padding is not None:
                raise RuntimeError(f"vLLM asked for 1x128 activation quantization with token padding "
                                   f"{self.num_token_padding}; rollout.vllm.activation_quant=trainer does not pad "
                                   "(use activation_quant=vllm)")

        def forward_native(self, x, scale=None, scale_ub=None, use_triton=False):
            return self._forward(super().forward_native, x, scale, scale_ub, use_triton)

        def forward_cuda(self, x, scale=None, scale_ub=None, use_triton=False):
            return self._forward(super().forward_cuda, x, scale, scale_ub, use_triton)

        def _forward(self, vllms, x, scale, scale_ub, use_triton):
            """The exact static op, the trainer's 1x128 kernel, or else ``vllms`` (vLLM's own forward for
            the platform it dispatched to)."""
            if self.jetrl_exact_static:
                return self._exact_static(x, scale)
            if not self.trainer_groups:
                return vllms(x, scale, scale_ub, use_triton)
            return self._trainer(x)

        def _exact_static(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if scale.numel() != 1:
                raise RuntimeError(f"precision.exact: static FP8 quantization with {scale.numel()} scales (per-head "
                                   "KV-cache scales) has no exact kernel; the exact op takes one scale")
            return exact_ops.static_fp8_quant(x, scale), scale

        def _trainer(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if x.dim() != 2 or x.shape[-1] % GROUP:
                raise RuntimeError(f"activation of shape {list(x.shape)}: the trainer's 1x128 quantization "
                                   f"takes [tokens, K] with K a multiple of {GROUP}")
            aligned = self.column_major_scales and self.tma_aligned_scales
            q, s = op(x.contiguous(), *options, 4 if aligned else 1)
            if not self.column_major_scales:
                return q, s.contiguous()
            return q, s  # column-major: strides (1, M), or (1, M rounded up to 4) for TMA

    QuantFP8.register_oot(TrainerQuantFP8)
    TrainerQuantFP8.name = QuantFP8.name  # enabled / disabled by vLLM's own "+quant_fp8" setting


def uninstall() -> None:
    """Undo ``install`` for ``QuantFP8``s built afterwards (tests; one engine per process otherwise)."""
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8

    registry = _registry()
    if getattr(registry.get(QuantFP8.__name__), "jetrl_options", None) is not None:
        del registry[QuantFP8.__name__]
