"""The reference quantizer follows the rule in blockwise.py's docstring exactly.

Expected codes and scales come from hand-known values or from ``_np_quantize``, an independent
numpy float32 restatement of the rule with its own e4m3 encoder; the function under test is never
its own oracle.
"""

import math

import numpy as np
import pytest
import torch

from megatron_jetrl.precision import (
    Fp8Tensor,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
    transpose_blocks,
)
from tests.helpers import assert_same_bytes

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E4M3_MAX = F32(448.0)
NAN_CODE = 0x7F


def _e4m3_magnitudes() -> np.ndarray:
    """Value of every finite non-negative e4m3fn code 0x00..0x7E, from the bit layout."""
    values = []
    for code in range(0x7F):
        exp, mant = code >> 3, code & 0x7
        values.append(mant * 2.0**-9 if exp == 0 else (1 + mant / 8) * 2.0 ** (exp - 7))
    return np.array(values, dtype=np.float64)


E4M3_GRID = _e4m3_magnitudes()


def _encode(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even e4m3fn codes of values already within [-448, 448]."""
    v = np.asarray(v, dtype=np.float64)
    mag = np.abs(v)
    hi = np.clip(np.searchsorted(E4M3_GRID, mag, side="left"), 1, 0x7E)
    lo = hi - 1
    d_lo, d_hi = mag - E4M3_GRID[lo], E4M3_GRID[hi] - mag
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(mag == 0, 0, code)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def _np_scale(amax: np.float32, pow2: bool, eps: float) -> np.float32:
    amax = max(F32(amax), F32(eps))
    if amax == 0:
        return F32(1.0)
    with np.errstate(over="ignore"):
        scale = E4M3_MAX / F32(amax)
    if np.isinf(scale):
        scale = FLT_MAX
    if pow2:
        scale = F32(2.0 ** (math.frexp(float(scale))[1] - 1))
    return scale


def _np_quantize(x, block, pow2=False, eps=0.0):
    """The module rule in numpy float32, block by block."""
    x = np.asarray(x, dtype=np.float32)
    bm, bk = block
    M, K = x.shape
    Mb, Kb = -(-M // bm), -(-K // bk)
    codes = np.zeros((M, K), dtype=np.uint8)
    scale_inv = np.zeros((Mb, Kb), dtype=np.float32)
    for i in range(Mb):
        for j in range(Kb):
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bk, (j + 1) * bk)
            blk = x[rows, cols]
            if not np.isfinite(blk).all():
                scale_inv[i, j] = np.nan
                codes[rows, cols] = NAN_CODE
                continue
            scale = _np_scale(np.abs(blk).max(), pow2, eps)
            scale_inv[i, j] = F32(1.0) / scale
            with np.errstate(under="ignore"):
                scaled = np.clip(blk * scale, -E4M3_MAX, E4M3_MAX)
            codes[rows, cols] = _encode(scaled)
    return codes, scale_inv


def _codes(data: torch.Tensor) -> np.ndarray:
    return data.view(torch.uint8).numpy()


def _codes_value(data: torch.Tensor) -> np.ndarray:
    codes = _codes(data)
    mag = E4M3_GRID[np.minimum(codes & 0x7F, 0x7E)]
    return np.where(codes & 0x80, -mag, mag)


def _check_against_numpy(x: torch.Tensor, block, pow2=False, eps=0.0):
    data, scale_inv = quantize_fp8_blockwise(x, block, pow2_scales=pow2, eps=eps)
    codes, expected_inv = _np_quantize(x.float().numpy(), block, pow2, eps)
    assert data.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    np.testing.assert_array_equal(_codes(data), codes)
    assert_same_bytes(scale_inv, torch.from_numpy(expected_inv), "scale_inv")
    return data, scale_inv


def _row(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32).to(dtype)


def test_encoder_agrees_with_torch_cast_on_representable_values():
    """The test's own e4m3 encoder must agree with torch on every exactly representable value."""
    grid = torch.tensor(np.concatenate([E4M3_GRID, -E4M3_GRID]), dtype=torch.float32)
    np.testing.assert_array_equal(_encode(grid.numpy()), grid.to(torch.float8_e4m3fn).view(torch.uint8).numpy())


def test_all_zero_block_has_unit_scale_and_signed_zero_codes():
    """amax == 0 takes scale 1 (no division by zero); -0.0 keeps its sign bit."""
    x = torch.zeros(3, 130)
    x[1, ::2] = -0.0
    data, scale_inv = quantize_fp8_blockwise(x, (128, 128))
    assert scale_inv.tolist() == [[1.0, 1.0]]
    expected = np.zeros((3, 130), dtype=np.uint8)
    expected[1, ::2] = 0x80
    np.testing.assert_array_equal(_codes(data), expected)
    _, scale_rows = quantize_fp8_blockwise(x, (1, 128))
    assert (scale_rows == 1.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_max_in_a_block(dtype):
    """The largest finite input maps to 448 with scale 448/max; small neighbours flush to zero."""
    big = torch.finfo(dtype).max
    x = _row([big, -big / 2, 1.0, 0.0], dtype)
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    scale = E4M3_MAX / F32(big)
    assert scale_inv.item() == F32(1.0) / scale
    codes = _codes(data)[0]
    assert codes[0] == 0x7E
    assert codes[1] == _encode(np.clip(F32(-big / 2) * scale, -448, 448))[()] == 0xF6
    assert codes[2] == 0 and codes[3] == 0


def test_amax_so_small_that_scale_overflows_uses_flt_max():
    """448/amax overflowing fp32 gives scale FLT_MAX, so scale_inv is the subnormal 1/FLT_MAX."""
    x = torch.tensor([[1e-45, -1e-45, 0.0]])
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    assert scale_inv.item() == F32(1.0) / FLT_MAX
    assert scale_inv.numpy().view(np.uint32)[0, 0] == (F32(1.0) / FLT_MAX).view(np.uint32)
    np.testing.assert_array_equal(_codes(data)[0], [0x00, 0x80, 0x00])


def test_amax_just_above_overflow_keeps_the_finite_quotient():
    """448/2e-36 is about 2.2e38, still finite: the scale is the quotient, not FLT_MAX."""
    x = torch.tensor([[2e-36, -1e-36]])
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    scale = E4M3_MAX / F32(2e-36)
    assert np.isfinite(scale) and scale != FLT_MAX
    assert scale_inv.item() == F32(1.0) / scale
    assert _codes(data)[0, 0] == 0x7E
    _check_against_numpy(x, (1, 128))


def test_bf16_subnormal_block_scales_by_flt_max():
    """Every bf16 subnormal block overflows 448/amax; with scale FLT_MAX the smallest subnormal
    2^-133 becomes 2^-6 * (2 - 2^-23), which rounds to 2^-5 (0x10)."""
    tiny = 2.0**-133
    x = _row([tiny, -tiny, 2 * tiny], torch.bfloat16)
    assert x[0, 0].item() == tiny
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    assert scale_inv.item() == F32(1.0) / FLT_MAX
    np.testing.assert_array_equal(_codes(data)[0], [0x10, 0x90, 0x18])
    _check_against_numpy(x, (1, 128))


def test_fp16_subnormal_inputs():
    """fp16 subnormals quantize exactly: amax 2^-15 gives scale 448*2^15, so 2^-24 -> 0.875."""
    x = _row([2.0**-24, 2.0**-20, 3 * 2.0**-24, -(2.0**-15), 2.0**-16], torch.float16)
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    assert scale_inv.item() == F32(1.0) / F32(448.0 * 2**15)
    np.testing.assert_array_equal(_codes(data)[0], [0x36, 0x56, 0x42, 0xFE, 0x76])


def test_fp32_subnormals_next_to_normals():
    """Subnormal inputs beside a normal amax round to zero or tiny codes per the rule."""
    x = torch.tensor([[1e-40, -3e-39, 2.0**-126, 5e-38, 1e-35]])
    _check_against_numpy(x, (1, 128))
    x = torch.tensor([[1e-40, -3e-39, 7e-39]])
    data, scale_inv = _check_against_numpy(x, (1, 128))
    assert scale_inv.item() == F32(1.0) / FLT_MAX


BOUNDARY_CODES = [
    (448.0, 0x7E),
    (-448.0, 0xFE),
    (416.0, 0x7D),
    (432.0, 0x7E),
    (440.0, 0x7E),
    (424.0, 0x7D),
    (1.0, 0x38),
    (1.0625, 0x38),
    (1.125, 0x39),
    (1.1875, 0x3A),
    (2.0**-6, 0x08),
    (2.0**-7, 0x04),
    (2.0**-9, 0x01),
    (2.0**-10, 0x00),
    (3 * 2.0**-10, 0x02),
    (2.0**-11, 0x00),
    (-(2.0**-11), 0x80),
    (0.0, 0x00),
    (-0.0, 0x80),
]


def test_e4m3_boundaries_with_unit_scale():
    """With amax 448 the scale is exactly 1, so codes are the plain round-to-nearest-even cast:
    432 (416|448 midpoint) ties to 448's even code, 1.0625 ties to 1.0, 2^-9 is the smallest
    subnormal, 2^-10 ties to zero."""
    values = [v for v, _ in BOUNDARY_CODES]
    data, scale_inv = quantize_fp8_blockwise(torch.tensor([values]), (1, 128))
    assert scale_inv.item() == 1.0
    assert _codes(data)[0].tolist() == [c for _, c in BOUNDARY_CODES]
    exact = torch.tensor([448.0, -448.0, 416.0, 1.0, 1.125, 1.25, 2.0**-6, 2.0**-7, 2.0**-9])
    assert _codes(exact.to(torch.float8_e4m3fn)).tolist() == [0x7E, 0xFE, 0x7D, 0x38, 0x39, 0x3A, 0x08, 0x04, 0x01]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_nonfinite_poisons_only_its_block(bad, block):
    """A NaN/Inf block gets scale_inv NaN and every code 0x7F; neighbouring blocks are untouched."""
    x = torch.linspace(-3, 5, 130 * 200).reshape(130, 200)
    x[3, 7] = bad
    data, scale_inv = quantize_fp8_blockwise(x, block)
    codes = _codes(data)
    rows = slice(3, 4) if block == (1, 128) else slice(0, 128)
    bad_block = (3, 0) if block == (1, 128) else (0, 0)
    assert math.isnan(scale_inv[bad_block].item())
    assert (codes[rows, :128] == NAN_CODE).all()
    finite = scale_inv.clone()
    finite[bad_block] = 0.0
    assert torch.isfinite(finite).all()
    clean = x.clone()
    clean[3, 7] = 0.0
    ok_codes, ok_inv = _np_quantize(clean.numpy(), block)
    mask = np.ones(codes.shape, dtype=bool)
    mask[rows, :128] = False
    np.testing.assert_array_equal(codes[mask], ok_codes[mask])
    ok_inv[bad_block] = np.nan
    assert_same_bytes(scale_inv, torch.from_numpy(ok_inv), "scale_inv")


def test_inf_and_nan_together_and_nan_dequantizes_to_nan():
    x = torch.ones(2, 256)
    x[0, 1], x[0, 2] = float("inf"), float("nan")
    x[1, 200] = float("-inf")
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    assert torch.isnan(scale_inv).tolist() == [[True, False], [False, True]]
    assert (_codes(data)[0, :128] == NAN_CODE).all() and (_codes(data)[1, 128:] == NAN_CODE).all()
    out = dequantize_fp8_blockwise(data, scale_inv, (1, 128))
    assert torch.isnan(out[0, :128]).all() and torch.isnan(out[1, 128:]).all()
    assert (out[0, 128:] == 1.0).all() and (out[1, :128] == 1.0).all()


@pytest.mark.parametrize("amax", [1.0, 3.0, 224.0, 300.0, 448.0, 449.0, 896.0, 1000.0, 1e-3, 0.07, 5e4, 1e-30])
def test_pow2_scale_inv_is_power_of_two_ceil(amax):
    """pow2 rounds the scale down, so scale_inv = 2^ceil(log2(amax/448)), an exact power of two."""
    x = torch.tensor([[amax, -amax / 3, amax / 7]])
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128), pow2_scales=True)
    amax32 = float(F32(amax))
    expected = 2.0 ** math.ceil(math.log2(amax32 / 448.0))
    assert scale_inv.item() == expected
    mantissa, _ = math.frexp(scale_inv.item())
    assert mantissa == 0.5
    _check_against_numpy(x, (1, 128), pow2=True)


