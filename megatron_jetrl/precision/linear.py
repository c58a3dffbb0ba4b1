"""``Fp8BlockLinear``: y = x·Wᵀ (+ b) with FProp, DGrad and WGrad all as FP8 block-scaled GEMMs.

    FProp  y  = x · Wᵀ      x: 1x128 groups along K        W: 128x128 blocks
    DGrad  dx = dy · W      dy: 1x128 groups along N       Wᵀ: the same blocks, bytes transposed
    WGrad  dW = dyᵀ · x     dyᵀ, xᵀ: 1x128 groups along the token dim M

Why the token-dim groups: WGrad contracts over tokens, and a block-scaled GEMM needs its groups
along the contraction dim, so x and dy are quantized a second time from their BF16 values along
M (never re-quantized from FP8). Why W is not re-quantized for DGrad: a 128x128 block is the same
block after transposition, so DGrad uses exactly the weight bytes FProp used.

Outputs and gradients between operators keep the input dtype (BF16 in training). The FP8 weight is
computed once per optimizer step (``Fp8WeightCache``) and shared by every micro-batch's FProp and
DGrad, and by the weight sync.

Quantization is done by an ``Fp8Quantizer``: ``ReferenceQuantizer`` here (pure torch, any device),
or ``megatron_jetrl.ops.NativeQuantizer`` (fused kernels, same bytes), chosen by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Protocol

import torch

from megatron_jetrl.precision.gemm import GemmBackend, fp8_gemm
from megatron_jetrl.precision.blockwise import (
    GROUP_1x128,
    WEIGHT_BLOCK,
    Fp8Tensor,
    check_eps,
    quantize_fp8_blockwise,
    transpose_blocks,
)


@dataclass(frozen=True)
class Fp8Weight:
    """A weight [N, K] quantized with 128x128 blocks, in the two layouts the GEMMs read.

    ``fprop`` is the checkpoint / rollout layout (``weight`` + ``weight_scale_inv``); ``dgrad`` is
    the same bytes and scales transposed ([K, N]).
    """

    fprop: Fp8Tensor
    dgrad: Fp8Tensor


class Shard(NamedTuple):
    """One rank's shard of a model tensor and, for a linear computing in FP8, the FP8 weight
    (checkpoint layout: codes + 128x128 ``scale_inv``) its FProp reads: what the weight sync
    sends (``Actor.weight_shards``)."""

    dense: torch.Tensor
    fp8: Optional[Fp8Tensor] = None


class Fp8Quantizer(Protocol):
    pow2_scales: bool
    eps: float

    def quantize_groups(
        self, x_MK: torch.Tensor, *, rowwise: bool, columnwise: bool
    ) -> tuple[Optional[Fp8Tensor], Optional[Fp8Tensor]]:
        """1x128 groups: rowwise along K -> [M, K]; columnwise along M -> xᵀ [K, M]."""
        ...

    def quantize_weight(self, w_NK: torch.Tensor) -> Fp8Weight:
        ...


class ReferenceQuantizer:
    """The quantizer contract in pure torch (``quantize_fp8_blockwise``); runs on any device."""

    def __init__(self, *, pow2_scales: bool = False, eps: float = 0.0):
        self.pow2_scales = bool(pow2_scales)
        self.eps = check_eps(eps)

    def quantize_groups(self, x_MK, *, rowwise, columnwise):
        kw = {"pow2_scales": self.pow2_scales, "eps": self.eps}
        row = Fp8Tensor(*quantize_fp8_blockwise(x_MK, GROUP_1x128, **kw), GROUP_1x128) if rowwise else None
        col = Fp8Tensor(*quantize_fp8_blockwise(x_MK.t(), GROUP_1x128, **kw), GROUP_1x128) if columnwise else None
        return row, col

    def quantize_weight(self, w_NK):
        fprop = Fp8Tensor(
            *quantize_fp8_blockwise(w_NK, WEIGHT_BLOCK, pow2_scales=self.pow2_scales, eps=self.eps), WEIGHT_BLOCK
        )
        return Fp8Weight(fprop=fprop, dgrad=transpose_blocks(fprop))


class Fp8WeightCache:
    """Holds one weight's FP8 form and re-quantizes only when the weight changed.

    A change is seen through the tensor's version counter (bumped by every in-place update,
    including the optimizer step), its storage and its shape, so all micro-batches of a step share
    one quantization and an updated weight is never served stale. ``invalidate()`` forces a
    re-quantization, e.g. after loading a checkpoint through ``.data``.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: Fp8Weight | None = None

    def get(self, weight: torch.Tensor, quantizer: Fp8Quantizer) -> Fp8Weight:
        key = (
            weight._version,
            weight.data_ptr(),
            tuple(weight.shape),
            weight.dtype,
            type(quantizer),
            quantizer.pow2_scales,
            quantizer.eps,
        )
        if self._value is None or key != self._key:
            with torch.no_grad():
                self._value = quantizer.quantize_weight(weight.detach())
            self._key = key
        return self._value

    def invalidate(self) -> None:
        self._key = self._value = None


FpropGemm = Callable[[Fp8Tensor, Fp8Tensor, torch.dtype], torch.Tensor]
"""``(x [M, K] 1x128 groups, W [N, K] 128x128 blocks, out dtype) -> x·Wᵀ`` [M, N]: another kernel for
the FProp GEMM (the exact mode's: vLLM's block-FP8 GEMM, ``ops.exact.VllmKernels.fp8_gemm``)."""

