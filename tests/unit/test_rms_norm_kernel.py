"""The C++ CPU RMSNorm kernel equals its torch reference bit for bit, gives a row the same bits
whatever else is in the call, follows the documented order, and validates its inputs."""

import numpy as np
import pytest
import torch

from megatron_jetrl.ops import load_extension
from megatron_jetrl.ops.rms_norm import LANES, rms_norm, rms_norm_reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HIDDEN = [128, 384, 4096, 5120]
INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit for bit (so -0.0 != 0.0), NaN where the other has NaN (payloads not compared)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ"
    bits_a = a.masked_fill(nan_a, 0).view(INT_OF[a.dtype])
    bits_e = e.masked_fill(nan_e, 0).view(INT_OF[e.dtype])
    diff = (bits_a != bits_e).nonzero()
    assert diff.numel() == 0, (
        f"{what}: {diff.shape[0]} values differ, first at {diff[0].tolist()}: "
        f"{a[tuple(diff[0])].item()!r} vs {e[tuple(diff[0])].item()!r}"
    )


def wide_range(shape, dtype, seed, lo=-3.0, hi=3.0) -> torch.Tensor:
    """Random signs and magnitudes 10**uniform(lo, hi): sums where the order decides the last bits."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(shape, generator=g) * (hi - lo) + lo)
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return (mag * sign).to(dtype)


def weight_for(H, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.5 * torch.randn(H, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_kernel_matches_reference(dtype, H, eps):
    g = torch.Generator().manual_seed(H + int(eps * 1e7))
    x = (torch.randn(67, H, generator=g) * torch.rand(1, H, generator=g) * 4).to(dtype)
    w = weight_for(H, dtype, H)
    assert_same_bits(rms_norm(x, w, eps), rms_norm_reference(x, w, eps), f"{dtype} H={H}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", HIDDEN)
def test_wide_dynamic_range_matches_reference(dtype, H):
    """Values from 1e-3 to 1e3 in one row: the case where a different summation order shows."""
    x = wide_range((129, H), dtype, seed=H)
    w = weight_for(H, dtype, H + 1)
    assert_same_bits(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), f"{dtype} H={H}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype):
    H = 384
    base = wide_range((40, H + 2 * LANES), dtype, seed=3)
    w = weight_for(H, dtype, 4)
    for x in (base[:, LANES : LANES + H], base[::3, :H], base[5, :H].expand(9, H)):
        assert not x.is_contiguous() and x.stride(1) == 1
        y = rms_norm(x, w, 1e-5)
        assert y.is_contiguous() and y.shape == x.shape
        assert_same_bits(y, rms_norm_reference(x, w, 1e-5), f"strides {x.stride()}")
        assert_same_bits(y, rms_norm(x.contiguous(), w, 1e-5), f"strides {x.stride()} vs contiguous")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [128, 4096])
def test_row_alone_equals_row_in_batch(dtype, H):
    x = wide_range((1000, H), dtype, seed=11)
    w = weight_for(H, dtype, 12)
    y = rms_norm(x, w, 1e-6)
    for i in (0, 1, 499, 998, 999):
        assert_same_bits(rms_norm(x[i : i + 1], w, 1e-6), y[i : i + 1], f"row {i} alone")
    for n in (1, 7, 128, 999):
        assert_same_bits(rms_norm(x[:n], w, 1e-6), y[:n], f"first {n} rows")
    assert_same_bits(rms_norm(x.flip(0), w, 1e-6), y.flip(0), "rows reversed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_follows_documented_order(dtype):
    """The docstring's steps written with numpy float32 scalars, one operation at a time."""
    H, eps = 384, 1e-5
    x = wide_range((3, H), dtype, seed=5)
    w = weight_for(H, dtype, 6)
    np_dtype = np.float32 if dtype == torch.float32 else np.float16
    f32 = np.float32
    expected = np.empty((3, H), dtype=np_dtype)
    for r in range(3):
        xr = x[r].float().numpy()
        acc = [f32(xr[t]) * f32(xr[t]) for t in range(LANES)]
        for c in range(LANES, H, LANES):
            for t in range(LANES):
                acc[t] = f32(acc[t] + f32(xr[c + t]) * f32(xr[c + t]))
        s = LANES // 2
        while s >= 1:
            for t in range(s):
                acc[t] = f32(acc[t] + acc[t + s])
            s //= 2
        inv = f32(1.0) / np.sqrt(f32(acc[0] / f32(H)) + f32(eps))
        normed = (xr * inv).astype(np_dtype)
        expected[r] = (normed.astype(f32) * w.float().numpy()).astype(np_dtype)
    expected = torch.from_numpy(expected)
    assert_same_bits(rms_norm_reference(x, w, eps), expected, "reference vs numpy")
    assert_same_bits(rms_norm(x, w, eps), expected, "kernel vs numpy")


