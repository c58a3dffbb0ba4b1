"""Where the GPU host's scripts require a GPU (``JETRL_REQUIRE_GPU=1``, hosts/offline/setup.sh), a torch
that sees none fails the GPU tests instead of skipping them all and reporting success."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA GPU: the GPU tests run instead")
def test_gpu_tests_fail_without_a_gpu_when_one_is_required():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu/test_quant_kernels.py"]
    required = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "JETRL_REQUIRE_GPU": "1"})
    assert required.returncode != 0 and "sees no CUDA GPU" in required.stdout + required.stderr
    env = {k: v for k, v in os.environ.items() if k != "JETRL_REQUIRE_GPU"}
    skipped = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    assert skipped.returncode == 0 and "skipped" in skipped.stdout
