"""The models the benchmarks measure, at real Qwen3 shapes with a chosen layer count (random
weights are made by each benchmark; no download), and what share of a step's linear-layer FLOPs the
LM head takes (it stays BF16 in every mode, so a shallow model understates the FP8 gain)."""

QWEN3 = {
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "tie_word_embeddings": False},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "tie_word_embeddings": True},
}
"""The sizes that differ between the Qwen3 models measured (their config.json values)."""


def qwen3_shaped(model: str, num_layers: int | None = None) -> dict:
    """An HF config.json dict of ``model`` (a key of ``QWEN3``) with ``num_layers`` decoder layers
    (default: all of them)."""
    if model not in QWEN3:
        raise ValueError(f"model {model!r}: one of {sorted(QWEN3)}")
    sizes = dict(QWEN3[model])
    if num_layers is not None:
        sizes["num_hidden_layers"] = num_layers
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, **sizes,
    }


def qwen3_8b_shaped(num_layers: int = 36) -> dict:
    """An HF config.json dict of Qwen3-8B with ``num_layers`` decoder layers."""
    return qwen3_shaped("qwen3-8b", num_layers)


def lm_head_flop_share(config: dict) -> float:
    """The LM head's share of the FLOPs of all linear layers per token (decoder linears + LM head;
    forward, backward and the logprob pass all scale alike)."""
    h, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * ffn * h  # qkv, o, gate+up, down
    head = config["vocab_size"] * h
    return head / (layers * per_layer + head)
