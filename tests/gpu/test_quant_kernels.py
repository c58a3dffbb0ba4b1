"""The CUDA quantization kernels equal the torch reference bit for bit (codes and scales)."""

import pytest
import torch

from megatron_jetrl.ops import cuda_kernels_available, quantize_1x128, quantize_128x128
from tests.helpers import adversarial_matrix, assert_kernels_match_reference

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (1, 128), (128, 128), (5, 300), (300, 5), (257, 129), (1000, 4104), (129, 1), (4096, 384)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def test_extension_has_cuda_kernels():
    assert cuda_kernels_available(), "megatron_jetrl._C was built without CUDA; rebuild on the GPU host"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pow2", [False, True])
def test_random_inputs_match_reference(dtype, shape, pow2):
    g = torch.Generator(device="cuda").manual_seed(hash((shape, pow2)) % 2**31)
    x = (torch.randn(shape, device="cuda", generator=g) * torch.rand(1, device="cuda", generator=g) * 50).to(dtype)
    assert_kernels_match_reference(x, pow2, 0.0, (x, x.cpu()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [0.0, 1e-4])
@pytest.mark.parametrize("pow2", [False, True])
def test_adversarial_inputs_match_reference(dtype, eps, pow2):
    x = adversarial_matrix(dtype).cuda()
    assert_kernels_match_reference(x, pow2, eps, (x, x.cpu()))


def test_misaligned_input_takes_scalar_path():
    buf = torch.randn(300 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    x = buf[1:].view(300, 256)
    assert x.data_ptr() % 16 != 0 and x.is_contiguous()
    assert_kernels_match_reference(x, False, 0.0, (x, x.cpu()))


def test_large_activation_matches_reference():
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    assert_kernels_match_reference(x, False, 0.0, (x, x.cpu()))


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
