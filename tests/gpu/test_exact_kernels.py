"""Kernels the exact engine runs that the trainer does not call itself, bit for bit on CUDA:

- the block-FP8 GEMMs (``ops.exact.VllmKernels.fp8_gemm``: DeepGEMM, vLLM's default, and CUTLASS)
  give a row the same bits whatever the number of rows in the call (1 ... 8192 at Qwen3-8B's
  linear shapes), so vLLM's decode batches and the trainer's packed micro-batches agree; and the two
  GEMMs do not agree with each other (the negative control: ``torch.equal`` sees their one-ulp
  differences, so the trainer must call the GEMM vLLM runs);
- the fused norm / SiLU·mul + 1x128 quantization kernels of the engine's fusion pass
  (``ops.exact.rms_norm_quant``, ``silu_mul_quant``) equal their eager torch references and the two
  kernels they replace (the norm or SiLU·mul kernel, then the quantization kernel), codes, scales and
  the scales' layout, also for special values, strided rows and one row alone.
"""

import dataclasses

import pytest
import torch

from megatron_jetrl.ops.exact import (rms_norm_quant, rms_norm_quant_reference, silu_mul, silu_mul_quant,
                                      silu_mul_quant_reference, vllm_kernels)
from megatron_jetrl.ops.quantize import quantize_128x128, quantize_1x128, quantize_rows
from megatron_jetrl.ops.rms_norm import add_rms_norm, rms_norm
from tests.gpu.conftest import requires_vllm
from tests.unit.test_rms_norm_kernel import DTYPES, assert_same_bits, weight_for, wide_range

pytestmark = pytest.mark.gpu

QWEN3_8B_LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROW_COUNTS = [1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 127, 128, 200, 256, 384, 512, 1000, 2048, 8192]


def _codes_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a8, b8 = a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu()
    diff = (a8 != b8).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} codes differ, first at {diff[0].tolist()}"


def _quantized_pair(shape_nk, rows: int, seed: int):
    n, k = shape_nk
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(rows, k, generator=g, device="cuda") * 2).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    a, _ = quantize_1x128(x)
    wq, _ = quantize_128x128(w)
    return a, wq


def _rows(a, m: int):
    """The first m rows of a 1x128-quantized activation, its scales in the quantization kernel's own
    layout (group-major, strides (1, m)) as a fresh quantization of m rows would give them."""
    from megatron_jetrl.precision import Fp8Tensor

    return Fp8Tensor(a.data[:m].contiguous(), a.scale_inv[:m].t().contiguous().t(), a.block_shape)


@pytest.fixture(scope="module")
def gemms():
    """VllmKernels forced onto each block-FP8 GEMM (whatever VLLM_USE_DEEP_GEMM says)."""
    from vllm.utils.deep_gemm import fp8_gemm_nt

    base = vllm_kernels()
    return {"deep_gemm": dataclasses.replace(base, deep_gemm=fp8_gemm_nt, deep_gemm_takes=lambda dtype, shape: True),
            "cutlass": dataclasses.replace(base, deep_gemm=None)}


def row_variance(gemm, a, w) -> str | None:
    """Where ``gemm`` (a, w) gives a row other bits than the same row among ``max(ROW_COUNTS)``: the
    first such call, as a message, or None."""
    full = gemm(a, w)
    for m in ROW_COUNTS:
        if not torch.equal(gemm(_rows(a, m), w), full[:m]):
            return f"the first {m} rows differ from the same rows of {max(ROW_COUNTS)}"
    for i in (0, 77, 4095, 8191):  # one row alone, from anywhere in the batch
        if not torch.equal(gemm(_rows(_offset(a, i), 1), w)[0], full[i]):
            return f"row {i} alone differs"
    return None


@requires_vllm
@pytest.mark.parametrize("kernel", ["deep_gemm", "cutlass"])
@pytest.mark.parametrize("linear", sorted(QWEN3_8B_LINEARS))
def test_a_row_gets_the_same_bits_whatever_the_number_of_rows(gemms, kernel, linear):
    kernels = gemms[kernel]
    assert kernels.fp8_kernel(torch.bfloat16, *QWEN3_8B_LINEARS[linear]) == kernel
    a, w = _quantized_pair(QWEN3_8B_LINEARS[linear], max(ROW_COUNTS), seed=len(linear))
    full = kernels.fp8_gemm(a, w, torch.bfloat16)
    assert full.shape == (max(ROW_COUNTS), w.data.shape[0]) and bool(torch.isfinite(full).all())
    problem = row_variance(lambda x, y: kernels.fp8_gemm(x, y, torch.bfloat16), a, w)
    assert problem is None, f"{kernel} {linear}: {problem}"


