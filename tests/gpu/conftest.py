import pytest
import torch

from megatron_jetrl.precision import scaled_mm_supported


@pytest.fixture
def hopper():
    """The FP8 GEMM tests need torch's blockwise scaled_mm: fail, not skip, on a GPU host without it
    so a wrong host or torch is noticed."""
    device = torch.device("cuda")
    assert scaled_mm_supported(device), (
        f"blockwise scaled_mm unavailable on {torch.cuda.get_device_name()} with torch {torch.__version__}"
    )
    return device
