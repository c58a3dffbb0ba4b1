"""Per-architecture bridges between Hugging Face checkpoints and megatron-core.

``bridge_for(config)`` picks the bridge from an explicit registry keyed by the HF
``architectures`` entry (falling back to ``model_type``); names are matched exactly.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models.bridge import ModelBridge, ModelDims, ParallelLayout, TensorSpec
from megatron_jetrl.models.families import LlamaBridge, Qwen2Bridge, Qwen3Bridge

BRIDGES: dict[str, type[ModelBridge]] = {b.architecture: b for b in (LlamaBridge, Qwen2Bridge, Qwen3Bridge)}
_BY_MODEL_TYPE: dict[str, type[ModelBridge]] = {b.model_type: b for b in BRIDGES.values()}


def bridge_for(hf_config: Mapping[str, Any]) -> ModelBridge:
    """The bridge for an HF ``config.json`` (as a dict)."""
    architectures = hf_config.get("architectures") or []
    for arch in architectures:
        if arch in BRIDGES:
            return BRIDGES[arch](hf_config)
    model_type = hf_config.get("model_type")
    if not architectures and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type](hf_config)
    raise ConfigError(
        "config.json:architectures",
        architectures or model_type,
        f"unsupported architecture; supported: {', '.join(sorted(BRIDGES))}",
    )


__all__ = ["BRIDGES", "ModelBridge", "ModelDims", "ParallelLayout", "TensorSpec", "bridge_for"]
