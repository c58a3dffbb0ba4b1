"""The ``vllm`` engine's seeded sampling: the exponential noise of every seeded request in one kernel.

The trainer gives every rollout request its own seed (``run.seed``, step, round, replica: the same
rollouts after a resume). vLLM then keeps one ``torch.Generator`` per request and its sampler
(``random_sample`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``, the same in 0.26 and 0.32) fills
each request's row of the noise with its own ``exponential_`` call, every decode step: at 128
requests 1.1 ms of Python and launches per step on an H200 while the GPU waits, a fifth of a 16-layer
decode step (``benchmarks/bench_sampler.py``). ``install`` replaces that function, for the engines
this process builds afterwards, by one that fills every seeded row with ``ops.sampling``'s
kernel and then draws as vLLM does (``argmax(probs / q)``).

What stays vLLM's: which requests are seeded, the generators themselves (their seed, and the offset
vLLM rewinds when it discards a partial prefill's token; ``ops.sampling.OFFSET_STEP``), the rows
without a seed, the FP64 Gumbel option and every platform but CUDA (all of them go to vLLM's own
function). What changes: the numbers of the seeded stream (Philox words read by ``ops.sampling``,
not torch's ``exponential_``), so a seeded run draws other, equally distributed, tokens than the
same run did before this replacement. Logprobs are untouched (they come from the logits, not the
noise), and so is the exact mode.

vLLM offers no way to hand its sampler another noise source, so this replaces the module's function
(as ``vllm_exact`` does for the TP group's all-reduce); ``install`` checks that the function still
has the signature it replaces and refuses, naming the vLLM version, where it does not.
"""

from __future__ import annotations

import inspect
import sys
from types import ModuleType
from typing import Callable

import torch

from megatron_jetrl.ops.sampling import seeded_exponential_

RANDOM_SAMPLE_PARAMETERS = ("probs", "generators", "use_fp64_gumbel")
"""The parameters of vLLM's ``random_sample`` that the replacement takes, in order."""


def sampler_module() -> ModuleType:
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    return sys.modules[TopKTopPSampler.__module__]


def batched_random_sample(original: Callable, module: ModuleType) -> Callable:
    """vLLM's ``random_sample`` with the seeded rows' noise from one kernel; ``original`` (vLLM's)
    for whatever it does not cover (no seeded row, FP64 Gumbel noise, probabilities off CUDA)."""

    def random_sample(probs: torch.Tensor, generators: dict, use_fp64_gumbel: bool = False) -> torch.Tensor:
        if not generators or use_fp64_gumbel or not probs.is_cuda or probs.dtype != torch.float32:
            return original(probs, generators, use_fp64_gumbel)
        q = torch.empty_like(probs)
        if len(generators) != probs.shape[0]:
            q.exponential_()  # the rows without a seed, from the global generator, as vLLM draws them
        seeded_exponential_(q, generators)
        return module.sample_with_exponential_noise(probs, q)

    random_sample.jetrl_original = original
    return random_sample


def install() -> None:
    """Make vLLM's sampler draw the noise of seeded requests with ``batched_random_sample`` in this
    process (before ``vllm.LLM`` builds its model; installing again is a no-op)."""
    module = sampler_module()
    current = module.random_sample
    if getattr(current, "jetrl_original", None) is not None:
        return
    names = tuple(inspect.signature(current).parameters)
    if names != RANDOM_SAMPLE_PARAMETERS or not callable(getattr(module, "sample_with_exponential_noise", None)):
        import vllm

        raise RuntimeError(f"vLLM {vllm.__version__}: {module.__name__}.random_sample{names} or its "
                           "sample_with_exponential_noise is not the sampler rollout/vllm_sampling.py replaces "
                           f"(random_sample{RANDOM_SAMPLE_PARAMETERS}); update it for this version")
    module.random_sample = batched_random_sample(current, module)


def uninstall() -> None:
    """Give vLLM its own ``random_sample`` back (tests; engines built afterwards)."""
    module = sampler_module()
    original = getattr(module.random_sample, "jetrl_original", None)
    if original is not None:
        module.random_sample = original


def installed() -> bool:
    """Whether vLLM's sampler draws seeded noise with ``batched_random_sample`` in this process."""
    return getattr(sampler_module().random_sample, "jetrl_original", None) is not None
