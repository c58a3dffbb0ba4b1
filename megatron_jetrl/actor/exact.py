"""The trainer's side of the exact forward (``precision.exact``): megatron's layers computing with the
kernels vLLM computes with (``ops/exact.py``), and backward passes of the trainer's own math.

Each piece is an autograd function whose forward is the exact kernel and whose backward is an
ordinary gradient (the backward never has to match anything):

- ``ExactRMSNorm``: the norm module of every norm (input, pre-MLP, q/k, final); backward through
  torch's ``rms_norm`` recomputed from the saved input.
- ``exact_linear``: BF16 GEMM forward with vLLM's batch-invariant matmul (the LM head, and every
  linear of a BF16 layer); backward ``dx = dy·W``, ``dW = dyᵀ·x`` with torch's matmul.
- ``exact_attention``: FlashAttention over a paged view of the packed K/V with one split, as vLLM
  attends (with an FP8 KV cache: q, k, v quantized by the cache's scales, K/V written by vLLM's
  cache kernel, queries in the chunks vLLM schedules them in, ``precision.exact.FP8_KV_QUERY_ROWS``), the
  paged layout computed once per micro-batch; backward FlashAttention-2's (torch's, the trainer's
  usual kernel) from that forward's output and log-sum-exp, on the same BF16 q, k, v; with an FP8 KV
  cache on the values the cache holds (``fp8_cache_values``: the gradient at the point the forward
  computed, straight through the rounding, none where the scale clipped).
- FP8 linears keep ``fp8_block_linear`` with its FProp GEMM swapped for the one vLLM runs for the
  linear (``VllmKernels.fp8_gemm``: DeepGEMM or CUTLASS); DGrad and WGrad stay the trainer's.
- ``exact_rope``: forward with ``ops.exact.rope`` (the kernel vLLM's rotary embedding runs),
  backward through its eager reference recomputed from the saved input.
- ``ExactSwiGLU``: the MLP's activation module (chosen in the layer spec), forward ``ops.exact.silu_mul``
  (the kernel vLLM's SiLU·mul runs: megatron's eager SwiGLU bits), backward megatron's compiled SwiGLU
  gradient (the default mode's).
- ``ordered_tp_reduce``: above TP 2, the all-reduce (or, under sequence parallelism, the
  reduce-scatter) of a row-parallel linear's partial outputs, summed in the contract's fixed order
  (``ops.exact.ordered_sum``, as vLLM's TP all-reduce does in the exact mode); backward the
  gradient of megatron's mapping (the identity, or an all-gather).
- The residual adds and the embedding need nothing here: megatron computes them with the same eager
  ops as vLLM (the embedding's TP sum adds one rank's rows to zeros, exact in any order).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import swiglu_back
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_jetrl.ops.exact import (KvPages, VllmKernels, kv_pages, ordered_sum, paged_kv, query_segments, rope,
                                      rope_inv_freq, silu_mul, static_fp8_quant)
from megatron_jetrl.precision.exact import ExactUnavailable, fp8_kv_query_chunk
from megatron_jetrl.ops.rms_norm import rms_norm
from megatron_jetrl.precision.blockwise import E4M3_MAX


class _ExactRmsNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():  # torch's fused norm in the model's dtype: the default mode's norm (layers.RMSNorm)
            xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = F.rms_norm(xg, (x.shape[-1],), wg, ctx.eps)
            dx, dw = torch.autograd.grad(y, (xg, wg), dy)
        return dx, dw, None


class ExactRMSNorm(torch.nn.Module):
    """megatron norm module computing ``ops.rms_norm`` (the kernel vLLM's norms run in the exact
    mode). Weights in the model's dtype; under sequence parallelism the weight gradient is partial
    and marked for megatron's TP all-reduce, as in ``layers.RMSNorm``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ExactRmsNormFn.apply(x, self.weight, self.eps)


class _ExactRopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, positions, inv_freq):
        ctx.save_for_backward(positions, inv_freq)
        return rope(t, positions, inv_freq)

    @staticmethod
    def backward(ctx, dy):
        positions, inv_freq = ctx.saved_tensors
        # RoPE rotates each pair (x[j], x[j + D/2]) by the angle p * inv_freq[j]: its gradient is the rotation
        # by the opposite angle, which is rope at the negated positions (cos even, sin odd), one kernel
        return rope(dy.contiguous(), -positions, inv_freq), None, None


