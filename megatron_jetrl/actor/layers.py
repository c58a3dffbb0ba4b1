"""The actor's layer spec: megatron-core's local (no Transformer Engine) GPT layer with two swaps.

- ``PackedCoreAttention`` replaces the local ``DotProductAttention``, which materialises the
  [s, s] score matrix and rejects packed sequences. It runs causal attention per sequence of a
  packed ``thd`` batch: flash attention varlen (``torch.nn.attention.varlen``) on CUDA in
  BF16/FP16, and a per-sequence ``scaled_dot_product_attention`` otherwise (the reference). With
  ``actor.attention_impl=te`` (``TE_ATTENTION_ATTR``) it calls Transformer Engine's
  ``DotProductAttention`` on the same ``thd`` layout instead (cuDNN's fused attention on Hopper,
  the kernels TE's own layer spec runs), kept outside the module tree so that the checkpoint keys
  stay the native layers' (a TE module would add its ``_extra_state``).
- RoPE over packed sequences without a host sync: megatron's unfused ``thd`` RoPE reads the
  sequence lengths to the host (``.tolist()``) at every call, twice a layer, and the CPU waits
  for the GPU each time. ``apply_rotary_pos_emb_packed`` gathers the same frequency rows by each
  token's position in its sequence, computed on the GPU once per micro-batch
  (``attach_packed_positions``); the values are megatron's, bit for bit.
  megatron's attention calls its module-level ``apply_rotary_pos_emb``, so the spec points that
  name at this function (``use_sync_free_packed_rope``); every other case goes to megatron's.
  With ``actor.elementwise_impl=compiled`` (``COMPILED_ROPE_ATTR``) the rotation runs as one
  torch.compile'd kernel forward and one backward instead of megatron's ~10 eager ones per tensor,
  with megatron's roundings (``emulate_precision_casts``), so its bits are megatron's; the cos/sin
  rows are made once per micro-batch and read by every layer's q and k.
- ``Fp8ColumnParallelLinear`` / ``Fp8RowParallelLinear`` replace qkv, proj, fc1 and fc2 in the
  ``fp8`` precision mode. They keep megatron's parameters, sharding and checkpoint keys and change
  only the GEMMs: ``fp8_block_linear`` (FProp, DGrad and WGrad in FP8, 128x128 weight blocks,
  1x128 activation and gradient groups). Tensor-parallel communication is megatron's own
  autograd mappings around it: all-gather of the input / reduce-scatter of its gradient under
  sequence parallelism, otherwise all-reduce of the input gradient. The actor configures each
  linear after construction (quantizer, GEMM backend, and whether its layer runs in FP8), since
  the recipe keeps the first/last N layers in BF16 and a linear does not know its layer number.
- The exact mode (``precision.exact``, ``actor/exact.py``), one layer spec built with vLLM's kernels
  (ModuleSpec params): the norms become ``ExactRMSNorm``, the linears of BF16 layers and the LM head
  compute their forward GEMM with vLLM's batch-invariant matmul, FP8 FProp with the block-FP8 GEMM
  vLLM runs for the linear, attention with vLLM's FlashAttention over paged K/V, and RoPE with
  ``ops.exact.rope`` (``actor.exact.exact_rope``); above TP 2 the row-parallel linears reduce their
  partial outputs in the contract's order (``actor.exact.ordered_tp_reduce``). The LM head, which
  megatron's GPTModel builds itself, gets its exact GEMM in ``build_gpt``.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional

import torch
import torch.nn.functional as F
import megatron.core.transformer.attention as megatron_attention
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as megatron_apply_rotary_pos_emb
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.nn.attention import varlen

from megatron_jetrl.actor.exact import (ExactRMSNorm, ExactSwiGLU, exact_attention, exact_forward_impl, exact_rope,
                                        flash_attention_backward, ordered_tp_reduce, parallel_linear_input,
                                        recompute_backward)
from megatron_jetrl.ops.exact import VllmKernels
from megatron_jetrl.precision.exact import ExactUnavailable, ordered_tp_reduction
from megatron_jetrl.precision import Fp8Quantizer, Fp8Weight, Fp8WeightCache, fp8_block_linear
from megatron_jetrl.precision.kv_cache import KvAmaxObserver
from megatron_jetrl.precision.gemm import GemmBackend
from megatron_jetrl.precision.linear import WgradInto

try:  # megatron's RoPE on [s, b, h, d], private: a megatron without it keeps its own thd path
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
except ImportError:  # pragma: no cover - megatron-core 0.16 has it
    _apply_rotary_pos_emb_bshd = None

_VARLEN_PARAMS = inspect.signature(varlen.varlen_attn).parameters
_VARLEN_CAUSAL = {"window_size": (-1, 0)} if "window_size" in _VARLEN_PARAMS else {"is_causal": True}
"""torch 2.10 spelled causal as ``is_causal=True``; later releases as ``window_size=(-1, 0)``."""
_VARLEN_GQA = "enable_gqa" in _VARLEN_PARAMS


def packed_causal_attention(
    q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch; q [T, Hq, D], k/v [T, Hkv, D]
    (Hkv divides Hq, grouped-query attention) -> [T, Hq, D]."""
    if q_THD.is_cuda and q_THD.dtype in (torch.bfloat16, torch.float16):
        k, v = k_THD, v_THD
        gqa = {}
        if k.shape[1] != q_THD.shape[1]:
            if _VARLEN_GQA:
                gqa = {"enable_gqa": True}
            else:
                rep = q_THD.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
        return varlen.varlen_attn(q_THD, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, **_VARLEN_CAUSAL, **gqa)
    return reference_packed_causal_attention(q_THD, k_THD, v_THD, cu_seqlens, scale)