def _offset(a, i: int):
    from megatron_jetrl.precision import Fp8Tensor

    return Fp8Tensor(a.data[i:], a.scale_inv[i:], a.block_shape)


@requires_vllm
def test_the_row_check_sees_a_gemm_whose_rows_depend_on_the_batch(gemms):
    """The negative control: a GEMM that splits K in two for calls of fewer than 64 rows (as split-K
    heuristics do) rounds those rows differently, and the same check reports it. Also printed: how many
    outputs DeepGEMM and CUTLASS give different bits (they may agree at a shape: the trainer calls the
    engine's kernel either way)."""
    dg = gemms["deep_gemm"]
    a, w = _quantized_pair(QWEN3_8B_LINEARS["o"], max(ROW_COUNTS), seed=3)
    half = w.data.shape[1] // 2

    def split_k(x, y):
        if x.data.shape[0] >= 64:
            return dg.fp8_gemm(x, y, torch.bfloat16)
        lo, hi = (dg.fp8_gemm(_k_slice(x, k), _k_slice(y, k), torch.bfloat16) for k in (slice(0, half),
                                                                                          slice(half, None)))
        return (lo.float() + hi.float()).to(torch.bfloat16)

    assert row_variance(split_k, a, w) is not None
    cut = gemms["cutlass"].fp8_gemm(a, w, torch.bfloat16)
    print(f"DeepGEMM vs CUTLASS at {tuple(w.data.shape)}: "
          f"{int((dg.fp8_gemm(a, w, torch.bfloat16) != cut).sum())} of {cut.numel()} outputs differ")


def _k_slice(t, k: slice):
    """The columns ``k`` (whole 128-column groups) of a block-quantized operand, with their scales (in
    the layout they had: column-major for 1x128 groups, row-major for 128x128 blocks)."""
    from megatron_jetrl.precision import Fp8Tensor

    blocks = slice(k.start // 128, None if k.stop is None else k.stop // 128)
    scale = t.scale_inv[:, blocks]
    return Fp8Tensor(t.data[:, k].contiguous(), scale if t.block_shape == (1, 128) else scale.contiguous(),
                     t.block_shape)


# ---------------------------------------------------------------- fused norm / SiLU·mul + quantization

OPTIONS = [dict(pow2_scales=False, quant_eps=0.0, m_align=4), dict(pow2_scales=True, quant_eps=1e-12, m_align=1)]


def _same_quantized(got, want, what: str) -> None:
    (q, s), (wq, ws) = got[:2], want[:2]
    _codes_equal(q, wq, f"{what} codes")
    assert s.shape == ws.shape and s.stride() == ws.stride(), f"{what}: scales {s.shape}/{s.stride()} vs " \
                                                              f"{ws.shape}/{ws.stride()}"
    assert_same_bits(s, ws, f"{what} scales")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [128, 4096, 5120, 8192])  # 5120: a lane's second batch of loads partly past H
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("opts", range(len(OPTIONS)))
def test_rms_norm_quant_equals_the_reference_and_the_two_kernels(dtype, H, residual, opts):
    options = OPTIONS[opts]
    x = wide_range((1001, H), dtype, seed=H).cuda()
    r = wide_range((1001, H), dtype, seed=H + 7).cuda() if residual else None
    w = weight_for(H, dtype, H + 3).cuda()
    got = rms_norm_quant(x, w, 1e-6, r, **options)
    what = f"{dtype} H={H} residual={residual} {options}"
    want = rms_norm_quant_reference(x.cpu(), w.cpu(), 1e-6, None if r is None else r.cpu(), **options)
    _same_quantized(got, want, what + " vs reference")
    y, total = (rms_norm(x, w, 1e-6), None) if r is None else add_rms_norm(x, r, w, 1e-6)
    _same_quantized(got, quantize_rows(y, pow2_scales=options["pow2_scales"], eps=options["quant_eps"],
                                       m_align=options["m_align"]), what + " vs the two kernels")
    if residual:
        assert_same_bits(got[2], total, what + " residual sum")
        assert_same_bits(got[2], want[2], what + " residual sum vs reference")
    else:
        assert got[2] is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_quant_special_values_strided_rows_and_a_row_alone(dtype):
    H = 4096
    x = wide_range((64, H), dtype, seed=1).cuda()
    info = torch.finfo(dtype)
    x[3, 5] = float("nan")  # a bad group: codes 0x7F and a NaN scale; the rest of the row normed to NaN too
    x[4, 130] = float("inf")
    x[5] = 0.0  # a zero row: scale 1
    x[6, :128] = info.max
    w = weight_for(H, dtype, 11).cuda()
    for options in OPTIONS:
        want = rms_norm_quant_reference(x.cpu(), w.cpu(), 1e-6, **options)
        _same_quantized(rms_norm_quant(x, w, 1e-6, **options), want, f"{dtype} special values {options}")
    wide = wide_range((32, 2 * H), dtype, seed=2).cuda()
    rows, res = wide[:, :H], wide[:, H:]  # rows of a larger stride (slices of a fused output)
    got = rms_norm_quant(rows, w, 1e-6, res, **OPTIONS[0])
    _same_quantized(got, rms_norm_quant_reference(rows.cpu(), w.cpu(), 1e-6, res.cpu(), **OPTIONS[0]),
                    f"{dtype} strided rows")
    one = rms_norm_quant(rows[9:10], w, 1e-6, res[9:10], **OPTIONS[0])
    _codes_equal(one[0], got[0][9:10], f"{dtype} a row alone")
    assert_same_bits(one[1][:, :], got[1][9:10], f"{dtype} a row alone's scales")


