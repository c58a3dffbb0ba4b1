"""Rollout engines behind one interface (``base.RolloutEngine``), listed in one table
(``engines.ENGINES``): ``hf`` (``rollout/hf_engine.py``) and ``vllm`` (``rollout/vllm_engine.py``, where vLLM
is installed).

``HfEngine`` (which imports transformers) loads when first used, so the settings and the interface
import quickly for config validation."""

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
from megatron_jetrl.rollout.engines import ENGINES, EngineKind, engine_kind
from megatron_jetrl.rollout.settings import HfOptions, RolloutSettings, VllmOptions


def build_engine(settings: RolloutSettings, recipe: PrecisionRecipe, hf_config: dict[str, Any], *,
                 device: torch.device, max_model_len: int) -> RolloutEngine:
    """The engine ``settings.engine`` names (its ``ENGINES`` entry's factory), with its own options
    section: the policy's HF config and precision recipe; ``max_model_len`` (the job's longest prompt
    + response) is the default context length of an engine that takes one. The engine's weights come
    from the weight sync."""
    return engine_kind(settings).build(settings.options, recipe, hf_config, device=device, max_model_len=max_model_len)


def __getattr__(name: str):
    if name == "HfEngine":
        from megatron_jetrl.rollout.hf_engine import HfEngine

        return HfEngine
    raise AttributeError(f"module 'megatron_jetrl.rollout' has no attribute {name!r}")


__all__ = [
    "ENGINES",
    "EngineKind",
    "FinishReason",
    "HfEngine",
    "HfOptions",
    "RolloutEngine",
    "RolloutSettings",
    "Sample",
    "SamplingParams",
    "TensorMeta",
    "VllmOptions",
    "WeightMismatch",
    "build_engine",
    "engine_kind",
    "check_against_specs",
]
