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


@requires_vllm
@pytest.mark.parametrize("kernel", ["deep_gemm", "cutlass"])
@pytest.mark.parametrize("linear", sorted(QWEN3_8B_LINEARS))
def test_a_row_gets_the_same_bits_whatever_the_number_of_rows(gemms, kernel, linear):
    kernels = gemms[kernel]
    assert kernels.fp8_kernel(torch.bfloat16, *QWEN3_8B_LINEARS[linear]) == kernel
    a, w = _quantized_pair(QWEN3_8B_LINEARS[linear], max(ROW_COUNTS), seed=len(linear))
    full = kernels.fp8_gemm(a, w, torch.bfloat16)
    assert full.shape == (max(ROW_COUNTS), w.data.shape[0]) and bool(torch.isfinite(full).all())
    for m in ROW_COUNTS:
        part = kernels.fp8_gemm(_rows(a, m), w, torch.bfloat16)
        assert torch.equal(part, full[:m]), f"{kernel} {linear}: the first {m} rows differ from the same rows of " \
                                            f"{max(ROW_COUNTS)}"
    for i in (0, 77, 4095, 8191):  # one row alone, from anywhere in the batch
        one = kernels.fp8_gemm(_rows(_offset(a, i), 1), w, torch.bfloat16)
        assert torch.equal(one[0], full[i]), f"{kernel} {linear}: row {i} alone differs"


def _offset(a, i: int):
    from megatron_jetrl.precision import Fp8Tensor

    return Fp8Tensor(a.data[i:], a.scale_inv[i:], a.block_shape)


@requires_vllm
def test_deep_gemm_and_cutlass_round_differently(gemms):
    """The negative control: on the same codes and scales the two GEMMs give different bits in some
    outputs (both close to the dequantized product), so an exact trainer must call the engine's."""
    a, w = _quantized_pair(QWEN3_8B_LINEARS["o"], 512, seed=3)
    dg = gemms["deep_gemm"].fp8_gemm(a, w, torch.bfloat16)
    cut = gemms["cutlass"].fp8_gemm(a, w, torch.bfloat16)
    differ = (dg != cut).sum().item()
    assert differ > 0, "DeepGEMM and CUTLASS agreed on every output: the invariance test could not tell them apart"
    ref = a.dequantize() @ w.dequantize().t()
    assert float((dg.float() - ref).abs().max()) < 1e-2 * float(ref.abs().max())
    assert float((cut.float() - ref).abs().max()) < 1e-2 * float(ref.abs().max())
    print(f"DeepGEMM vs CUTLASS: {differ} of {dg.numel()} outputs differ")


# ---------------------------------------------------------------- fused norm / SiLU·mul + quantization

OPTIONS = [dict(pow2_scales=False, quant_eps=0.0, m_align=4), dict(pow2_scales=True, quant_eps=1e-12, m_align=1)]


def _same_quantized(got, want, what: str) -> None:
    (q, s), (wq, ws) = got[:2], want[:2]
    _codes_equal(q, wq, f"{what} codes")
    assert s.shape == ws.shape and s.stride() == ws.stride(), f"{what}: scales {s.shape}/{s.stride()} vs " \
                                                              f"{ws.shape}/{ws.stride()}"
    assert_same_bits(s, ws, f"{what} scales")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [128, 4096, 5120])
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(4096, 12288), (333, 1536), (1, 128), (5, 6144)])
@pytest.mark.parametrize("opts", range(len(OPTIONS)))
def test_silu_mul_quant_equals_the_reference_and_the_two_kernels(dtype, rows, inter, opts):
    options = OPTIONS[opts]
    x = wide_range((rows, 2 * inter), dtype, seed=rows + inter).cuda()
    got = silu_mul_quant(x, **options)
    what = f"{dtype} [{rows}, {2 * inter}] {options}"
    _same_quantized(got, silu_mul_quant_reference(x.cpu(), **options), what + " vs reference")
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
        _same_quantized(silu_mul_quant(x, **options), silu_mul_quant_reference(x.cpu(), **options),
                        f"{dtype} special values {options}")
    wide = wide_range((64, 3 * 1024), dtype, seed=5).cuda()
    rows = wide[:, : 2 * 1024]
    got = silu_mul_quant(rows, **OPTIONS[0])
    _same_quantized(got, silu_mul_quant_reference(rows.cpu(), **OPTIONS[0]), f"{dtype} strided rows")
    one = silu_mul_quant(rows[40:41], **OPTIONS[0])
    _codes_equal(one[0], got[0][40:41], f"{dtype} a row alone")
    assert_same_bits(one[1], got[1][40:41], f"{dtype} a row alone's scales")