def test_rms_norm_quant_refuses_a_row_over_its_shared_memory():
    x = torch.ones(2, 16384, dtype=torch.float32, device="cuda")  # 64 KiB a row, the kernel keeps 48
    with pytest.raises(RuntimeError, match="rms_norm_quant: a row of 16384 values of 4 bytes"):
        rms_norm_quant(x, torch.ones(16384, device="cuda"), 1e-6, **OPTIONS[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(4096, 12288), (333, 1536), (1, 128), (5, 6144)])
@pytest.mark.parametrize("opts", range(len(OPTIONS)))
def test_silu_mul_quant_equals_the_reference_and_the_two_kernels(dtype, rows, inter, opts):
    options = OPTIONS[opts]
    x = wide_range((rows, 2 * inter), dtype, seed=rows + inter).cuda()
    got = silu_mul_quant(x, **options)
    what = f"{dtype} [{rows}, {2 * inter}] {options}"
    _same_quantized(got, silu_mul_quant_reference(x, **options), what + " vs reference")  # torch's CUDA silu
    _same_quantized(got, quantize_rows(silu_mul(x), pow2_scales=options["pow2_scales"], eps=options["quant_eps"],
                                       m_align=options["m_align"]), what + " vs the two kernels")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_quant_special_values_strided_rows_and_a_row_alone(dtype):
    x = wide_range((16, 2 * 256), dtype, seed=4).cuda()
    x[2, 7] = float("nan")
    x[3, 300] = float("inf")  # an up value: silu(gate) * inf
    x[4, 5] = float("-inf")  # a gate value: silu(-inf) = -0 * ... -> NaN or 0
    x[5] = 0.0
    for options in OPTIONS:
        _same_quantized(silu_mul_quant(x, **options), silu_mul_quant_reference(x, **options),
                        f"{dtype} special values {options}")
    wide = wide_range((64, 3 * 1024), dtype, seed=5).cuda()
    rows = wide[:, : 2 * 1024]
    got = silu_mul_quant(rows, **OPTIONS[0])
    _same_quantized(got, silu_mul_quant_reference(rows, **OPTIONS[0]), f"{dtype} strided rows")
    one = silu_mul_quant(rows[40:41], **OPTIONS[0])
    _codes_equal(one[0], got[0][40:41], f"{dtype} a row alone")
    assert_same_bits(one[1], got[1][40:41], f"{dtype} a row alone's scales")
    shifted = wide[:, 1: 1 + 2 * 1024]  # rows that start one element off: the kernel's one-value loads
    _same_quantized(silu_mul_quant(shifted, **OPTIONS[0]), silu_mul_quant_reference(shifted, **OPTIONS[0]),
                    f"{dtype} rows off the 4-value alignment")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hq,hk,d", [(1000, 32, 8, 128), (7, 16, 8, 128), (1, 4, 1, 128), (33, 8, 2, 256)])
