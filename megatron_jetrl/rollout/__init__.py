"""Rollout engines behind one interface (``base.RolloutEngine``): ``hf`` here; the vLLM engine is
imported from ``megatron_jetrl.rollout.vllm_engine`` where vLLM is installed."""

from megatron_jetrl.rollout.base import (
    FinishReason,
    RolloutEngine,
    Sample,
    SamplingParams,
    TensorMeta,
    WeightMismatch,
    check_against_specs,
)
from megatron_jetrl.rollout.hf import HfEngine

__all__ = [
    "FinishReason",
    "HfEngine",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "TensorMeta",
    "WeightMismatch",
    "check_against_specs",
]