def te_packed_causal_attention(config, layer_number: int, scale: float):
    """``packed_causal_attention``'s contract on Transformer Engine's ``DotProductAttention`` (``thd``,
    causal within each sequence, this TP rank's heads): a function of (q [T, Hq, D], k/v [T, Hkv, D],
    cu_seqlens, max_seqlen) -> [T, Hq, D]. TE picks its backend per call; on Hopper in BF16/FP16 that is
    cuDNN's fused attention (``tests/gpu/test_te_backend.py`` checks it)."""
    from transformer_engine.pytorch import DotProductAttention

    tp = config.tensor_model_parallel_size
    heads = config.num_attention_heads // tp
    groups = (config.num_query_groups or config.num_attention_heads) // tp
    attention = DotProductAttention(heads, config.kv_channels, num_gqa_groups=groups, qkv_format="thd",
                                    attn_mask_type="padding_causal", softmax_scale=scale, layer_number=layer_number)

    def attend(q_THD, k_THD, v_THD, cu_seqlens, max_seqlen):
        cu = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
        out = attention(q_THD, k_THD, v_THD, qkv_format="thd", attn_mask_type="padding_causal", cu_seqlens_q=cu,
                        cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        return out.reshape(q_THD.shape[0], q_THD.shape[1], -1)

    return attend


def packed_positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each packed token's position in its own sequence ([T] int64), computed where ``cu_seqlens``
    lives, without reading it on the host."""
    index = torch.arange(tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(cu_seqlens[1:], index, right=True)
    return (index - cu_seqlens[:-1][sequence]).long()


def attach_packed_positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Compute each token's position once per micro-batch and keep it on ``cu_seqlens``, the tensor
    megatron hands to every layer's RoPE: the layers read it instead of recomputing it for q and k
    (five small kernels each, twice a layer). Returns ``cu_seqlens``."""
    cu_seqlens.jetrl_positions = packed_positions(cu_seqlens, tokens)
    return cu_seqlens


def apply_rotary_pos_emb_packed(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """megatron's ``apply_rotary_pos_emb`` (same signature and values) whose unfused ``thd`` case
    (t [T, H, D], freqs [max_s, 1, 1, D]) gathers each token's frequency row instead of splitting
    the batch by host-read lengths. Rows as megatron picks them: the token's position in its
    sequence, or its index in the batch when ``freqs`` covers the whole batch. Fused RoPE, context
    parallelism and the non-packed case are megatron's own."""
    base = getattr(config, EXACT_ATTR, None)
    if base is not None:
        if cu_seqlens is None or mscale != 1.0:
            raise RuntimeError("the exact forward's RoPE takes packed sequences without mscale")
        return exact_rope(t, _positions(cu_seqlens, t.shape[0], t.device), base)
    if cu_seqlens is None or config.apply_rope_fusion or cp_group is None or cp_group.size() != 1:
        return megatron_apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                                             cp_group=cp_group)
    tokens = t.shape[0]
    if freqs.size(0) == tokens:
        rows = torch.arange(tokens, device=freqs.device)
    else:
        rows = _positions(cu_seqlens, tokens, freqs.device)
    if (getattr(config, COMPILED_ROPE_ATTR, False) and not config.rotary_interleaved
            and not config.multi_latent_attention and freqs.shape[-1] == t.shape[-1]):
        cos_T1D, sin_T1D = _cos_sin(rows, freqs, mscale, t.dtype)
        return compiled_rope()(t, cos_T1D, sin_T1D)
    return _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[rows], rotary_interleaved=config.rotary_interleaved,
                                      multi_latent_attention=config.multi_latent_attention, mscale=mscale).squeeze(1)


