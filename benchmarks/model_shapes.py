"""The model every benchmark measures: Qwen3-8B's config (36 layers) with a chosen layer count.
Random weights are made by each benchmark; no download."""


def qwen3_8b_shaped(num_layers: int = 36) -> dict:
    """An HF config.json dict of Qwen3-8B with ``num_layers`` decoder layers."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": num_layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    }
