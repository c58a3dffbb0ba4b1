"""Reference FP8 E4M3 block quantizer: the single definition of the project's quantization math.

Every other implementation (the CUDA and C++ kernels in ``csrc/``, the weight sync, the FP8
checkpoint export) must produce the same bytes as ``quantize_fp8_blockwise``; tests compare them
bit for bit. The rule is Transformer Engine's blockwise quantizer (TE 2.x,
``compute_scale_from_amax``), evaluated in fp32:

    for every block B of x (block_shape (bm, bk); tail blocks hold only the elements that exist)
        amax  = max |x|  over B
        amax  = eps                    if amax < eps
        scale = 1                      if amax == 0
              = FLT_MAX                if 448 / amax overflows to +inf
              = 448 / amax             otherwise
        scale = 2^floor(log2(scale))   if pow2_scales (clear the fp32 mantissa bits)
        data  = cast_e4m3(clamp(x * scale, -448, 448))   round to nearest even
        scale_inv = 1 / scale

One deliberate difference from TE: a block holding a NaN or an Inf never becomes finite codes.
TE maps an infinite amax to scale 1 and saturates; torch's own float -> e4m3 cast turns +Inf
into 448. Here such a block gets ``scale_inv = NaN`` and every code NaN (0x7F), so the failure
reaches the loss instead of being trained on silently.

Shapes (legend used across precision/ and ops/): x_MK [M, K]; block (bm, bk);
scale_inv_MbKb [ceil(M/bm), ceil(K/bk)].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3_MAX = 448.0
FP32_MAX = torch.finfo(torch.float32).max
NAN_CODE = 0x7F
"""The e4m3fn code written for every element of a block that holds NaN or Inf."""

WEIGHT_BLOCK = (128, 128)
GROUP_1x128 = (1, 128)

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_EXP_MASK = 0x7F800000


@dataclass(frozen=True)
class Fp8Tensor:
    """FP8 E4M3 data with one fp32 dequantization scale per block.

    ``data`` is float8_e4m3fn [R, C]; ``scale_inv`` is float32 [ceil(R/bm), ceil(C/bk)] in any
    strides (kernels return 1x128 scales group-major, i.e. strides (1, R), the layout torch's
    blockwise GEMM wants); ``block_shape`` is (bm, bk).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    block_shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8_blockwise(self.data, self.scale_inv, self.block_shape, dtype=dtype)


def block_grid(shape: tuple[int, int], block_shape: tuple[int, int]) -> tuple[int, int]:
    """Number of blocks along each dimension, counting partial tail blocks."""
    return math.ceil(shape[0] / block_shape[0]), math.ceil(shape[1] / block_shape[1])


def check_block_shape(block_shape) -> tuple[int, int]:
    if (
        not isinstance(block_shape, (tuple, list))
        or len(block_shape) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_shape)
    ):
        raise ValueError(f"block_shape must be two positive ints, e.g. (128, 128) or (1, 128); got {block_shape!r}")
    return int(block_shape[0]), int(block_shape[1])


def check_eps(eps) -> float:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps (amax epsilon) must be a finite number >= 0; got {eps!r}")
    return float(eps)


def scale_from_amax(amax: torch.Tensor, *, pow2_scales: bool, eps: float) -> torch.Tensor:
    """fp32 quantization scale per block from its amax (see the module rule).

    ``amax`` is fp32 with +inf marking a block that holds NaN/Inf; such blocks get scale NaN.
    """
    amax = amax.float()
    if eps > 0:
        amax = torch.clamp_min(amax, eps)
    # tensor / tensor: a Python scalar on the left would go through reciprocal(amax) * 448,
    # which is not IEEE division and differs from TE (and the kernels) in the last bit.
    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    if pow2_scales:
        scale = (scale.view(torch.int32) & _EXP_MASK).view(torch.float32)
    return torch.where(torch.isinf(amax), torch.full_like(scale, float("nan")), scale)


def quantize_fp8_blockwise(
    x: torch.Tensor,
    block_shape: tuple[int, int] = WEIGHT_BLOCK,
    *,
    pow2_scales: bool = False,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to FP8 E4M3 with one scale per block (the module rule).

    Args:
        x: bf16, fp16 or fp32 tensor [M, K], any device, any strides.
        block_shape: (bm, bk); the recipe uses (128, 128) for weights and (1, 128) for
            activations and gradients. To group along the first dimension (WGrad's 1x128 along
            tokens) quantize ``x.t()``.
        pow2_scales: round every scale down to a power of two (TE's default, DeepGEMM's UE8M0).
        eps: amax epsilon; amax below it is raised to it.

    Returns:
        ``(data, scale_inv)``: float8_e4m3fn [M, K] and contiguous float32
        [ceil(M/bm), ceil(K/bk)], on x's device.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K]; got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32; got {x.dtype}")
    bm, bk = check_block_shape(block_shape)
    eps = check_eps(eps)
    M, K = x.shape
    Mb, Kb = block_grid((M, K), (bm, bk))
    if M == 0 or K == 0:
        return (
            torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty((Mb, Kb), dtype=torch.float32, device=x.device),
        )
    padded = torch.nn.functional.pad(x.float(), (0, Kb * bk - K, 0, Mb * bm - M)).contiguous()
    blocks = padded.view(Mb, bm, Kb, bk)
    magnitude = torch.where(torch.isfinite(blocks), blocks.abs(), torch.full_like(blocks, float("inf")))
    amax = magnitude.amax(dim=(1, 3))
    scale = scale_from_amax(amax, pow2_scales=pow2_scales, eps=eps)
    bad = torch.isnan(scale)
    safe_scale = torch.where(bad, torch.ones_like(scale), scale)
    scaled = (blocks * safe_scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(bad[:, None, :, None], torch.full_like(codes, NAN_CODE), codes)
    data = codes.reshape(Mb * bm, Kb * bk)[:M, :K].contiguous().view(torch.float8_e4m3fn)
    scale_inv = torch.where(bad, scale, torch.div(torch.ones_like(safe_scale), safe_scale))
    return data, scale_inv.contiguous()


def dequantize_fp8_blockwise(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    block_shape: tuple[int, int] = WEIGHT_BLOCK,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``data * scale_inv`` broadcast over blocks, computed in fp32 (fp64 if asked) then cast."""
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"data must be float8_e4m3fn; got {data.dtype}")
    if data.dim() != 2:
        raise ValueError(f"data must be 2-D; got shape {tuple(data.shape)}")
    bm, bk = check_block_shape(block_shape)
    M, K = data.shape
    expected = block_grid((M, K), (bm, bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match data {tuple(data.shape)} "
            f"with block {(bm, bk)}: expected {expected}"
        )
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"scale_inv must be float32; got {scale_inv.dtype}")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    s = scale_inv.to(compute).repeat_interleave(bm, dim=0)[:M].repeat_interleave(bk, dim=1)[:, :K]
    return (data.to(compute) * s).to(dtype)


def transpose_blocks(t: Fp8Tensor) -> Fp8Tensor:
    """The same FP8 bytes transposed, with the block scales transposed: no re-quantization.

    Exact for square blocks: quantizing x.t() with (128, 128) gives exactly these bytes, since a
    square block of x.t() holds the elements of the transposed block of x.
    """
    bm, bk = t.block_shape
    if bm != bk:
        raise ValueError(f"only square blocks transpose without re-quantization; got {t.block_shape}")
    return Fp8Tensor(t.data.t().contiguous(), t.scale_inv.t().contiguous(), (bk, bm))
