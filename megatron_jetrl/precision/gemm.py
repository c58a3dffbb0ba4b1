"""Blockwise-scaled FP8 GEMM ``out = a · bᵀ``: torch's scaled matmul on Hopper, an emulation elsewhere.

Both operands are row-major with their scale groups along the contraction dim K:
``a`` is [M, K] with 1x128 groups; ``b`` is [N, K] with 128x128 blocks (FProp, DGrad) or 1x128
groups (WGrad). The emulation dequantizes both operands exactly (fp32) and multiplies in fp32, so
CPU tests check the same quantization semantics the Hopper kernel computes; the two differ only in
accumulation order and precision.

Hopper layout rules (torch ``_scaled_mm``, torch >= 2.10, CUDA >= 12.9; measured on H200 with
torch 2.11), which this module owns:
- a 1x128 scale is [rows, K/128] with strides (1, rows) ("outer-dim-major");
- ``b`` goes in as ``b.data.t()`` (column-major); its 128x128 scale as ``scale.t()``, its 1x128
  scale as ``scale.t()`` with ``scale`` outer-dim-major (so the argument is contiguous);
- cuBLAS needs rows of ``a`` a multiple of 4, rows of ``b`` and K multiples of 16, and -- silently,
  with wrong results otherwise -- a 128x128 scale whose K/128 is a multiple of 4. So K is padded
  to 128 (512 with a 128x128 operand), rows of ``a`` to 4 and of ``b`` to 16: zero codes add
  nothing to the dot products and pad scales are 1. Aligned shapes (every Llama/Qwen projection at
  a token count that is a multiple of 4) pass through without a copy.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from megatron_jetrl.precision.blockwise import GROUP_1x128, WEIGHT_BLOCK, Fp8Tensor

GemmBackend = Literal["auto", "scaled_mm", "emulate"]
GEMM_BACKENDS = ("auto", "scaled_mm", "emulate")


@functools.lru_cache(maxsize=None)
def scaled_mm_supported(device: torch.device) -> bool:
    """torch's blockwise FP8 GEMM: a Hopper GPU (sm_90) and torch >= 2.10."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return torch.cuda.get_device_capability(device) == (9, 0) and major_minor >= (2, 10)


def resolve_gemm_backend(backend: GemmBackend, device: torch.device) -> str:
    """``auto`` picks scaled_mm on Hopper and the emulation everywhere else; asking for
    scaled_mm where it cannot run is an error, not a silent fallback."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm backend must be one of {GEMM_BACKENDS}; got {backend!r}")
    if backend == "auto":
        return "scaled_mm" if scaled_mm_supported(device) else "emulate"
    if backend == "scaled_mm" and not scaled_mm_supported(device):
        raise RuntimeError(
            f"gemm backend 'scaled_mm' needs a Hopper GPU (sm_90) and torch >= 2.10; "
            f"device {device}, torch {torch.__version__}. Use 'auto' or 'emulate'."
        )
    return backend


def fp8_gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, backend: GemmBackend = "auto") -> torch.Tensor:
    """``a · bᵀ`` -> [M, N] in ``out_dtype``; see the module docstring for operand layouts."""
    if a.block_shape != GROUP_1x128:
        raise ValueError(f"operand a must have 1x128 groups; got {a.block_shape}")
    if b.block_shape not in (GROUP_1x128, WEIGHT_BLOCK):
        raise ValueError(f"operand b must have 1x128 groups or 128x128 blocks; got {b.block_shape}")
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"contraction dims differ: a {tuple(a.data.shape)}, b {tuple(b.data.shape)}")
    if a.data.device != b.data.device:
        raise ValueError(f"operands on different devices: {a.data.device} and {b.data.device}")
    if resolve_gemm_backend(backend, a.data.device) == "emulate":
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
    return _scaled_mm(a, b, out_dtype)


def _scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    M, K = a.data.shape
    N = b.data.shape[0]
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=out_dtype, device=a.data.device)
    k_align = 512 if b.block_shape == WEIGHT_BLOCK else 128
    a_data, a_scale = _padded(a, 4, k_align)
    b_data, b_scale = _padded(b, 16, k_align)
    out = torch._scaled_mm(
        a_data,
        b_data.t(),
        scale_a=_outer_dim_major(a_scale),
        scale_b=(_outer_dim_major(b_scale) if b.block_shape == GROUP_1x128 else b_scale.contiguous()).t(),
        out_dtype=out_dtype,
        use_fast_accum=False,
    )
    return out if out.shape == (M, N) else out[:M, :N]


def _padded(t: Fp8Tensor, row_align: int, k_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes zero-padded to (row_align, k_align) multiples, and the scale grid padded with ones."""
    rows, cols = t.data.shape
    rows_p, cols_p = _round_up(rows, row_align), _round_up(cols, k_align)
    if (rows_p, cols_p) == (rows, cols):
        return t.data, t.scale_inv
    data = torch.zeros((rows_p, cols_p), dtype=torch.uint8, device=t.data.device)
    data[:rows, :cols] = t.data.view(torch.uint8)
    bm, bk = t.block_shape
    grid = (math.ceil(rows_p / bm), math.ceil(cols_p / bk))
    scale = t.scale_inv
    if tuple(scale.shape) != grid:
        scale = torch.ones(grid, dtype=torch.float32, device=scale.device)
        scale[: t.scale_inv.shape[0], : t.scale_inv.shape[1]] = t.scale_inv
    return data.view(torch.float8_e4m3fn), scale


def _outer_dim_major(scale: torch.Tensor) -> torch.Tensor:
    """[rows, groups] with strides (1, rows): the layout scaled_mm checks for 1x128 scales."""
    rows = scale.shape[0]
    if scale.stride(0) == 1 and (scale.shape[1] == 1 or scale.stride(1) == rows):
        return scale
    return scale.t().contiguous().t()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
