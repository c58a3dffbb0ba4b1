"""Rollout engines behind one interface (``base.RolloutEngine``): ``hf`` here; the vLLM engine is
imported from ``megatron_jetrl.rollout.vllm_engine`` where vLLM is installed.

``HfEngine`` (which imports transformers) loads when first used, so the settings and the interface
import quickly for config validation."""

import dataclasses
from typing import Any

import torch

from megatron_jetrl.precision import PrecisionRecipe
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


def build_engine(settings: RolloutSettings, recipe: PrecisionRecipe, hf_config: dict[str, Any], *,
                 device: torch.device, max_model_len: int) -> RolloutEngine:
    """The engine ``settings.engine`` names, with its typed options (``rollout.hf`` /
    ``rollout.vllm``): the policy's HF config and precision recipe; ``max_model_len`` (the job's
    longest prompt + response) is vLLM's default context length. The engine's weights come from
    the weight sync."""
    if settings.engine == "hf":
        from megatron_jetrl.rollout.hf import HfEngine

        return HfEngine(hf_config, recipe, settings.hf, device=device)
    from megatron_jetrl.rollout.vllm_engine import VllmEngine

    options = settings.vllm
    if options.max_model_len is None:
        options = dataclasses.replace(options, max_model_len=max_model_len)
    return VllmEngine(hf_config, recipe, options)


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
    "build_engine",
    "check_against_specs",
]
