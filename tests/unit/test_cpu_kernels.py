"""The C++ CPU kernels equal the torch reference bit for bit, and validate their inputs."""

import pytest
import torch

from megatron_jetrl.ops import NativeQuantizer, load_extension, quantize_1x128, quantize_128x128
from megatron_jetrl.precision import Fp8Tensor, ReferenceQuantizer, quantize_fp8_blockwise, transpose_blocks
from tests.helpers import adversarial_matrix, assert_kernels_match_reference, assert_same_bytes

SHAPES = [(1, 1), (1, 128), (128, 128), (5, 300), (300, 5), (257, 129), (129, 1), (200, 384)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_random_inputs_match_reference(dtype, shape, pow2, eps):
    g = torch.Generator().manual_seed(shape[0] * 7919 + shape[1] + pow2)
    x = (torch.randn(shape, generator=g) * torch.logspace(-5, 2, shape[1]) * 50).to(dtype)
    assert_kernels_match_reference(x, pow2, eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [0.0, 1e-4])
@pytest.mark.parametrize("pow2", [False, True])
def test_adversarial_inputs_match_reference(dtype, eps, pow2):
    """Zeros, -0.0, dtype max, subnormals, ties and NaN/Inf blocks: the cases a kernel gets wrong."""
    x = adversarial_matrix(dtype)
    assert_kernels_match_reference(x, pow2, eps)


@pytest.mark.parametrize("shape", [(1, 1), (5, 300), (257, 129)])
def test_1x128_scales_are_group_major(shape):
    """1x128 scales come back with strides (1, rows), the layout the blockwise GEMM reads."""
    x = torch.randn(shape)
    row, col = quantize_1x128(x, rowwise=True, columnwise=True)
    assert row.scale_inv.shape == (shape[0], -(-shape[1] // 128))
    assert row.scale_inv.stride() == (1, shape[0])
    assert col.scale_inv.shape == (shape[1], -(-shape[0] // 128))
    assert col.scale_inv.stride() == (1, shape[1])
    assert row.data.is_contiguous() and col.data.is_contiguous()


def test_128x128_transpose_equals_transpose_blocks():
    x = torch.randn(300, 200, dtype=torch.bfloat16)
    blocks, transposed = quantize_128x128(x, with_transpose=True)
    expected = transpose_blocks(Fp8Tensor(blocks.data, blocks.scale_inv, (128, 128)))
    assert_same_bytes(transposed.data, expected.data, "transposed codes")
    assert_same_bytes(transposed.scale_inv, expected.scale_inv, "transposed scales")


@pytest.mark.parametrize("shape", [(0, 300), (0, 0), (5, 0)])
def test_empty_inputs(shape):
    x = torch.zeros(shape, dtype=torch.bfloat16)
    row, col = quantize_1x128(x, rowwise=True, columnwise=True)
    assert_same_bytes(row.data, quantize_fp8_blockwise(x, (1, 128))[0], "empty rowwise codes")
    assert row.scale_inv.shape == quantize_fp8_blockwise(x, (1, 128))[1].shape
    assert col.data.shape == (shape[1], shape[0])
    assert col.scale_inv.shape == quantize_fp8_blockwise(x.t(), (1, 128))[1].shape
    blocks, transposed = quantize_128x128(x, with_transpose=True)
    assert blocks.data.shape == shape and transposed.data.shape == (shape[1], shape[0])
    assert blocks.scale_inv.shape == quantize_fp8_blockwise(x, (128, 128))[1].shape


@pytest.mark.parametrize("op", ["1x128", "128x128"])
@pytest.mark.parametrize(
    "x, match",
    [
        (torch.zeros(130, 4).t(), r"must be contiguous.*strides"),
        (torch.zeros(2, 3, 4), r"must be 2-D \[M, K\]; got 3-D"),
        (torch.zeros(4, 4, dtype=torch.int32), r"bfloat16, float16 or float32; got Int"),
        (torch.zeros(4, 4, dtype=torch.float64), r"bfloat16, float16 or float32; got Double"),
    ],
)
def test_kernel_validation_errors(op, x, match):
    with pytest.raises(RuntimeError, match=rf"quantize_{op}: .*{match}"):
        if op == "1x128":
            quantize_1x128(x, rowwise=True, columnwise=True)
        else:
            quantize_128x128(x, with_transpose=True)


def test_1x128_needs_rowwise_or_columnwise():
    with pytest.raises(RuntimeError, match="ask for rowwise, columnwise or both"):
        quantize_1x128(torch.zeros(4, 4), rowwise=False, columnwise=False)


def test_kernel_rejects_bad_eps_itself():
    """The binding checks eps even when called without the Python wrapper's check."""
    with pytest.raises(RuntimeError, match="eps must be a finite number >= 0"):
        load_extension().quantize_128x128(torch.zeros(4, 4), False, False, -1.0)
    with pytest.raises(RuntimeError, match="eps must be a finite number >= 0"):
        load_extension().quantize_1x128(torch.zeros(4, 4), True, False, False, float("nan"))


def test_wrapper_rejects_bad_eps():
    with pytest.raises(ValueError, match="eps"):
        quantize_1x128(torch.zeros(4, 4), eps=-1.0)
    with pytest.raises(ValueError, match="eps"):
        NativeQuantizer(eps=float("inf"))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_native_quantizer_equals_reference_quantizer(pow2, eps):
    native, ref = NativeQuantizer(pow2_scales=pow2, eps=eps), ReferenceQuantizer(pow2_scales=pow2, eps=eps)
    x = adversarial_matrix(torch.bfloat16)
    for rowwise, columnwise in [(True, True), (True, False), (False, True)]:
        got, want = native.quantize_groups(x, rowwise=rowwise, columnwise=columnwise), ref.quantize_groups(
            x, rowwise=rowwise, columnwise=columnwise
        )
        for g, w, what in zip(got, want, ("rowwise", "columnwise"), strict=True):
            assert (g is None) == (w is None), what
            if w is not None:
                assert g.block_shape == w.block_shape
                assert_same_bytes(g.data, w.data, f"{what} codes")
                assert_same_bytes(g.scale_inv, w.scale_inv, f"{what} scales")
    assert native.quantize_groups(x, rowwise=False, columnwise=False) == (None, None)
    w = torch.randn(300, 200) * 0.02
    for weight in (w, w.t()):
        got, want = native.quantize_weight(weight), ref.quantize_weight(weight)
        for part in ("fprop", "dgrad"):
            g, e = getattr(got, part), getattr(want, part)
            assert g.block_shape == e.block_shape == (128, 128)
            assert_same_bytes(g.data, e.data, f"{part} codes")
            assert_same_bytes(g.scale_inv, e.scale_inv, f"{part} scales")
