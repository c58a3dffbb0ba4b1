"""Tiny random Hugging Face models of every supported family, built from configs (no downloads).

Dims are multiples of 128 where the FP8 export needs them; the vocab (1000) is not, so vocab
padding is exercised; 4 KV heads allow TP up to 4.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import transformers

FAMILIES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]

_COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1000,
    max_position_embeddings=16384,
    rms_norm_eps=1e-5,
)
_CONFIGS = {
    "LlamaForCausalLM": (transformers.LlamaConfig, dict(
        head_dim=64, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "Qwen3ForCausalLM": (transformers.Qwen3Config, dict(head_dim=128, tie_word_embeddings=False,
                                                         rope_theta=1000000.0)),
}


def tiny_hf_model(arch: str, num_layers: int = 2, seed: int = 0) -> transformers.PreTrainedModel:
    config_cls, extra = _CONFIGS[arch]
    config = config_cls(**{**_COMMON, "num_hidden_layers": num_layers}, **extra)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)  # norms too: random values catch any mix-up of norm weights
    return model.eval()


def save_tiny_hf(
    arch: str, directory: Path, num_layers: int = 2, shard_size: str = "300KB"
) -> transformers.PreTrainedModel:
    """A tiny model saved as sharded safetensors (several shards + index), plus a config."""
    model = tiny_hf_model(arch, num_layers)
    model.save_pretrained(directory, max_shard_size=shard_size)
    return model


def load_tool(name: str):
    """``main`` of ``tools/<name>.py`` (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main