class _ExactSwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu_mul(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return swiglu_back(dy, x)


class ExactSwiGLU(torch.nn.Module):
    """megatron MLP activation module (``MLPSubmodules.activation_func``, called on the whole
    ``[gate | up]`` output of fc1 with ``use_te_activation_func``) computing ``silu(gate) * up`` with
    the kernel vLLM's SiLU·mul runs in the exact mode (``ops.exact.silu_mul``: megatron's eager SwiGLU
    bits, one kernel); backward megatron's compiled SwiGLU gradient (``swiglu_back``, the default mode's
    backward), one kernel instead of the eager ops' autograd (two multiplies, the SiLU gradient, a cat)."""

    def __init__(self, config, **_unused):
        super().__init__()
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ExactUnavailable("the exact forward's MLP activation is SwiGLU (silu, gated); this model's is "
                                   f"{getattr(config.activation_func, '__name__', config.activation_func)} "
                                   f"(gated: {config.gated_linear_unit})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ExactSwiGLUFn.apply(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        """None: the activation holds no state (megatron's MLP asks each of its modules for theirs
        when a checkpoint is saved or loaded)."""
        return {}


def exact_rope(t_THD: torch.Tensor, positions_T: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of t [T, H, D] at each token's position with the kernel vLLM's rotary
    embedding runs in the exact mode (``ops.exact.rope``), frequencies ``rope_inv_freq(D, base)``."""
    return _ExactRopeFn.apply(t_THD, positions_T, _inv_freq(t_THD.shape[-1], float(base), t_THD.device))


@functools.lru_cache(maxsize=8)
def _inv_freq(dim: int, base: float, device: torch.device) -> torch.Tensor:
    """``rope_inv_freq`` made once per head dim, base and device: every layer's q and k use it."""
    return rope_inv_freq(dim, base, device)


class _ExactLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gemm: Callable):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = gemm(x.reshape(-1, x.shape[-1]), weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias, kernels: VllmKernels) -> torch.Tensor:
    """``x · Wᵀ (+ b)`` with vLLM's batch-invariant BF16 GEMM forward, bias added after the GEMM as
    vLLM adds it (see the module docstring)."""
    return _ExactLinearFn.apply(x, weight, bias, kernels.bf16_gemm)


def parallel_linear_input(input, *, what: str, gradient_accumulation_fusion: bool, allreduce_dgrad: bool,
                          sequence_parallel: bool, tp_group):
    """The input of a column-parallel GEMM that replaces megatron's: all-gathered over TP under
    sequence parallelism (its gradient reduce-scattered), else marked for the all-reduce of its
    gradient; megatron's own autograd mappings. ``what`` names the linears in the error."""
    if gradient_accumulation_fusion:
        raise ValueError(f"{what} do not support gradient_accumulation_fusion; set it to False")
    if sequence_parallel:
        return gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    if allreduce_dgrad:
        return copy_to_tensor_model_parallel_region(input, group=tp_group)
    return input


def ordered_reduce(x: torch.Tensor, group, *, scatter: bool) -> torch.Tensor:
    """``ordered_tp_reduce``'s forward alone (no autograd): every rank's partial ``x`` gathered, then
    ``ordered_sum``; with ``scatter`` only this rank's chunk of the first dim, exchanged all-to-all."""
    tp, x = dist.get_world_size(group), x.contiguous()
    if scatter:  # rank r gets rows r of tp equal chunks: block i of the exchange is rank i's partial of them
        if x.shape[0] % tp:
            raise ValueError(f"ordered_tp_reduce: {x.shape[0]} rows do not split into {tp} sequence-parallel "
                             "chunks")
        parts = torch.empty_like(x)
        dist.all_to_all_single(parts, x, group=group)
        return ordered_sum(parts.view(tp, x.shape[0] // tp, *x.shape[1:]))
    parts = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    _all_gather_into(parts, x, group)
    return ordered_sum(parts.view(tp, *x.shape))


class _OrderedReduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter: bool):
        ctx.group, ctx.scatter = group, scatter
        return ordered_reduce(x, group, scatter=scatter)

    @staticmethod
    def backward(ctx, dy):
        if not ctx.scatter:  # an all-reduce's gradient: every rank's partial output got the whole sum
            return dy, None, None
        tp = dist.get_world_size(ctx.group)
        out = dy.new_empty((tp * dy.shape[0], *dy.shape[1:]))
        _all_gather_into(out, dy.contiguous(), ctx.group)
        return out, None, None


def _all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Every rank's ``x`` into ``out`` along the first dim, in rank order (``all_gather_single`` where
    torch has it, the older name before)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def ordered_tp_reduce(x: torch.Tensor, group, *, scatter: bool) -> torch.Tensor:
    """A row-parallel linear's TP reduction with the exact contract's order (``EXACT_KERNELS["tp_reduce"]``):
    every rank's partial output gathered and summed in rank order in fp32, rounded once, so that each
    element gets the bits vLLM's TP all-reduce gives it in the exact mode. ``scatter`` (sequence
    parallelism): each rank keeps its chunk of the first dim, as megatron's reduce-scatter does.
    Gradients are those of megatron's mappings."""
    return _OrderedReduceFn.apply(x, group, scatter)


def exact_forward_impl(kernels: VllmKernels, input, weight, bias=None, gradient_accumulation_fusion=False,
                       allreduce_dgrad=False, sequence_parallel=False, tp_group=None, **_unused):
    """A megatron parallel linear's ``_forward_impl`` (GEMM plus its TP communication) with the
    exact BF16 GEMM: for the LM head, which megatron builds itself (the actor sets this on the
    instance), and the linears of BF16 layers."""
    input = parallel_linear_input(input, what="exact linears",
                                  gradient_accumulation_fusion=gradient_accumulation_fusion,
                                  allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                  tp_group=tp_group)
    return exact_linear(input, weight, bias, kernels)


def bind_exact_forward(linear: torch.nn.Module, kernels: VllmKernels) -> None:
    """Make a megatron ``ColumnParallelLinear`` built by megatron (the LM head) compute its forward
    GEMM exactly: its ``_forward_impl`` becomes ``exact_forward_impl`` with these kernels."""
    linear._forward_impl = functools.partial(exact_forward_impl, kernels)


class _ExactAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, pages: KvPages, max_seqlen: int, scale: float, kernels: VllmKernels,
                backward_attention: Callable, kv_scales):
        if kv_scales is None:
            k_pages, v_pages, table, used = paged_kv(k, v, pages)
            out, lse = kernels.paged_attention(q.contiguous(), k_pages, v_pages, cu_seqlens, used, table, max_seqlen,
                                               scale)
        else:  # an FP8 KV cache: q, k, v quantized as vLLM quantizes them, with the scales it holds
            if not kernels.descale_query:
                raise ExactUnavailable("an FP8 KV cache in the exact mode needs FlashAttention that takes FP8 queries "
                                       "(version 3, Hopper); this one does not")
            q_scale, k_scale, v_scale = kv_scales[0:1], kv_scales[1:2], kv_scales[2:3]
            k_pages, v_pages = kernels.fp8_pages(k.contiguous(), v.contiguous(), pages, k_scale, v_scale)
            chunk = fp8_kv_query_chunk(q.shape[1], k.shape[1])  # the kernel vLLM's steps run (precision.exact)
            cu_q, used, table = query_segments(cu_seqlens, pages.seqused_k, pages.block_table, q.shape[0], chunk)
            out, lse = kernels.paged_attention(static_fp8_quant(q.contiguous(), q_scale), k_pages, v_pages, cu_q,
                                               used, table, max_seqlen, scale, descales=(q_scale, k_scale, v_scale),
                                               out_dtype=q.dtype, max_seqlen_q=min(chunk, max_seqlen))
        ctx.save_for_backward(q, k, v, cu_seqlens, kv_scales, out, lse)
        ctx.args = (max_seqlen, scale, backward_attention)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, cu_seqlens, kv_scales, out, lse = ctx.saved_tensors
        max_seqlen, scale, backward = ctx.args
        inside = None
        if kv_scales is not None:  # the gradient where the forward computed: at the cache's values
            (q, k, v), inside = zip(*(fp8_cache_values(t, kv_scales[i:i + 1]) for i, t in enumerate((q, k, v))),
                                    strict=True)
        grads = backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen, scale)
        if inside is not None:
            grads = tuple(torch.where(kept, g, g.new_zeros(())) for g, kept in zip(grads, inside, strict=True))
        return *grads, None, None, None, None, None, None, None


AttentionBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""``(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale) -> (dq, dk, dv)``: the exact attention's
gradient given its forward's output and log-sum-exp ([H, T] fp32)."""


def flash_attention_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen: int, scale: float):
    """FlashAttention-2's backward (torch's, the trainer's usual attention backward) from the exact
    forward's own output and log-sum-exp, instead of running a second forward to get them: causal
    within each packed sequence, grouped-query heads as they come."""
    rng, unused = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(), cu_seqlens,
        cu_seqlens, max_seqlen, max_seqlen, 0.0, True, rng, unused, scale=scale)
    return dq, dk, dv


def recompute_backward(attention: Callable) -> AttentionBackward:
    """The gradient of ``attention(q, k, v, cu_seqlens, max_seqlen, scale)`` computed afresh (a forward
    and its backward; the forward's own output is not used): where FlashAttention-2's backward does not
    run (off CUDA)."""
    def backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            return torch.autograd.grad(attention(qg, kg, vg, cu_seqlens, max_seqlen, scale), (qg, kg, vg), dout)

    return backward


def fp8_cache_values(t: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What an FP8 KV cache with this one fp32 ``scale`` holds of ``t``: its E4M3 codes
    (``static_fp8_quant``) times the scale, in t's dtype; and where t was inside the codes' range
    (``|t| <= 448 * scale``; outside, the forward saw the clamp, whose gradient is zero). On CUDA
    both from one compiled kernel (``cache_values_and_range``), instead of seven eager passes over
    fp32 copies of t."""
    codes = static_fp8_quant(t, scale)
    impl = _compiled_cache_values() if t.is_cuda else cache_values_and_range
    return impl(t, codes, scale)


def cache_values_and_range(t: torch.Tensor, codes: torch.Tensor,
                           scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_cache_values`` given t's codes, in eager torch ops: ``codes * scale`` in fp32 rounded once to
    t's dtype, and ``|t| <= 448 * scale`` in fp32 (both exact but for that one rounding)."""
    return (codes.float() * scale.float()).to(t.dtype), t.float().abs() <= E4M3_MAX * scale.float()


@functools.cache
def _compiled_cache_values():
    """``cache_values_and_range`` under torch.compile: one kernel (any token count: dynamic shapes),
    the same bits (one fp32 product rounded to t's dtype, exact comparisons), tested against it."""
    return torch.compile(cache_values_and_range, dynamic=True)


def exact_attention(q_THD, k_THD, v_THD, cu_seqlens: torch.Tensor, positions: torch.Tensor, max_seqlen: int,
                    scale: float, kernels: VllmKernels, backward_attention: AttentionBackward,
                    kv_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention within each packed sequence, forward as vLLM computes it (FlashAttention,
    paged K/V, one split); ``backward_attention`` gives the gradients (``flash_attention_backward`` from
    the forward's output on CUDA; straight through any quantization). q [T, Hq, D], k/v [T, Hkv, D] ->
    [T, Hq, D]. ``kv_scales`` ([3] fp32 on the device: q, k, v): the FP8 KV cache's scales the engine
    computes with; q, k and v then go through the cache's quantization."""
    cu32 = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    pages = micro_batch_pages(cu_seqlens, cu32, positions, int(max_seqlen))
    return _ExactAttentionFn.apply(q_THD, k_THD, v_THD, cu32, pages, int(max_seqlen), float(scale), kernels,
                                   backward_attention, kv_scales)


def micro_batch_pages(cu_seqlens: torch.Tensor, cu32: torch.Tensor, positions: torch.Tensor,
                      max_seqlen: int) -> KvPages:
    """The packed batch's paged layout (``ops.exact.kv_pages``), computed by the micro-batch's first
    attention layer and kept on ``cu_seqlens`` (the tensor megatron hands every layer, as
    ``attach_packed_positions`` keeps the positions) for the others: a dozen small kernels once per
    micro-batch instead of once per layer."""
    kept = getattr(cu_seqlens, "jetrl_kv_pages", None)
    if kept is None or kept[0] != max_seqlen:
        kept = (max_seqlen, kv_pages(cu32, positions, max_seqlen))
        cu_seqlens.jetrl_kv_pages = kept
    return kept[1]
