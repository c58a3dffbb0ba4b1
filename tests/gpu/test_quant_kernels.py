"""The CUDA quantization kernels equal the torch reference bit for bit (codes and scales)."""

import pytest
import torch

from megatron_jetrl.ops import cuda_kernels_available, quantize_1x128, quantize_128x128
from megatron_jetrl.precision import quantize_fp8_blockwise
from tests.helpers import adversarial_matrix, assert_same_bytes

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (1, 128), (128, 128), (5, 300), (300, 5), (257, 129), (1000, 4104), (129, 1), (4096, 384)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_extension_has_cuda_kernels():
    assert cuda_kernels_available(), "megatron_jetrl._C was built without CUDA; rebuild on the GPU host"


def _check_1x128(x, pow2, eps):
    row, col = quantize_1x128(x, rowwise=True, columnwise=True, pow2_scales=pow2, eps=eps)
    for device_ref in (x, x.cpu()):
        data, scale = quantize_fp8_blockwise(device_ref, (1, 128), pow2_scales=pow2, eps=eps)
        assert_same_bytes(row.data, data, "rowwise codes")
        assert_same_bytes(row.scale_inv, scale, "rowwise scale_inv")
        data_t, scale_t = quantize_fp8_blockwise(device_ref.t(), (1, 128), pow2_scales=pow2, eps=eps)
        assert_same_bytes(col.data, data_t, "columnwise codes")
        assert_same_bytes(col.scale_inv, scale_t, "columnwise scale_inv")
    only_row, none = quantize_1x128(x, rowwise=True, columnwise=False, pow2_scales=pow2, eps=eps)
    assert none is None
    assert_same_bytes(only_row.data, row.data, "rowwise-only codes")
    none, only_col = quantize_1x128(x, rowwise=False, columnwise=True, pow2_scales=pow2, eps=eps)
    assert none is None
    assert_same_bytes(only_col.data, col.data, "columnwise-only codes")


def _check_128x128(x, pow2, eps):
    blocks, transposed = quantize_128x128(x, with_transpose=True, pow2_scales=pow2, eps=eps)
    for device_ref in (x, x.cpu()):
        data, scale = quantize_fp8_blockwise(device_ref, (128, 128), pow2_scales=pow2, eps=eps)
        assert_same_bytes(blocks.data, data, "block codes")
        assert_same_bytes(blocks.scale_inv, scale, "block scale_inv")
        data_t, scale_t = quantize_fp8_blockwise(device_ref.t(), (128, 128), pow2_scales=pow2, eps=eps)
        assert_same_bytes(transposed.data, data_t, "transposed block codes")
        assert_same_bytes(transposed.scale_inv, scale_t, "transposed block scale_inv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_random_inputs_match_reference(dtype, shape, pow2):
    g = torch.Generator(device="cuda").manual_seed(hash((shape, pow2)) % 2**31)
    x = (torch.randn(shape, device="cuda", generator=g) * torch.rand(1, device="cuda", generator=g) * 50).to(dtype)
    _check_1x128(x, pow2, 0.0)
    _check_128x128(x, pow2, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [0.0, 1e-4])
@pytest.mark.parametrize("pow2", [False, True])
def test_adversarial_inputs_match_reference(dtype, eps, pow2):
    x = adversarial_matrix(dtype).cuda()
    _check_1x128(x, pow2, eps)
    _check_128x128(x, pow2, eps)


def test_misaligned_input_takes_scalar_path():
    buf = torch.randn(300 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    x = buf[1:].view(300, 256)
    assert x.data_ptr() % 16 != 0 and x.is_contiguous()
    _check_1x128(x, False, 0.0)
    _check_128x128(x, False, 0.0)


def test_large_activation_matches_reference():
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    _check_1x128(x, False, 0.0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: torch.randn(4, 256, device="cuda").t(), "contiguous"),
        (lambda: torch.randn(2, 4, 256, device="cuda"), "2-D"),
        (lambda: torch.ones(4, 256, device="cuda", dtype=torch.int32), "bfloat16, float16 or float32"),
        (lambda: torch.randn(4, 256, device="cuda", dtype=torch.float64), "bfloat16, float16 or float32"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(make, message):
    with pytest.raises(RuntimeError, match=message):
        quantize_1x128(make())
    with pytest.raises(RuntimeError, match=message):
        quantize_128x128(make())


def test_empty_input():
    row, col = quantize_1x128(torch.empty(0, 256, device="cuda"), rowwise=True, columnwise=True)
    assert row.data.shape == (0, 256) and row.scale_inv.shape == (0, 2)
    assert col.data.shape == (256, 0) and col.scale_inv.shape == (256, 0)
