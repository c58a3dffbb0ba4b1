"""The supported architecture families: what each reads differently from its config.

``hf_norm`` names the family's RMSNorm class in transformers' ``modeling_<model_type>`` module (a
string: models/ does not import transformers); the hf rollout engine swaps those norms for torch's.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models.bridge import ModelBridge, positive_number

# megatron-core's llama3 rope scaling (RotaryEmbedding._apply_scaling) hard-codes these.
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class LlamaBridge(ModelBridge):
    """Llama 2/3.x: optional attention bias, llama3 rope scaling, tied embeddings in the 1B/3B."""

    architecture = "LlamaForCausalLM"
    model_type = "llama"
    hf_norm = "LlamaRMSNorm"

    def _read_dims(self, c: dict):
        if c.get("mlp_bias"):
            raise ConfigError("config.json:mlp_bias", True, "MLP biases are not supported")
        return super()._read_dims(c)

    def _rope_scaling_factor(self, scaling: Mapping[str, Any] | None) -> float | None:
        if not scaling:
            return None
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ConfigError("config.json:rope_scaling.rope_type", kind, "only 'llama3' rope scaling is supported")
        for key, expected in _MCORE_LLAMA3_ROPE.items():
            if positive_number(f"config.json:rope_scaling.{key}", scaling.get(key, expected)) != expected:
                raise ConfigError(f"config.json:rope_scaling.{key}", scaling.get(key),
                                  f"megatron-core's llama3 rope scaling fixes it to {expected}")
        if scaling.get("factor") is None:
            raise ConfigError("config.json:rope_scaling.factor", None, "required with llama3 rope scaling")
        return positive_number("config.json:rope_scaling.factor", scaling["factor"])


class Qwen2Bridge(ModelBridge):
    """Qwen2 / Qwen2.5: QKV biases always, tied embeddings in the small models, no sliding window."""

    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    hf_norm = "Qwen2RMSNorm"

    def _qkv_bias(self, c: dict) -> bool:
        return True


class Qwen3Bridge(ModelBridge):
    """Qwen3 dense: RMSNorm on q and k per head (qk-norm), explicit head_dim, no QKV bias."""

    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    hf_norm = "Qwen3RMSNorm"

    def _qk_norm(self, c: dict) -> bool:
        return True
