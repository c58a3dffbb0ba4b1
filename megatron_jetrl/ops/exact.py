"""The kernels of the exact forward (``precision.exact``): the ops whose results for a token depend
only on that token's inputs (batch invariance), called by both the trainer and vLLM, so that the
rollout's logprob of every token equals the trainer's bit for bit.

Two kinds, one list (``precision/exact.py``: ``EXACT_KERNELS``, the contract these kernels implement):

- **defined here** and run by vLLM through out-of-tree custom ops (``rollout/vllm_exact.py``) and by
  the trainer's layers (``actor/exact.py``):
  ``rms_norm`` (``ops/rms_norm.py``: a kernel with a fixed reduction order; the residual add before it is a
  plain BF16 add on both sides, in vLLM done by the norm's kernel: ``add_rms_norm``), ``silu_mul``
  (``silu(gate) * up`` with megatron's SwiGLU rounding), ``rope`` (megatron's rotary formula and
  frequencies, computed from each token's position) and ``static_fp8_quant`` (with an FP8 KV cache:
  the query's quantization by its per-layer scale). Each of the last three is one CUDA kernel
  (``csrc/rope_cuda.cu``, ``csrc/elementwise_cuda.cu``) beside its eager torch reference
  (``*_reference``), which megatron's own eager ops equal; the GPU tests compare them bit for bit.
  Each op is a ``torch.library`` custom op (``jetrl::...``), opaque to torch.compile, so vLLM's
  compiled graph cannot fuse it into something that rounds differently.
- **vLLM's own batch-invariant kernels** (what its layers call with ``VLLM_BATCH_INVARIANT=1``),
  which the trainer's forward calls too (``VllmKernels``): the BF16 GEMM (the LM head, and the
  linears of BF16 layers: vLLM's Triton persistent matmul, fixed tiles), the block-FP8 GEMM that
  vLLM picked for the linear (DeepGEMM's ``fp8_gemm_nt`` as vLLM's ``DeepGemmFp8BlockScaledMMKernel``
  calls it, or CUTLASS as its ``CutlassFp8BlockScaledMMKernel`` does; both give a row the same bits
  whatever the number of rows: neither splits K, and every tile shape sums a row's K blocks in the
  same order with the same promotion, ``tests/gpu/test_exact_kernels.py``), FlashAttention with one
  KV split over a paged KV cache (the call vLLM's FlashAttention backend makes for prefill and
  decode; with an FP8 KV cache, K and V written into FP8 pages by vLLM's own cache kernel with the
  layer's scales, and the scales passed as FlashAttention's descales) and the sampled token's
  logprob (the Triton kernel of vLLM's V2 model runner, which its sampler runs for
  ``raw_logprobs``: max and log-sum-exp of the BF16 logits, read once).

Backward passes are the trainer's own math (``actor/exact.py``): only forwards must agree.

Shapes: T tokens, H heads, D head dim; a packed batch is [T, H, D] with ``cu_seqlens`` [S + 1].
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from megatron_jetrl.ops.extension import load_extension
from megatron_jetrl.ops.quantize import quantize_rows, rows_scale_layout
from megatron_jetrl.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_reference
from megatron_jetrl.precision import E4M3_MAX, GROUP_1x128, Fp8Tensor, quantize_fp8_blockwise
from megatron_jetrl.precision.exact import KV_PAGE, ExactUnavailable

# ---------------------------------------------------------------- defined here (both homes)

def silu_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` (last dim), each op rounded to x's dtype: the
    value megatron's SwiGLU computes (``F.silu(x_glu) * x_linear``, eager)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu_mul_reference``'s values; on CUDA in one kernel (csrc/elementwise_cuda.cu: torch's silu
    and mul roundings, the same expf; equal bit for bit, tested), else the reference. A new
    contiguous [..., I] for x [..., 2I]."""
    if not x.is_cuda:
        return silu_mul_reference(x)
    y_RI = load_extension().silu_mul(x.reshape(-1, x.shape[-1]))
    return y_RI.view(*x.shape[:-1], x.shape[-1] // 2)


def _rows_quantized_reference(y_RH: torch.Tensor, pow2_scales: bool, quant_eps: float,
                              m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``y``'s 1x128 codes and scale_inv (``precision.quantize_fp8_blockwise``) in the layout the
    engine's block-FP8 GEMM reads (``ops.quantize.rows_scale_layout``)."""
    q, s = quantize_fp8_blockwise(y_RH, GROUP_1x128, pow2_scales=pow2_scales, eps=quant_eps)
    return q, rows_scale_layout(y_RH, m_align).copy_(s)


def rms_norm_quant_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                             *, pow2_scales: bool, quant_eps: float, m_align: int
                             ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The unfused ops in eager torch: (with a residual, the BF16 add first) ``rms_norm_reference``,
    then the 1x128 quantization of its output. x (and residual) [R, H] -> (q [R, H] e4m3,
    scale_inv [R, H/128] in ``rows_scale_layout``, x + residual or None)."""
    total = None if residual is None else x + residual
    y = rms_norm_reference(x if total is None else total, weight, eps)
    return (*_rows_quantized_reference(y, pow2_scales, quant_eps, m_align), total)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None, *,
                   pow2_scales: bool, quant_eps: float, m_align: int
                   ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``rms_norm_quant_reference``'s bytes: on CUDA one kernel (csrc/rms_norm_cuda.cu: the norm's
    own arithmetic, then each 1x128 group encoded as the quantization kernel encodes it; equal bit
    for bit, tested) instead of a norm and a quantization; elsewhere the two kernels in turn. What
    the engine runs before an FP8 linear in the exact mode (``rollout.vllm_exact``'s fusion pass)."""
    if not x.is_cuda:
        y, total = (rms_norm(x, weight, eps), None) if residual is None else add_rms_norm(x, residual, weight, eps)
        return (*quantize_rows(y, pow2_scales=pow2_scales, eps=quant_eps, m_align=m_align), total)
    return load_extension().rms_norm_quant(x, residual, weight, float(eps), bool(pow2_scales), float(quant_eps),
                                           int(m_align))


def silu_mul_quant_reference(x: torch.Tensor, *, pow2_scales: bool, quant_eps: float,
                             m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul_reference`` then the 1x128 quantization of its output, in eager torch: x [R, 2I]
    -> (q [R, I] e4m3, scale_inv [R, I/128] in ``rows_scale_layout``)."""
    return _rows_quantized_reference(silu_mul_reference(x), pow2_scales, quant_eps, m_align)


def silu_mul_quant(x: torch.Tensor, *, pow2_scales: bool, quant_eps: float,
                   m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_mul_quant_reference``'s bytes: on CUDA one kernel (csrc/elementwise_cuda.cu; equal bit
    for bit, tested), elsewhere ``silu_mul`` and the quantization in turn."""
    if not x.is_cuda:
        return quantize_rows(silu_mul(x), pow2_scales=pow2_scales, eps=quant_eps, m_align=m_align)
    return load_extension().silu_mul_quant(x, bool(pow2_scales), float(quant_eps), int(m_align))


def static_fp8_quant_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``x`` with one fp32 scale (an FP8 KV cache's query quantization): ``x / scale``
    in fp32, clamped to ±448, rounded to nearest even; eager torch ops (an IEEE division), any shape."""
    return (x.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def static_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``static_fp8_quant_reference``'s codes; on CUDA in one kernel (csrc/elementwise_cuda.cu: the
    division, torch's clamp and torch's own e4m3 conversion; equal bit for bit, tested) instead of
    four eager ones, else the reference."""
    if not x.is_cuda:
        return static_fp8_quant_reference(x, scale)
    return load_extension().static_fp8_quant(x.contiguous(), scale.float().reshape(-1))


def ordered_sum_reference(parts: torch.Tensor) -> torch.Tensor:
    """The exact mode's TP reduction (``EXACT_KERNELS["tp_reduce"]``): ``parts`` [tp, ...], every TP
    rank's partial result in rank order, summed in that order in fp32 and rounded once to their dtype,
    in eager torch ops. Elementwise, so an element's bits depend on nothing but its tp partial values;
    with two parts the bits of one add of the two (torch rounds the fp32 sum)."""
    acc = parts[0].to(torch.float32, copy=True)
    for part in parts[1:]:
        acc.add_(part)
    return acc.to(parts.dtype)


def ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """``ordered_sum_reference``'s values; on CUDA in one kernel (csrc/elementwise_cuda.cu, equal bit
    for bit, tested) instead of tp + 1, else the reference. Both sides of the exact rollout call it."""
    if not parts.is_cuda:
        return ordered_sum_reference(parts)
    return load_extension().ordered_sum(parts.contiguous())


def rope_inv_freq(rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """megatron's ``RotaryEmbedding.inv_freq`` (fp32, computed on ``device``)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_reference(t_THD: torch.Tensor, positions_T: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (non-interleaved halves, the whole head dim rotated) of ``t`` [T, H, D] at
    each token's position, as eager torch ops: megatron's formula, bit for bit
    (``_apply_rotary_pos_emb_bshd`` with its ``outer(arange, inv_freq)`` frequencies gathered by
    position): cos and sin in fp32, rounded to t's dtype, then ``t * cos + rotate_half(t) * sin``
    with each op rounded. ``inv_freq`` [D / 2] fp32 is ``rope_inv_freq``'s."""
    if t_THD.dim() != 3:
        raise ValueError(f"rope takes [tokens, heads, head_dim]; got shape {tuple(t_THD.shape)}")
    freqs = positions_T.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = torch.cos(emb).to(t_THD.dtype), torch.sin(emb).to(t_THD.dtype)
    x1, x2 = t_THD.chunk(2, dim=-1)
    return t_THD * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope(t_THD: torch.Tensor, positions_T: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``rope_reference``'s values in one kernel on CUDA (csrc/rope_cuda.cu: the same roundings, and
    the CUDA math library's cosf / sinf, which torch's cos / sin call; equal bit for bit, tested);
    a new contiguous [T, H, D]. Elsewhere (the CPU, where no exact forward runs) the reference.
    The eager reference costs some 16 kernels a call, which a decode step pays twice a layer."""
    if not t_THD.is_cuda:
        return rope_reference(t_THD, positions_T, inv_freq)
    return load_extension().rope(t_THD, positions_T, inv_freq)


def _quantized_like(x_RK: torch.Tensor, k: int, m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty codes [R, k] e4m3 and scale_inv in ``rows_scale_layout``: a fused quantizing op's outputs."""
    rows = x_RK.shape[0]
    return (torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x_RK.device),
            rows_scale_layout(x_RK.new_empty((rows, k)), m_align))


def qk_norm_rope_reference(positions_T: torch.Tensor, q_TX: torch.Tensor, k_TX: torch.Tensor, wq: torch.Tensor,
                           wk: torch.Tensor, eps_q: float, eps_k: float,
                           inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q's and k's heads (q [T, Hq * D], k [T, Hk * D], D = 2 * len(inv_freq)) each normed by
    ``rms_norm_reference`` (weights wq / wk [D]), then rotated by ``rope_reference``: eager torch, any
    device. Returns new contiguous [T, Hq * D], [T, Hk * D]."""
    d = 2 * inv_freq.numel()
    out = []
    for x, w, eps in ((q_TX, wq, eps_q), (k_TX, wk, eps_k)):
        normed = rms_norm_reference(x.reshape(x.shape[0], -1, d), w, eps)
        out.append(rope_reference(normed, positions_T, inv_freq).reshape(x.shape))
    return out[0], out[1]


def qk_norm_rope(positions_T: torch.Tensor, q_TX: torch.Tensor, k_TX: torch.Tensor, wq: torch.Tensor,
                 wk: torch.Tensor, eps_q: float, eps_k: float,
                 inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``qk_norm_rope_reference``'s values: on CUDA one kernel for both (csrc/rms_norm_cuda.cu: each head
    normed by the norm's own arithmetic, then rotated by rope's; equal bit for bit, tested) instead of
    two norms, the copies of q and k they read and two rotations; elsewhere ``rms_norm`` and ``rope`` in
    turn. q and k may be column slices of one tensor (rows of any stride). What the engine runs for its
    q/k norms and rotary embedding in the exact mode (``rollout.vllm_fusion``)."""
    if not q_TX.is_cuda:
        d = 2 * inv_freq.numel()
        return tuple(rope(rms_norm(x.reshape(x.shape[0], -1, d), w, eps), positions_T, inv_freq).reshape(x.shape)
                     for x, w, eps in ((q_TX, wq, eps_q), (k_TX, wk, eps_k)))
    return load_extension().qk_norm_rope(q_TX, k_TX, wq, wk, float(eps_q), float(eps_k), positions_T, inv_freq)


@functools.cache
def custom_ops() -> Any:
    """``torch.ops.jetrl`` with the exact ops registered (once per process): ``rms_norm(x, w, eps)``,
    ``add_rms_norm(x, residual, w, eps) -> (normed, x + residual)``, ``silu_mul(x)`` and
    ``rope(positions, q, k, inv_freq) -> (q, k)`` (q, k [T, H*D] as vLLM passes them: rows of any
    stride, each row contiguous; new contiguous outputs) and ``static_fp8_quant(x, scale)``; the fused
    ops the engine's fusion pass puts before its FP8 linears (x [R, H] 2-D): ``rms_norm_quant(x, w,
    eps, pow2_scales, quant_eps, m_align) -> (q, scale_inv)``, ``add_rms_norm_quant(x, residual, w, eps,
    ...) -> (q, scale_inv, x + residual)`` and ``silu_mul_quant(x, ...) -> (q, scale_inv)``, and the one for
    its q/k norms and rotary embedding: ``qk_norm_rope(positions, q, k, wq, wk, eps_q, eps_k, inv_freq) ->
    (q, k)`` (q [T, Hq * D], k [T, Hk * D] as vLLM's attention splits them from qkv)."""

    @torch.library.custom_op("jetrl::rms_norm", mutates_args=())
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @_rms_norm.register_fake
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.custom_op("jetrl::add_rms_norm", mutates_args=())
    def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    @_add_rms_norm.register_fake
    def _(x, residual, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(x)

    @torch.library.custom_op("jetrl::silu_mul", mutates_args=())
    def _silu_mul(x: torch.Tensor) -> torch.Tensor:
        return silu_mul(x)

    @_silu_mul.register_fake
    def _(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.custom_op("jetrl::rope", mutates_args=())
    def _rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
              inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat, head_dim = positions.reshape(-1), 2 * inv_freq.numel()
        q = rope(query.reshape(flat.numel(), -1, head_dim), flat, inv_freq).view(query.shape)
        k = rope(key.reshape(flat.numel(), -1, head_dim), flat, inv_freq).view(key.shape)
        return q, k

    @_rope.register_fake
    def _(positions, query, key, inv_freq):
        return torch.empty_like(query, memory_format=torch.contiguous_format), \
            torch.empty_like(key, memory_format=torch.contiguous_format)

    @torch.library.custom_op("jetrl::rms_norm_quant", mutates_args=())
    def _rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, pow2_scales: bool, quant_eps: float,
                        m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, s, _ = rms_norm_quant(x, weight, eps, pow2_scales=pow2_scales, quant_eps=quant_eps, m_align=m_align)
        return q, s

    @_rms_norm_quant.register_fake
    def _(x, weight, eps, pow2_scales, quant_eps, m_align):
        return _quantized_like(x, x.shape[-1], m_align)

    @torch.library.custom_op("jetrl::add_rms_norm_quant", mutates_args=())
    def _add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            pow2_scales: bool, quant_eps: float,
                            m_align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rms_norm_quant(x, weight, eps, residual, pow2_scales=pow2_scales, quant_eps=quant_eps, m_align=m_align)

    @_add_rms_norm_quant.register_fake
    def _(x, residual, weight, eps, pow2_scales, quant_eps, m_align):
        return *_quantized_like(x, x.shape[-1], m_align), torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.custom_op("jetrl::silu_mul_quant", mutates_args=())
    def _silu_mul_quant(x: torch.Tensor, pow2_scales: bool, quant_eps: float,
                        m_align: int) -> tuple[torch.Tensor, torch.Tensor]:
        return silu_mul_quant(x, pow2_scales=pow2_scales, quant_eps=quant_eps, m_align=m_align)

    @_silu_mul_quant.register_fake
    def _(x, pow2_scales, quant_eps, m_align):
        return _quantized_like(x, x.shape[-1] // 2, m_align)

    @torch.library.custom_op("jetrl::qk_norm_rope", mutates_args=())
    def _qk_norm_rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, wq: torch.Tensor,
                      wk: torch.Tensor, eps_q: float, eps_k: float,
                      inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm_rope(positions.reshape(-1), query, key, wq, wk, eps_q, eps_k, inv_freq)

    @_qk_norm_rope.register_fake
    def _(positions, query, key, wq, wk, eps_q, eps_k, inv_freq):
        return torch.empty_like(query, memory_format=torch.contiguous_format), \
            torch.empty_like(key, memory_format=torch.contiguous_format)

    @torch.library.custom_op("jetrl::static_fp8_quant", mutates_args=())
    def _static_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return static_fp8_quant(x, scale)

    @_static_fp8_quant.register_fake
    def _(x, scale):
        return torch.empty_like(x, dtype=torch.float8_e4m3fn, memory_format=torch.contiguous_format)

    return torch.ops.jetrl


# ---------------------------------------------------------------- vLLM's batch-invariant kernels

@dataclass(frozen=True)
class VllmKernels:
    """vLLM's kernels of the exact forward, resolved once (``vllm_kernels()``).

    ``bf16_gemm(x [M, K], w [N, K]) -> [M, N]``: vLLM's ``linear_batch_invariant``.
    ``cutlass_scaled_mm``: ``vllm._custom_ops.cutlass_scaled_mm``.
    ``deep_gemm``: vLLM's ``fp8_gemm_nt`` where vLLM runs DeepGEMM in this process (``VLLM_USE_DEEP_GEMM``,
    Hopper), else None; ``deep_gemm_takes(out dtype, (N, K))``: vLLM's own rule for which linears it
    gives DeepGEMM (``should_use_deepgemm_for_fp8_linear``), so both sides pick per linear alike.
    ``flash_attn_varlen_func`` and ``fa_version``: vLLM's FlashAttention and the version its backend
    picked on this GPU.
    ``token_logprobs(logits [M, V], ids [M, k]) -> [M, k] fp32``: vLLM's V2 model runner's logprob
    kernel (one program per row; any row stride).
    ``reshape_and_cache_flash``: vLLM's kernel that writes K/V into its paged cache (FP8: ``x / scale``).
    """

    bf16_gemm: Callable[..., torch.Tensor]
    cutlass_scaled_mm: Callable[..., torch.Tensor]
    deep_gemm: Optional[Callable[..., None]]
    deep_gemm_takes: Callable[[torch.dtype, tuple[int, int]], bool]
    flash_attn_varlen_func: Callable[..., Any]
    fa_version: int
    descale_query: bool
    """Whether vLLM's backend passes a query descale (its ``supports_quant_query_input``)."""
    token_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    reshape_and_cache_flash: Callable[..., None]

    def fp8_kernel(self, out_dtype: torch.dtype, n: int, k: int) -> str:
        """The block-FP8 GEMM vLLM runs for a linear of weight [n, k] with this output dtype:
        ``deep_gemm`` or ``cutlass`` (its kernel choice: DeepGEMM first where it takes the shape)."""
        return "deep_gemm" if self.deep_gemm is not None and self.deep_gemm_takes(out_dtype, (n, k)) else "cutlass"

    def fp8_gemm(self, a: Fp8Tensor, w: Fp8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """``a · wᵀ`` -> [M, N]: a with 1x128 groups (scales group-major, strides (1, M), as the
        trainer's quantization kernel returns them), w with 128x128 blocks, on the kernel vLLM runs
        for this linear (``fp8_kernel``), called with the arguments vLLM's linear passes it:
        DeepGEMM's ``fp8_gemm_nt((A, As), (B, Bs), out)`` with fp32 scales, or CUTLASS's
        ``cutlass_scaled_mm(A, B.T, scale_a=As, scale_b=Bs.T)``. The scales' layout (DeepGEMM makes
        its own TMA-aligned copy where it needs one) changes no value."""
        scale_a = a.scale_inv
        if a.data.shape[0] > 1 and scale_a.stride(0) != 1:
            scale_a = scale_a.t().contiguous().t()
        n, k = w.data.shape
        if self.fp8_kernel(out_dtype, n, k) == "deep_gemm":
            out = torch.empty(a.data.shape[0], n, dtype=out_dtype, device=a.data.device)
            self.deep_gemm((a.data, scale_a), (w.data, w.scale_inv), out, is_deep_gemm_e8m0_used=False)
            return out
        return self.cutlass_scaled_mm(a.data, w.data.t(), scale_a=scale_a, scale_b=w.scale_inv.t(),
                                      out_dtype=out_dtype)

    def fp8_pages(self, k_THD: torch.Tensor, v_THD: torch.Tensor, pages: KvPages, k_scale: torch.Tensor,
                  v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as an FP8 paged cache (k_pages, v_pages [P, page, Hkv, D] float8_e4m3fn), written
        by vLLM's cache kernel with these scales ([1] fp32), as vLLM writes its FP8 KV cache."""
        tokens, heads, dim = k_THD.shape
        k_cache = torch.zeros(pages.num_pages, pages.page, heads, dim, dtype=torch.uint8, device=k_THD.device)
        v_cache = torch.zeros(pages.num_pages, pages.page, heads, v_THD.shape[-1], dtype=torch.uint8,
                              device=v_THD.device)
        self.reshape_and_cache_flash(k_THD, v_THD, k_cache, v_cache, pages.slots, "fp8", k_scale, v_scale)
        return k_cache.view(torch.float8_e4m3fn), v_cache.view(torch.float8_e4m3fn)

    def paged_attention(self, q_THD: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, block_table: torch.Tensor,
                        max_seqlen: int, scale: float, descales: tuple[torch.Tensor, ...] | None = None,
                        out_dtype: torch.dtype | None = None,
                        max_seqlen_q: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of each query segment over its own pages of K/V (the segment's queries
        are the last of the ``seqused_k`` positions, as in vLLM's decode and chunked prefill), with
        one KV split: (out [T, H, D], lse [H, T] fp32). The call vLLM's FlashAttention backend
        makes: with a BF16 cache its unit descales, with an FP8 one (q, k, v in E4M3) ``descales`` =
        the layer's (q, k, v) scales ([1] fp32 each) and the output in ``out_dtype``.
        ``max_seqlen``: the longest segment of keys (and of queries, unless ``max_seqlen_q``)."""
        groups = (seqused_k.numel(), k_pages.shape[2])
        if descales is None:
            ones = torch.ones(1, dtype=torch.float32, device=q_THD.device)
            descales = (ones, ones, ones)
        q_descale, k_descale, v_descale = (d.expand(groups) for d in descales)
        out = None if out_dtype is None else torch.empty(q_THD.shape, dtype=out_dtype, device=q_THD.device)
        out, lse = self.flash_attn_varlen_func(
            q=q_THD, k=k_pages, v=v_pages, out=out, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen if max_seqlen_q is None else max_seqlen_q,
            seqused_k=seqused_k, max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True,
            block_table=block_table, return_softmax_lse=True, fa_version=self.fa_version, num_splits=1,
            q_descale=q_descale if self.descale_query else None, k_descale=k_descale, v_descale=v_descale)
        return out, lse


BATCH_INVARIANT_MODULES = ("vllm.model_executor.layers.batch_invariant",
                           "vllm.model_executor.determinism.batch_invariant")
"""Where vLLM keeps its batch-invariant kernels (0.26: layers/; later releases: determinism/)."""


@functools.cache
def vllm_kernels() -> VllmKernels:
    """Resolve vLLM's kernels of the exact forward; ``ExactUnavailable`` names the first missing
    one (the exact mode never falls back to another kernel)."""
    try:
        import vllm._custom_ops as vllm_ops
    except ImportError as e:
        raise ExactUnavailable(f"precision.exact needs vLLM (its batch-invariant kernels): {e}") from e
    module = None
    for name in BATCH_INVARIANT_MODULES:
        try:
            module = importlib.import_module(name)
            break
        except ImportError:
            continue
    if module is None:
        raise ExactUnavailable(f"vLLM has no batch-invariant kernels ({' or '.join(BATCH_INVARIANT_MODULES)})")
    if not hasattr(module, "linear_batch_invariant") or not hasattr(vllm_ops, "cutlass_scaled_mm"):
        raise ExactUnavailable("vLLM lacks linear_batch_invariant or _custom_ops.cutlass_scaled_mm (the exact forward)")
    try:
        from vllm.v1.attention.backends.fa_utils import (flash_attn_supports_quant_query_input,
                                                         get_flash_attn_version, reshape_and_cache_flash)
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise ExactUnavailable(f"precision.exact needs vLLM's FlashAttention and V2 model runner: {e}") from e
    version = get_flash_attn_version()
    if version is None:
        raise ExactUnavailable("vLLM finds no FlashAttention for this GPU; precision.exact needs it")
    deep_gemm, deep_gemm_takes = _vllm_deep_gemm()
    return VllmKernels(bf16_gemm=module.linear_batch_invariant, cutlass_scaled_mm=vllm_ops.cutlass_scaled_mm,
                       deep_gemm=deep_gemm, deep_gemm_takes=deep_gemm_takes,
                       flash_attn_varlen_func=flash_attn_varlen_func, fa_version=int(version),
                       descale_query=bool(flash_attn_supports_quant_query_input()),
                       token_logprobs=compute_token_logprobs, reshape_and_cache_flash=reshape_and_cache_flash)


def _vllm_deep_gemm() -> tuple[Optional[Callable[..., None]], Callable[[torch.dtype, tuple[int, int]], bool]]:
    """vLLM's DeepGEMM entry (None where vLLM would not run DeepGEMM in this process: its
    ``is_deep_gemm_supported``, which reads ``VLLM_USE_DEEP_GEMM`` and the GPU) and its per-linear
    rule. A vLLM without a DeepGEMM integration picks CUTLASS for every linear."""
    try:
        from vllm.utils.deep_gemm import fp8_gemm_nt, is_deep_gemm_supported, should_use_deepgemm_for_fp8_linear
    except ImportError:
        return None, lambda out_dtype, shape: False
    return (fp8_gemm_nt if is_deep_gemm_supported() else None), (
        lambda out_dtype, shape: should_use_deepgemm_for_fp8_linear(out_dtype, shape, supports_deep_gemm=True))


@dataclass(frozen=True)
class KvPages:
    """Where a packed batch's K/V go in a paged cache laid out as vLLM lays out its own: each
    sequence on its own pages of ``page`` tokens. ``slots`` [T] int64 (page * page size + offset, as
    vLLM's slot mapping), ``block_table`` [S, max pages] int32, ``seqused_k`` [S] int32 (lengths)."""

    slots: torch.Tensor
    block_table: torch.Tensor
    seqused_k: torch.Tensor
    num_pages: int
    page: int


def kv_pages(cu_seqlens: torch.Tensor, positions_T: torch.Tensor, max_seqlen: int, page: int = KV_PAGE) -> KvPages:
    """The paged layout of a packed batch (``KvPages``). No host synchronization: the page count is
    bounded by T / page + S."""
    tokens, seqs = positions_T.numel(), cu_seqlens.numel() - 1
    device = positions_T.device
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    pages_per_seq = (lens + page - 1) // page
    first_page = torch.cumsum(pages_per_seq, 0) - pages_per_seq
    num_pages = tokens // page + seqs + 1
    index = torch.arange(tokens, device=device)
    seq_of_token = torch.searchsorted(cu_seqlens[1:].to(torch.int64), index, right=True)
    slots = first_page[seq_of_token] * page + positions_T.to(torch.int64)
    max_pages = (max_seqlen + page - 1) // page
    table = (first_page[:, None] + torch.arange(max_pages, device=device)[None, :]).clamp_(max=num_pages - 1)
    return KvPages(slots, table.to(torch.int32), lens.to(torch.int32), num_pages, page)


def query_segments(cu_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, tokens: int,
                   chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's queries as segments of at most ``chunk`` consecutive tokens of one sequence, each
    attending to its sequence's keys up to its last token: one FlashAttention call whose every
    segment is a decode-sized query (``precision.exact.FP8_KV_QUERY_ROWS``), so a prefill runs the
    kernel a decode step runs. ``cu_q`` [S + 1] (the sequences' query tokens, packed), ``seq_lens`` [S]
    (each sequence's keys including its queries: a query's context is ``seq_lens - its query
    length``, 0 for the trainer's packed sequences, the cached tokens for vLLM's), ``block_table``
    [S, pages]. Returns (cu_seqlens_q [N + 1] int32, seqused_k [N] int32, block_table [N, pages]) for a
    fixed N = tokens // chunk + S: segments past the last are empty (no host synchronization). The
    trainer's FP8 attention and vLLM's (``rollout.vllm_exact``) both segment with this."""
    seqs = cu_q.numel() - 1
    device = cu_q.device
    starts, lens = cu_q[:-1].to(torch.int64), (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    context = seq_lens[:seqs].to(torch.int64) - lens
    per_seq = (lens + chunk - 1) // chunk
    ends = torch.cumsum(per_seq, 0)
    segments = tokens // chunk + seqs
    index = torch.arange(segments, device=device)
    seq = torch.searchsorted(ends, index, right=True).clamp_(max=seqs - 1)
    real = index < ends[-1]
    offset = (index - (ends[seq] - per_seq[seq])) * chunk  # the segment's first query in its sequence
    first = torch.where(real, starts[seq] + offset, tokens)
    used = torch.where(real, context[seq] + torch.minimum(offset + chunk, lens[seq]), 0)
    cu_out = torch.cat([first, torch.full((1,), tokens, dtype=torch.int64, device=device)])
    return cu_out.to(torch.int32), used.to(torch.int32), block_table[seq]


def paged_kv(k_THD: torch.Tensor, v_THD: torch.Tensor,
             pages: KvPages) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed batch's K/V as a paged cache in their own dtype, as vLLM holds a BF16 one (pages
    zero-filled after each sequence's last token), laid out by ``kv_pages``. Returns (k_pages
    [P, page, Hkv, D], v_pages, block_table [S, max pages] int32, seqused_k [S] int32)."""
    page = pages.page
    tokens, heads, dim = k_THD.shape
    k_pages = k_THD.new_zeros(pages.num_pages * page, heads, dim).index_copy_(0, pages.slots, k_THD)
    v_pages = v_THD.new_zeros(pages.num_pages * page, heads, v_THD.shape[-1]).index_copy_(0, pages.slots, v_THD)
    return (k_pages.view(pages.num_pages, page, heads, dim), v_pages.view(pages.num_pages, page, heads, -1),
            pages.block_table, pages.seqused_k)