EXACT_ATTR = "jetrl_exact_rope_base"
"""Set on the TransformerConfig of an exact-mode actor to the model's rotary base (a float; None
otherwise): RoPE goes through ``ops.exact.rope`` with it."""

COMPILED_ROPE_ATTR = "jetrl_compiled_rope"
"""Set on the TransformerConfig: True when packed RoPE runs compiled (``actor.elementwise_impl``)."""

TE_ATTENTION_ATTR = "jetrl_te_attention"
"""Set on the TransformerConfig: True when the packed attention is Transformer Engine's
(``actor.attention_impl=te``)."""


def rope_rotate(t_THD: torch.Tensor, cos_T1D: torch.Tensor, sin_T1D: torch.Tensor) -> torch.Tensor:
    """megatron's non-interleaved RoPE over the whole head dim with its cos/sin given (t's dtype):
    ``t * cos + rotate_half(t) * sin``, the ops of ``_apply_rotary_pos_emb_bshd`` in their order, so
    eager torch rounds them as megatron does. The reference of ``compiled_rope``."""
    x1, x2 = torch.chunk(t_THD, 2, dim=-1)
    return t_THD * cos_T1D + torch.cat((-x2, x1), dim=-1) * sin_T1D


@functools.cache
def compiled_rope():
    """``rope_rotate`` under torch.compile: one kernel forward, one backward. Dynamic shapes (the
    token count changes with every micro-batch); ``emulate_precision_casts`` rounds every op's result
    to t's dtype as eager torch does (Inductor otherwise keeps fp32 between ops), so the values and
    gradients are ``rope_rotate``'s bit for bit."""
    return torch.compile(rope_rotate, dynamic=True, options={"emulate_precision_casts": True})