def test_pow2_with_overflowing_scale_is_largest_power_of_two():
    """FLT_MAX rounded down to a power of two is 2^127, so scale_inv is 2^-127."""
    _, scale_inv = quantize_fp8_blockwise(torch.tensor([[1e-45]]), (1, 128), pow2_scales=True)
    assert scale_inv.item() == 2.0**-127


def test_eps_raises_small_amax():
    """amax below eps is raised to eps, including an all-zero block (which then is not scale 1)."""
    eps = 1e-4
    x = torch.tensor([[1e-6, -2e-6] + [0.0] * 126 + [0.0] * 128 + [0.5] + [0.0] * 127])
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128), eps=eps)
    tiny = F32(1.0) / (E4M3_MAX / F32(eps))
    assert scale_inv[0].tolist() == [tiny, tiny, F32(1.0) / (E4M3_MAX / F32(0.5))]
    assert _codes(data)[0, 0] == _encode(F32(1e-6) * (E4M3_MAX / F32(eps)))[()] != 0
    _check_against_numpy(x, (1, 128), eps=eps)
    _check_against_numpy(x, (1, 128), eps=eps, pow2=True)


def test_scale_is_ieee_division_not_reciprocal_times_448():
    """scale = fl(448 / amax): for this amax, fl(448 * fl(1/amax)) is one ulp off and so is its
    scale_inv, which is what byte-identity with TE and the kernels hinges on."""
    amax = np.array([1084808941], dtype=np.uint32).view(np.float32)[0]
    ieee = E4M3_MAX / amax
    via_reciprocal = E4M3_MAX * (F32(1.0) / amax)
    assert ieee != via_reciprocal and F32(1.0) / ieee != F32(1.0) / via_reciprocal
    x = torch.tensor([[float(amax), -float(amax) / 2, 1.0]])
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    assert scale_inv.numpy().view(np.uint32)[0, 0] == (F32(1.0) / ieee).view(np.uint32)
    _check_against_numpy(x, (1, 128))