def test_reference_is_an_rms_norm():
    """Up to rounding, the Hugging Face Llama formula."""
    x = wide_range((50, 512), torch.float32, seed=8)
    w = weight_for(512, torch.float32, 9)
    hf = w * (x * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6).float())
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), hf, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_are_flattened(dtype):
    x = wide_range((2, 3, 5, 256), dtype, seed=10)
    w = weight_for(256, dtype, 11)
    for v in (x, x.transpose(0, 1), x[0, 0]):
        y = rms_norm(v, w, 1e-6)
        assert y.shape == v.shape and y.is_contiguous()
        assert_same_bits(y, rms_norm_reference(v, w, 1e-6), f"shape {tuple(v.shape)}")
        assert_same_bits(y.reshape(-1, 256), rms_norm(v.reshape(-1, 256), w, 1e-6), "flattened by hand")


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows(dtype):
    x = wide_range((4, 256), dtype, seed=12)
    x[1] = 0.0
    x[2] = -0.0
    w = weight_for(256, dtype, 13)
    for eps in (1e-6, 1e-5):
        y = rms_norm(x, w, eps)
        assert_same_bits(y, rms_norm_reference(x, w, eps), f"eps={eps}")
        assert not y[1:3].any() and not torch.isnan(y).any()
    y0 = rms_norm(x, w, 0.0)  # 0 * (1 / sqrt(0)) = NaN, as the reference says
    assert_same_bits(y0, rms_norm_reference(x, w, 0.0), "eps=0")
    assert torch.isnan(y0[1:3]).all() and not torch.isnan(y0[[0, 3]]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_inputs_match_reference(dtype):
    x = wide_range((5, 256), dtype, seed=14)
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    x[2, 0] = float("-inf")
    x[3, :] = torch.finfo(dtype).max  # squares overflow to inf
    w = weight_for(256, dtype, 15)
    assert_same_bits(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), "non-finite rows")


@pytest.mark.parametrize("shape", [(0, 256), (0, 3, 128)])
def test_empty_input(shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    w = torch.ones(shape[-1], dtype=torch.bfloat16)
    assert rms_norm(x, w, 1e-6).shape == shape
    assert rms_norm_reference(x, w, 1e-6).shape == shape


def test_output_is_a_new_tensor():
    x = torch.randn(4, 128)
    y = rms_norm(x, torch.ones(128), 1e-6)
    assert y.data_ptr() != x.data_ptr() and y.is_contiguous()


def _x(shape=(4, 256), dtype=torch.bfloat16):
    return torch.randn(shape).to(dtype)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (_x((4, 100)), torch.ones(100, dtype=torch.bfloat16), 1e-6), r"multiple of 128.*H = 100"),
        (lambda: (_x((2, 4, 256)), torch.ones(256, dtype=torch.bfloat16), 1e-6), "x must be 2-D"),
        (lambda: (_x((256, 4)).t(), torch.ones(256, dtype=torch.bfloat16), 1e-6), "last dim must be contiguous"),
        (lambda: (torch.ones(4, 256, dtype=torch.int32), torch.ones(256, dtype=torch.int32), 1e-6),
         "bfloat16, float16 or float32"),
        (lambda: (_x(dtype=torch.float64), torch.ones(256, dtype=torch.float64), 1e-6), "bfloat16, float16 or float32"),
        (lambda: (_x(), torch.ones(128, dtype=torch.bfloat16), 1e-6), r"weight must be 1-D \[H\] = \[256\]"),
        (lambda: (_x(), torch.ones(1, 256, dtype=torch.bfloat16), 1e-6), r"weight must be 1-D \[H\] = \[256\]"),
        (lambda: (_x(), torch.ones(256), 1e-6), "weight must have x's dtype"),
        (lambda: (_x(), torch.ones(512, dtype=torch.bfloat16)[::2], 1e-6), "weight must be contiguous"),
        (lambda: (_x(), torch.ones(256, dtype=torch.bfloat16), -1e-6), "eps must be a finite number >= 0"),
        (lambda: (_x(), torch.ones(256, dtype=torch.bfloat16), float("nan")), "eps must be a finite number >= 0"),
        (lambda: (_x(), torch.ones(256, dtype=torch.bfloat16), float("inf")), "eps must be a finite number >= 0"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(make, message):
    with pytest.raises(RuntimeError, match=message):
        load_extension().rms_norm(*make())


def test_wrapper_rejects_bad_hidden_size_before_the_kernel():
    with pytest.raises(ValueError, match=r"multiple of 128; got H = 200"):
        rms_norm(torch.randn(3, 200), torch.ones(200), 1e-6)
    with pytest.raises(ValueError, match=r"multiple of 128; got H = 200"):
        rms_norm_reference(torch.randn(3, 200), torch.ones(200), 1e-6)
    with pytest.raises(ValueError, match="0-d"):
        rms_norm(torch.tensor(1.0), torch.ones(128), 1e-6)