def test_qk_norm_rope_equals_the_reference_and_the_kernels_it_replaces(dtype, tokens, hq, hk, d):
    """q and k as column slices of one qkv (rows of qkv's stride, as vLLM splits them), positions up to
    40,960: the fused kernel = rms_norm_reference of each head then rope_reference (eager torch on the
    GPU, whose cos / sin the kernel's are), and = the norm kernel then the rope kernel."""
    from megatron_jetrl.ops.exact import qk_norm_rope, qk_norm_rope_reference, rope, rope_inv_freq

    g = torch.Generator().manual_seed(tokens + hq)
    qkv = wide_range((tokens, (hq + 2 * hk) * d), dtype, seed=tokens + d).cuda()
    q, k = qkv[:, : hq * d], qkv[:, hq * d: (hq + hk) * d]
    wq, wk = weight_for(d, dtype, 5).cuda(), weight_for(d, dtype, 6).cuda()
    positions = torch.randint(0, 40960, (tokens,), generator=g).cuda()
    inv_freq = rope_inv_freq(d, 1e6, torch.device("cuda"))
    got = qk_norm_rope(positions, q, k, wq, wk, 1e-6, 1e-5, inv_freq)
    want = qk_norm_rope_reference(positions, q, k, wq, wk, 1e-6, 1e-5, inv_freq)
    for name, a, b, x, w, eps in (("q", got[0], want[0], q, wq, 1e-6), ("k", got[1], want[1], k, wk, 1e-5)):
        what = f"{dtype} T={tokens} {name} heads of {d}"
        assert a.is_contiguous() and a.shape == x.shape
        assert_same_bits(a, b, what + " vs reference")
        two = rope(rms_norm(x.reshape(tokens, -1, d), w, eps), positions, inv_freq).reshape(x.shape)
        assert_same_bits(a, two, what + " vs the two kernels")
    if tokens > 5:
        one = qk_norm_rope(positions[5:6], q[5:6], k[5:6], wq, wk, 1e-6, 1e-5, inv_freq)
        assert_same_bits(one[0], got[0][5:6], f"{dtype} a token alone (q)")
        assert_same_bits(one[1], got[1][5:6], f"{dtype} a token alone (k)")


@requires_vllm
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_the_attention_gradient_from_the_exact_forward_is_the_recomputed_ones(kv_fp8):
    """The exact attention's backward: FlashAttention-2's from the exact forward's own output and
    log-sum-exp (no second forward) gives the gradient that differentiating the trainer's attention
    afresh gives (the same math from a forward rounded elsewhere: close, not equal), with grouped-query
    heads and packed sequences; with an FP8 KV cache, at the values the cache holds."""
    from megatron_jetrl.actor.exact import exact_attention, flash_attention_backward, recompute_backward
    from megatron_jetrl.actor.layers import packed_causal_attention, packed_positions

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [300, 17, 1024, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, 128, generator=g, device="cuda").bfloat16().requires_grad_() for h in (8, 2, 2))
    positions = packed_positions(cu, tokens)
    scales = torch.tensor([4.0 / 448, 4.0 / 448, 4.0 / 448], device="cuda") if kv_fp8 else None
    dout = torch.randn(tokens, 8, 128, generator=g, device="cuda").bfloat16()
    grads = {}
    for name, backward in (("flash", flash_attention_backward),
                           ("recompute", recompute_backward(packed_causal_attention))):
        out = exact_attention(q, k, v, cu, positions, max(lengths), 128 ** -0.5, vllm_kernels(), backward, scales)
        grads[name] = torch.autograd.grad(out, (q, k, v), dout)
    for name, a, b in zip("qkv", grads["flash"], grads["recompute"], strict=True):
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        print(f"d{name}: relative difference {rel:.2e}")
        assert torch.isfinite(a).all() and rel < 2e-2, f"d{name} differs by {rel:.2e} (kv_fp8={kv_fp8})"