def _cos_sin(rows: torch.Tensor, freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """cos and sin of each token's angles ([T, 1, D], ``dtype``), by megatron's formula
    (``(cos(freqs) * mscale).to(dtype)``), kept on ``rows``: the micro-batch's positions, which every
    layer's q and k RoPE read with the same ``freqs``."""
    cached = getattr(rows, "jetrl_cos_sin", None)
    if cached is not None and cached[0] is freqs and cached[1] == (mscale, dtype):
        return cached[2]
    angles = freqs[rows][:, 0]
    pair = ((torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype))
    rows.jetrl_cos_sin = (freqs, (mscale, dtype), pair)
    return pair


def _positions(cu_seqlens: torch.Tensor, tokens: int, device: torch.device) -> torch.Tensor:
    """Each packed token's position: the one ``attach_packed_positions`` computed for the micro-batch,
    or computed now."""
    rows = getattr(cu_seqlens, "jetrl_positions", None)
    if rows is None or rows.numel() != tokens or rows.device != device:
        rows = packed_positions(cu_seqlens.to(device), tokens)
    return rows


def use_sync_free_packed_rope() -> None:
    """Point megatron's attention at ``apply_rotary_pos_emb_packed`` (idempotent; a megatron
    without the private helper it needs keeps its own)."""
    if _apply_rotary_pos_emb_bshd is not None:
        megatron_attention.apply_rotary_pos_emb = apply_rotary_pos_emb_packed


def reference_packed_causal_attention(q_THD, k_THD, v_THD, cu_seqlens, scale):
    """Per-sequence ``scaled_dot_product_attention`` (any device and dtype)."""
    rep = q_THD.shape[1] // k_THD.shape[1]
    out = torch.empty_like(q_THD)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        q = q_THD[a:b].transpose(0, 1)
        k = k_THD[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)
        v = v_THD[a:b].transpose(0, 1).repeat_interleave(rep, dim=0)
        out[a:b] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
    return out


class PackedCoreAttention(MegatronModule):
    """megatron-core core-attention module for causal self-attention over packed sequences.

    Takes megatron's ``thd`` layout ([T, H, D] with ``packed_seq_params``) or ``sbhd`` ([S, B, H, D],
    each batch row one sequence). No dropout (RL fine-tuning runs without), no attention mask
    other than causal-within-sequence, no context parallelism.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 exact_kernels: Optional[VllmKernels] = None, **_unused):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCoreAttention computes causal attention only; got {attn_mask_type}")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("PackedCoreAttention has no dropout; set attention_dropout=0")
        if config.context_parallel_size > 1:
            raise ValueError("PackedCoreAttention does not support context parallelism")
        self.layer_number = layer_number
        self.kv_observer: Optional[KvAmaxObserver] = None
        """Set by the actor for a pass that calibrates FP8 KV-cache scales (q, k, v arrive here
        after qk-norm and RoPE, as a KV cache stores them)."""
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.exact_kernels = exact_kernels
        """The exact layer spec's (``local_layer_spec``): attention forward with vLLM's FlashAttention call."""
        self.exact_kv_scales: Optional[torch.Tensor] = None
        """Set by an exact-mode actor whose engine keeps an FP8 KV cache: this layer's (q, k, v)
        scales ([3] fp32, on the device) the engine computes with now."""
        self.te_attention = (te_packed_causal_attention(config, layer_number, self.softmax_scale)
                             if getattr(config, TE_ATTENTION_ATTR, False) else None)
        """Transformer Engine's attention (``actor.attention_impl=te``): a plain function, not a submodule."""

    def _attend(self, q, k, v, cu_seqlens, max_seqlen):
        if self.exact_kernels is None and self.te_attention is not None:
            return self.te_attention(q, k, v, cu_seqlens, max_seqlen)
        if self.exact_kernels is None:
            return packed_causal_attention(q, k, v, cu_seqlens, max_seqlen, self.softmax_scale)
        positions = _positions(cu_seqlens, q.shape[0], q.device)
        backward = flash_attention_backward if q.is_cuda else recompute_backward(packed_causal_attention)
        return exact_attention(q, k, v, cu_seqlens, positions, max_seqlen, self.softmax_scale, self.exact_kernels,
                               backward, self.exact_kv_scales)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not take an attention bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed sequences must use the 'thd' format; got {packed_seq_params.qkv_format!r}")
            if self.kv_observer is not None:
                self.kv_observer.observe(self.layer_number - 1, query, key, value)
            out = self._attend(query, key, value, packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q)
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[:2]
        flat = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (query, key, value)]
        if self.kv_observer is not None:
            self.kv_observer.observe(self.layer_number - 1, *flat)
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        out = self._attend(*flat, cu, s)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()


class _Fp8LinearMixin:
    """Replaces megatron's ``_forward_impl`` (the GEMM plus its TP communication): FP8 GEMMs in an FP8
    layer, megatron's BF16 GEMM otherwise, and in the exact mode (``exact_kernels`` set) vLLM's
    FProp kernels (its block-FP8 GEMM, DeepGEMM or CUTLASS, or its batch-invariant BF16 matmul)."""

    fp8_quantizer: Optional[Fp8Quantizer] = None
    fp8_gemm: GemmBackend = "auto"
    fp8_enabled: bool = True
    exact_kernels: Optional[VllmKernels] = None
    fp8_wgrad_into: Optional[WgradInto] = None

    def __init__(self, *args, exact_kernels: Optional[VllmKernels] = None, **kwargs):
        """megatron's parallel linear; ``exact_kernels``: given by the exact layer spec
        (``local_layer_spec``'s ModuleSpec params)."""
        super().__init__(*args, **kwargs)
        self.exact_kernels = exact_kernels

    def configure_fp8(self, *, quantizer: Fp8Quantizer, gemm: GemmBackend, enabled: bool,
                      wgrad_into: Optional[WgradInto] = None) -> None:
        self.fp8_quantizer = quantizer
        self.fp8_gemm = gemm
        self.fp8_enabled = enabled
        self.fp8_cache = Fp8WeightCache()
        self.fp8_wgrad_into = wgrad_into

    def fp8_weight(self) -> Optional[Fp8Weight]:
        """This rank's shard of the weight as the FProp GEMM reads it; None in a BF16 layer."""
        if not self.fp8_enabled:
            return None
        return self.fp8_cache.get(self.weight, self.fp8_quantizer)

    def _forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                      sequence_parallel=False, tp_group=None, **_unused):
        if not self.fp8_enabled and self.exact_kernels is not None:
            return exact_forward_impl(self.exact_kernels, input, weight, bias, gradient_accumulation_fusion,
                                      allreduce_dgrad, sequence_parallel, tp_group)
        if not self.fp8_enabled:
            return super()._forward_impl(input=input, weight=weight, bias=bias,
                                         gradient_accumulation_fusion=gradient_accumulation_fusion,
                                         allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                         tp_group=tp_group, **_unused)
        if self.fp8_quantizer is None:
            raise RuntimeError(f"{type(self).__name__} was not configured; the actor calls configure_fp8()")
        input = parallel_linear_input(input, what="FP8 linears",
                                      gradient_accumulation_fusion=gradient_accumulation_fusion,
                                      allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                                      tp_group=tp_group)
        fprop = self.exact_kernels.fp8_gemm if self.exact_kernels is not None else None
        return fp8_block_linear(input, weight, bias, quantizer=self.fp8_quantizer, cache=self.fp8_cache,
                                gemm=self.fp8_gemm, fprop=fprop, wgrad_into=self.fp8_wgrad_into)


