"""Fused FP8 quantization kernels (csrc/quantize*.{cpp,cu}) and the quantizer built on them.

Each function returns exactly the bytes of its reference, ``megatron_jetrl.precision``'s
``quantize_fp8_blockwise`` (and ``ReferenceQuantizer`` for the quantizer), on CUDA through the
one-pass tile kernel and on CPU through the C++ loops. 1x128 scales come back group-major
(strides (1, rows)), the layout torch's blockwise GEMM reads without a copy.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_jetrl.ops.extension import load_extension
from megatron_jetrl.precision import GROUP_1x128, WEIGHT_BLOCK, Fp8Tensor, Fp8Weight
from megatron_jetrl.precision.blockwise import check_eps


def quantize_1x128(
    x_MK: torch.Tensor, *, rowwise: bool = True, columnwise: bool = False, pow2_scales: bool = False, eps: float = 0.0
) -> tuple[Optional[Fp8Tensor], Optional[Fp8Tensor]]:
    """One read of x, 1x128 groups: rowwise (along K) -> [M, K]; columnwise (along M) -> xᵀ [K, M].

    Reference: ``quantize_fp8_blockwise(x, (1, 128))`` and ``quantize_fp8_blockwise(x.t(), (1, 128))``.
    """
    q, s, qt, st = load_extension().quantize_1x128(x_MK, rowwise, columnwise, bool(pow2_scales), check_eps(eps))
    row = Fp8Tensor(q, s, GROUP_1x128) if rowwise else None
    col = Fp8Tensor(qt, st, GROUP_1x128) if columnwise else None
    return row, col


def quantize_128x128(
    x_MK: torch.Tensor, *, with_transpose: bool = False, pow2_scales: bool = False, eps: float = 0.0
) -> tuple[Fp8Tensor, Optional[Fp8Tensor]]:
    """128x128 blocks -> [M, K], and optionally the same codes transposed [K, M] from the same pass.

    Reference: ``quantize_fp8_blockwise(x, (128, 128))`` and ``transpose_blocks`` of it.
    """
    q, s, qt = load_extension().quantize_128x128(x_MK, with_transpose, bool(pow2_scales), check_eps(eps))
    blocks = Fp8Tensor(q, s, WEIGHT_BLOCK)
    transposed = Fp8Tensor(qt, s.t().contiguous(), WEIGHT_BLOCK) if with_transpose else None
    return blocks, transposed


def rows_scale_layout(x_MK: torch.Tensor, m_align: int) -> torch.Tensor:
    """An empty [M, K/128] fp32 scale tensor on x's device, column-major with the column stride M
    rounded up to ``m_align`` (1: torch's and CUTLASS's layout; 4: DeepGEMM's TMA alignment)."""
    m, k = x_MK.shape
    stride = max((m + m_align - 1) // m_align * m_align, 1)
    return torch.empty_strided((m, k // GROUP_1x128[1]), (1, stride), dtype=torch.float32, device=x_MK.device)


def quantize_rows(x_MK: torch.Tensor, *, pow2_scales: bool, eps: float,
                  m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 rowwise codes [M, K] and scale_inv in ``rows_scale_layout(x, m_align)``: the activation
    quantization a block-FP8 linear of the rollout engine reads (``rollout/vllm_activation_quant.py``)."""
    if x_MK.shape[0] == 0:
        return torch.empty(x_MK.shape, dtype=torch.float8_e4m3fn, device=x_MK.device), rows_scale_layout(x_MK, m_align)
    row, _ = quantize_1x128(x_MK, rowwise=True, columnwise=False, pow2_scales=pow2_scales, eps=eps)
    if m_align == 1 or x_MK.shape[0] % m_align == 0:
        return row.data, row.scale_inv  # column-major: strides (1, M), M already aligned
    return row.data, rows_scale_layout(x_MK, m_align).copy_(row.scale_inv)


class NativeQuantizer:
    """``Fp8Quantizer`` on the fused kernels: the same bytes as ``ReferenceQuantizer``.

    Inputs must be contiguous; the linear makes them so. Raises ``ExtensionUnavailable`` at
    construction when the extension is not built, and the kernels raise for a CUDA tensor when
    the build has no CUDA kernels.
    """

    def __init__(self, *, pow2_scales: bool = False, eps: float = 0.0):
        load_extension()
        self.pow2_scales = bool(pow2_scales)
        self.eps = check_eps(eps)

    def quantize_groups(self, x_MK, *, rowwise, columnwise):
        if not (rowwise or columnwise):
            return None, None
        return quantize_1x128(x_MK, rowwise=rowwise, columnwise=columnwise, pow2_scales=self.pow2_scales, eps=self.eps)

    def quantize_weight(self, w_NK):
        if not w_NK.is_contiguous():
            w_NK = w_NK.contiguous()
        fprop, dgrad = quantize_128x128(w_NK, with_transpose=True, pow2_scales=self.pow2_scales, eps=self.eps)
        return Fp8Weight(fprop=fprop, dgrad=dgrad)


__all__ = ["NativeQuantizer", "quantize_128x128", "quantize_1x128", "quantize_rows", "rows_scale_layout"]
