"""The engine's seeded sampling against the installed vLLM (0.32), on the CPU: ``install`` replaces the
``random_sample`` that vLLM's sampler calls (the function its ``TopKTopPSampler`` looks up when it
samples), installing twice is a no-op, ``uninstall`` gives vLLM its own back, a sampler whose function
has another signature is refused by name, and off CUDA the replacement leaves the draw to vLLM's own
function. (The kernel's draws on CUDA generators: tests/gpu/test_sampling_gpu.py.)"""

import pytest

vllm = pytest.importorskip("vllm", reason="vllm not installed; runs in the vLLM venv of .ci/run")

import torch  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler  # noqa: E402

from megatron_jetrl.rollout import vllm_sampling  # noqa: E402


@pytest.fixture
def vllm_sampler():
    module = vllm_sampling.sampler_module()
    original = module.random_sample
    yield module, original
    vllm_sampling.uninstall()
    assert module.random_sample is original


def test_install_replaces_the_function_vllms_sampler_calls(vllm_sampler):
    module, original = vllm_sampler
    vllm_sampling.install()
    assert vllm_sampling.installed()
    replaced = module.random_sample
    assert replaced is not original and replaced.jetrl_original is original
    assert TopKTopPSampler.forward_native.__globals__["random_sample"] is replaced  # looked up when it samples
    vllm_sampling.install()
    assert module.random_sample is replaced
    vllm_sampling.uninstall()
    assert module.random_sample is original and not vllm_sampling.installed()


def test_off_cuda_the_draw_is_vllms_own(vllm_sampler):
    module, original = vllm_sampler
    vllm_sampling.install()
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)), dim=-1)

    def draw(fn):
        gens = {1: torch.Generator().manual_seed(5), 3: torch.Generator().manual_seed(6)}
        torch.manual_seed(0)
        return fn(probs.clone(), gens)

    assert torch.equal(draw(module.random_sample), draw(original))


def test_a_sampler_of_another_shape_is_refused_by_name(vllm_sampler, monkeypatch):
    module, _ = vllm_sampler
    monkeypatch.setattr(module, "random_sample", lambda probs, generators: None)
    with pytest.raises(RuntimeError, match=rf"vLLM {vllm.__version__}: .*random_sample\('probs', 'generators'\).*"
                                           r"update it for this version"):
        vllm_sampling.install()