class Fp8ColumnParallelLinear(_Fp8LinearMixin, ColumnParallelLinear):
    pass


class Fp8RowParallelLinear(_Fp8LinearMixin, RowParallelLinear):
    def forward(self, input_):
        """megatron's forward; in the exact mode above TP 2 its partial outputs are reduced in the exact
        contract's order (``actor.exact.ordered_tp_reduce``) instead of by NCCL's all-reduce or
        reduce-scatter, whose order is not vLLM's."""
        if self.exact_kernels is None or not ordered_tp_reduction(self.tp_group.size()):
            return super().forward(input_)
        if not self.input_is_parallel or self.explicit_expert_comm:
            raise ExactUnavailable("precision.exact: a row-parallel linear with an unsplit input or expert "
                                   "communication has no ordered TP reduction")
        output_parallel = self._forward_impl(input=input_, weight=self.weight, bias=None,
                                             gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                             allreduce_dgrad=False, sequence_parallel=False, tp_group=None)
        output = ordered_tp_reduce(output_parallel, self.tp_group, scatter=self.sequence_parallel)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as a megatron norm module, replacing megatron's ``WrappedTorchNorm``, which
    refuses sequence parallelism and creates fp32 weights (torch then falls back from its fused
    kernel for BF16 inputs). Weights here are in the model's dtype. Under sequence parallelism
    each TP rank normalises its own tokens, so the weight gradient is partial: the weight is
    marked ``sequence_parallel`` and megatron all-reduces it over TP (q/k norms are reduced by
    megatron in any case, since each TP rank sees only its heads)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def local_layer_spec(*, qk_layernorm: bool, fp8: bool, exact: bool = False,
                     exact_kernels: Optional[VllmKernels] = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec with ``PackedCoreAttention``, ``RMSNorm``, the sync-free
    packed RoPE and, with ``fp8``, the FP8 parallel linears; with ``exact``, the exact layer:
    ``ExactRMSNorm``, ``ExactSwiGLU``, and the project's parallel linears and attention built with
    vLLM's kernels (``exact_kernels``, ModuleSpec params: megatron hands them to the constructors).
    Without the kernels (a CPU) the exact modules are built without them, and ``check_exact`` refuses
    such a model."""
    use_sync_free_packed_rope()
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    attn = spec.submodules.self_attention.submodules
    mlp = spec.submodules.mlp.submodules
    kernels = {"exact_kernels": exact_kernels} if exact else {}
    attn.core_attention = ModuleSpec(module=PackedCoreAttention, params=kernels)
    norm = norm_class(exact)
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    if qk_layernorm:
        attn.q_layernorm = norm
        attn.k_layernorm = norm
    if exact:
        mlp.activation_func = ExactSwiGLU  # called on fc1's whole [gate | up] (use_te_activation_func, build.py)
    if fp8 or exact:
        attn.linear_qkv = ModuleSpec(module=Fp8ColumnParallelLinear, params=kernels)
        attn.linear_proj = ModuleSpec(module=Fp8RowParallelLinear, params=kernels)
        mlp.linear_fc1 = ModuleSpec(module=Fp8ColumnParallelLinear, params=kernels)
        mlp.linear_fc2 = ModuleSpec(module=Fp8RowParallelLinear, params=kernels)
    return spec


def norm_class(exact: bool) -> type:
    """The norm module of every norm of the model (the final one too)."""
    return ExactRMSNorm if exact else RMSNorm
