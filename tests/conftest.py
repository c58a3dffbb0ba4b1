import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and os.environ.get("JETRL_REQUIRE_GPU") == "1":
        # set by the GPU host's scripts (hosts/offline/setup.sh): there a skipped GPU test is a failure
        raise pytest.UsageError(f"JETRL_REQUIRE_GPU=1 but torch {torch.__version__} sees no CUDA GPU: "
                                f"{len(gpu_items)} GPU tests would skip; run on a GPU machine with a CUDA torch")
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run python -m pytest on a GPU machine with a CUDA torch "
                                   "(README, 'What needs a GPU')")
    for item in gpu_items:
        item.add_marker(skip)
