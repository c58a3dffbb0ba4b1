import importlib.util
import os

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


requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("JETRL_REQUIRE_VLLM") != "1",
    reason="vLLM is not installed here: pip install 'megatron-jetrl[vllm]' (the offline host: hosts/offline/vllm.sh)")
"""For tests of the vllm engine: skipped where vLLM is not installed, unless ``JETRL_REQUIRE_VLLM=1``
(hosts/offline/vllm.sh sets it once it installed vLLM) makes a missing vLLM fail; a vLLM that is
installed but broken always fails."""
