"""The ``rollout`` section of a job: which engine, how it samples, and its own options.

The number of samples per prompt is ``algo.group_size`` and the sampling seed derives from
``run.seed`` and the step, so ``rollout.sampling`` holds neither (the job sets them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_jetrl.config import ConfigError, check_fields, check_integer
from megatron_jetrl.rollout.base import SamplingParams
from megatron_jetrl.rollout.vllm_engine import VllmOptions

ENGINES = ("hf", "vllm")
"""The ``rollout.engine`` choices (``RolloutSettings.engine``'s ``Literal``; a test keeps them equal)."""


@dataclass(frozen=True)
class HfOptions:
    """The ``rollout.hf`` section (see ``HfEngine``): batch limits of the transformers engine, and
    what its sleep does with the weights: drop them (default; the next sync overwrites them all
    anyway, so copying them to host and back each step would only cost time and host memory) or,
    with ``sleep_keeps_weights``, keep them in (pinned) host memory for a later wake."""

    max_num_seqs: int = 256
    max_batch_tokens: int = 131072
    max_prefill_tokens: int = 16384
    cuda_graphs: bool = True
    gemm: Literal["auto", "scaled_mm", "emulate"] = "auto"
    sleep_keeps_weights: bool = False

    def __post_init__(self) -> None:
        check_fields(self, "rollout.hf")
        for name in ("max_num_seqs", "max_batch_tokens", "max_prefill_tokens"):
            check_integer(f"rollout.hf.{name}", getattr(self, name), minimum=1)


@dataclass(frozen=True)
class RolloutSettings:
    """``engine``: ``hf`` (transformers, this project's FP8 linears; rollout TP 1) or ``vllm``
    (production). ``offload_actor``: while the engine generates, the actor's parameters and
    optimizer state wait in host memory, and the engine sleeps while the actor trains (colocation;
    turn off only when both fit on the GPU at once)."""

    engine: Literal["hf", "vllm"] = "hf"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    hf: HfOptions = field(default_factory=HfOptions)
    vllm: VllmOptions = field(default_factory=VllmOptions)
    offload_actor: bool = True

    def __post_init__(self) -> None:
        check_fields(self, "rollout", ("engine", "offload_actor"))
        if self.engine == "hf" and self.vllm.kv_cache_dtype != "auto":
            raise ConfigError("rollout.vllm.kv_cache_dtype", self.vllm.kv_cache_dtype,
                              "an FP8 KV cache needs rollout.engine=vllm (the hf engine keeps it in the model dtype)")

    @property
    def tp(self) -> int:
        """Tensor-parallel size of one rollout engine."""
        return self.vllm.tensor_parallel_size if self.engine == "vllm" else 1

    @property
    def fp8_kv_cache(self) -> bool:
        return self.engine == "vllm" and self.vllm.kv_cache_dtype == "fp8"

