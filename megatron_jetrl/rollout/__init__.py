"""Rollout engines behind one interface (``base.RolloutEngine``): ``hf`` here; the vLLM engine is
imported from ``megatron_jetrl.rollout.vllm_engine`` where vLLM is installed.

``HfEngine`` (which imports transformers) loads when first used, so the settings and the interface
import quickly for config validation."""

from megatron_jetrl.rollout.base import (
    FinishReason,
    RolloutEngine,
    Sample,
    SamplingParams,
    TensorMeta,
    WeightMismatch,
    check_against_specs,
)
from megatron_jetrl.rollout.settings import ENGINES, HfOptions, RolloutSettings


def __getattr__(name: str):
    if name == "HfEngine":
        from megatron_jetrl.rollout.hf import HfEngine

        return HfEngine
    raise AttributeError(f"module 'megatron_jetrl.rollout' has no attribute {name!r}")


__all__ = [
    "ENGINES",
    "FinishReason",
    "HfEngine",
    "HfOptions",
    "RolloutEngine",
    "RolloutSettings",
    "Sample",
    "SamplingParams",
    "TensorMeta",
    "WeightMismatch",
    "check_against_specs",
]
