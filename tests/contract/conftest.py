"""Contract tests against the installed vLLM (the vLLM venv of ``.ci/run``; skipped elsewhere).

vLLM picks its platform on first use from ``VLLM_TARGET_DEVICE``: these tests build vLLM's model
classes on its CPU platform, so the variable is set here, before any test module imports vLLM.
(The test process plays the launcher; the package itself never sets environment variables.)
vLLM also reads the host CPU's features (AMX); what the tests' models depend on is pinned where
they are built, in ``tests/contract/vllm_cpu.py`` (imported by spawned workers too).
"""

import os

import pytest

os.environ["VLLM_TARGET_DEVICE"] = "cpu"


@pytest.fixture(scope="session")
def vllm_world(tmp_path_factory):
    """vLLM's world and TP groups on gloo: once per process (vLLM refuses a second set)."""
    pytest.importorskip("vllm", reason="vllm not installed; runs in the vLLM venv of .ci/run")
    from tests.contract.vllm_cpu import init_vllm_distributed

    init_vllm_distributed(tmp_path_factory.mktemp("vllm-dist") / "store")