WgradInto = Callable[[Fp8Tensor, Fp8Tensor, torch.Tensor], None]
"""``(dyᵀ [N, M], xᵀ [K, M], main [N, K] fp32)``, both operands in 1x128 groups along the tokens M:
``main += dyᵀ·x`` in fp32, in place (``ops.deep_gemm.wgrad_into``). Used where the weight carries
megatron's fp32 ``main_grad``: the WGrad then lands there directly, and the weight's ``grad`` is
megatron's placeholder (``grad_added_to_main_grad``), instead of a BF16 ``dW`` its DDP hook adds."""


class Fp8BlockLinear(torch.autograd.Function):
    """Autograd function; call through ``fp8_block_linear``."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8_weight: Fp8Weight, quantizer: Fp8Quantizer, gemm: GemmBackend,
                fprop: Optional[FpropGemm], wgrad_into: Optional[WgradInto]):
        N, K = weight.shape
        x_MK = x.reshape(-1, K)
        need_wgrad = ctx.needs_input_grad[1]
        x_row, x_col = quantizer.quantize_groups(x_MK, rowwise=True, columnwise=need_wgrad)
        if fprop is None:
            y = fp8_gemm(x_row, fp8_weight.fprop, x.dtype, gemm)
        else:
            y = fprop(x_row, fp8_weight.fprop, x.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.x_col = x_col
        ctx.fp8_weight = fp8_weight
        ctx.quantizer = quantizer
        ctx.gemm = gemm
        ctx.shapes = (x.shape, weight.dtype, None if bias is None else bias.dtype)
        ctx.main_grad_of = weight if wgrad_into is not None and need_wgrad else None
        ctx.wgrad_into = wgrad_into
        return y.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        x_shape, w_dtype, b_dtype = ctx.shapes
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]
        N = dy.shape[-1]
        dy_MN = dy.reshape(-1, N)
        if not dy_MN.is_contiguous():
            dy_MN = dy_MN.contiguous()
        dy_row, dy_col = ctx.quantizer.quantize_groups(dy_MN, rowwise=need_dgrad, columnwise=need_wgrad)
        dx = dw = db = None
        if need_dgrad:
            dx = fp8_gemm(dy_row, ctx.fp8_weight.dgrad, dy.dtype, ctx.gemm).view(x_shape)
        if need_wgrad:
            dw = _wgrad(ctx, dy_col, w_dtype)
        if need_bgrad:
            db = dy_MN.sum(0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


def _wgrad(ctx, dy_col: Fp8Tensor, w_dtype: torch.dtype) -> torch.Tensor:
    """dW = dyᵀ·x: into the weight's fp32 ``main_grad`` by ``wgrad_into`` where it has one (megatron's
    convention for a fused WGrad: ``grad_added_to_main_grad`` set, an uninitialized ``grad`` its DDP
    hook does not add), else as a tensor of the weight's dtype."""
    weight = ctx.main_grad_of
    main = getattr(weight, "main_grad", None) if weight is not None else None
    if main is None:
        return fp8_gemm(dy_col, ctx.x_col, w_dtype, ctx.gemm)
    ctx.wgrad_into(dy_col, ctx.x_col, main)
    weight.grad_added_to_main_grad = True
    return torch.empty(weight.shape, dtype=w_dtype, device=main.device)


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    quantizer: Fp8Quantizer,
    cache: Optional[Fp8WeightCache] = None,
    gemm: GemmBackend = "auto",
    fprop: Optional[FpropGemm] = None,
    wgrad_into: Optional[WgradInto] = None,
) -> torch.Tensor:
    """y = x·Wᵀ + b with all three GEMMs in FP8 (see the module docstring).

    Args:
        x: [..., K] bf16 / fp16 / fp32; weight: [N, K] (the master weight, any float dtype);
        bias: optional [N], added in the output dtype.
        quantizer: who quantizes (reference or native kernels; same bytes).
        cache: reuse the weight's FP8 form until the weight changes; without one the weight is
            quantized on every call.
        gemm: ``auto`` (scaled_mm on Hopper, emulation elsewhere), ``scaled_mm`` or ``emulate``.
        fprop: another FProp GEMM kernel (same operands and bytes; DGrad and WGrad keep ``gemm``).
        wgrad_into: a WGrad that accumulates into the weight's fp32 ``main_grad`` (``WgradInto``);
            a weight without one takes ``gemm``'s dW.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K]; got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim {x.shape[-1]} does not match weight in_features {weight.shape[1]}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}]; got shape {tuple(bias.shape)}")
    if not x.is_contiguous():
        x = x.contiguous()
    fp8_weight = cache.get(weight, quantizer) if cache is not None else quantizer.quantize_weight(weight.detach())
    if not torch.is_grad_enabled():
        # No backward will run: skip the token-dim quantization WGrad would need.
        weight = weight.detach()
    return Fp8BlockLinear.apply(x, weight, bias, fp8_weight, quantizer, gemm, fprop, wgrad_into)


class Fp8Linear(torch.nn.Module):
    """``torch.nn.Linear`` whose GEMMs run through ``fp8_block_linear``; owns its weight cache."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        quantizer: Fp8Quantizer,
        gemm: GemmBackend = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        ref = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.weight = ref.weight
        self.bias = ref.bias
        self.quantizer = quantizer
        self.gemm = gemm
        self.cache = Fp8WeightCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, self.bias, quantizer=self.quantizer, cache=self.cache, gemm=self.gemm)