@pytest.mark.parametrize("shape", [(1, 1), (129, 257), (300, 5)])
@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
def test_partial_tail_blocks(shape, block):
    """Scales are [ceil(M/bm), ceil(K/bk)] and codes follow the rule on tail blocks too."""
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randn(shape, generator=g) * 3
    data, scale_inv = _check_against_numpy(x, block)
    assert data.shape == shape
    assert scale_inv.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    assert scale_inv.is_contiguous()


def test_tail_block_scale_uses_only_existing_elements():
    """A 1-element tail block is scaled by that element alone (negative, so zero padding could
    only matter if it were counted), and is unaffected by values outside it."""
    x = torch.full((129, 257), 100.0)
    x[128, 256] = -0.75
    data, scale_inv = quantize_fp8_blockwise(x, (128, 128))
    assert scale_inv[1, 2].item() == F32(1.0) / (E4M3_MAX / F32(0.75))
    assert _codes(data)[128, 256] == 0xFE
    assert scale_inv[0, 0].item() == F32(1.0) / (E4M3_MAX / F32(100.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes(dtype):
    """Values exact in every input dtype give the same bytes whatever the dtype."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randint(-64, 65, (70, 300), generator=g).float() / 8).to(dtype)
    for block in [(128, 128), (1, 128)]:
        data, scale_inv = _check_against_numpy(x, block)
        data32, scale32 = quantize_fp8_blockwise(x.float(), block)
        assert_same_bytes(data, data32, f"{dtype} codes")
        assert_same_bytes(scale_inv, scale32, f"{dtype} scale_inv")


def test_non_contiguous_input_quantizes_its_values():
    x = torch.randn(200, 150)
    _check_against_numpy(x.t(), (1, 128))


@pytest.mark.parametrize(
    "x, block, eps, error, match",
    [
        (torch.zeros(2, 3, 4), (128, 128), 0.0, ValueError, r"2-D \[M, K\].*\(2, 3, 4\)"),
        (torch.zeros(4, 4, dtype=torch.int32), (128, 128), 0.0, TypeError, r"bfloat16, float16 or float32.*int32"),
        (torch.zeros(4, 4, dtype=torch.float64), (128, 128), 0.0, TypeError, r"float32; got torch.float64"),
        (torch.zeros(4, 4), (0, 128), 0.0, ValueError, r"block_shape must be two positive ints"),
        (torch.zeros(4, 4), (128,), 0.0, ValueError, r"block_shape.*\(128,\)"),
        (torch.zeros(4, 4), (1.0, 128), 0.0, ValueError, r"block_shape"),
        (torch.zeros(4, 4), (True, 128), 0.0, ValueError, r"block_shape"),
        (torch.zeros(4, 4), (128, 128), -1.0, ValueError, r"eps.*>= 0; got -1.0"),
        (torch.zeros(4, 4), (128, 128), float("nan"), ValueError, r"eps.*finite.*nan"),
        (torch.zeros(4, 4), (128, 128), float("inf"), ValueError, r"eps"),
    ],
)
def test_bad_input_errors_name_the_problem(x, block, eps, error, match):
    with pytest.raises(error, match=match):
        quantize_fp8_blockwise(x, block, eps=eps)


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="torch.Tensor; got list"):
        quantize_fp8_blockwise([[1.0]], (1, 128))


def test_empty_input():
    data, scale_inv = quantize_fp8_blockwise(torch.zeros(0, 300), (1, 128))
    assert data.shape == (0, 300) and data.dtype == torch.float8_e4m3fn
    assert scale_inv.shape == (0, 3) and scale_inv.dtype == torch.float32


@pytest.mark.parametrize("block", [(128, 128), (1, 128)])
@pytest.mark.parametrize("pow2", [False, True])
def test_dequantize_round_trip_error_bound(block, pow2):
    """e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal codes; below the normal range
    the absolute error is at most half the subnormal step, 2^-10 * scale_inv."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(200, 300, generator=g) * torch.logspace(-3, 3, 300)
    data, scale_inv = quantize_fp8_blockwise(x, block, pow2_scales=pow2)
    out = dequantize_fp8_blockwise(data, scale_inv, block, dtype=torch.float64)
    s = scale_inv.double().repeat_interleave(block[0], 0)[:200].repeat_interleave(block[1], 1)[:, :300]
    x64 = x.double()
    bound = (2.0**-4 + 1e-6) * x64.abs() + 2.0**-10 * s
    assert ((out - x64).abs() <= bound).all()
    assert np.array_equal(out.numpy(), _codes_value(data) * s.numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_output_dtype(dtype):
    x = torch.tensor([[448.0, -1.0, 2.0**-9, 0.0]])
    data, scale_inv = quantize_fp8_blockwise(x, (1, 128))
    out = dequantize_fp8_blockwise(data, scale_inv, (1, 128), dtype=dtype)
    assert out.dtype == dtype
    assert out.tolist() == [[448.0, -1.0, 2.0**-9, 0.0]]


def test_dequantize_rejects_misshaped_scale_inv():
    data, scale_inv = quantize_fp8_blockwise(torch.randn(2, 130), (1, 128))
    with pytest.raises(ValueError, match=r"scale_inv shape \(1, 2\).*expected \(2, 2\)"):
        dequantize_fp8_blockwise(data, scale_inv[:1], (1, 128))
    with pytest.raises(ValueError, match=r"expected \(1, 2\)"):
        dequantize_fp8_blockwise(data, scale_inv, (128, 128))
    with pytest.raises(TypeError, match="scale_inv must be float32"):
        dequantize_fp8_blockwise(data, scale_inv.double(), (1, 128))
    with pytest.raises(TypeError, match="data must be float8_e4m3fn"):
        dequantize_fp8_blockwise(data.view(torch.uint8), scale_inv, (1, 128))


def test_fp8_tensor_dequantize_uses_its_block_shape():
    x = torch.randn(130, 260)
    t = Fp8Tensor(*quantize_fp8_blockwise(x, (128, 128)), (128, 128))
    expected = _codes_value(t.data) * t.scale_inv.numpy().repeat(128, 0)[:130].repeat(128, 1)[:, :260]
    np.testing.assert_array_equal(t.dequantize().numpy(), expected.astype(np.float32))


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (1, 130)])
def test_transpose_blocks_equals_quantizing_the_transpose(shape):
    """A square block of x.t() holds exactly the transposed block of x, so bytes and scales agree."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=g) * torch.rand(shape[1], generator=g) * 10
    t = transpose_blocks(Fp8Tensor(*quantize_fp8_blockwise(x, (128, 128)), (128, 128)))
    codes, scale_inv = _np_quantize(x.t().numpy(), (128, 128))
    np.testing.assert_array_equal(_codes(t.data), codes)
    assert_same_bytes(t.scale_inv, torch.from_numpy(scale_inv), "transposed scale_inv")
    assert t.block_shape == (128, 128) and t.data.is_contiguous()


def test_transpose_blocks_rejects_non_square_blocks():
    t = Fp8Tensor(*quantize_fp8_blockwise(torch.randn(2, 128), (1, 128)), (1, 128))
    with pytest.raises(ValueError, match="square blocks"):
        transpose_blocks(t)
