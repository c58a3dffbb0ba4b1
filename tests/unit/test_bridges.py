"""Model bridges: config translation, the tensor map's round trip, and TP shards of the fused tensors
against an independent per-rank construction."""

import pytest
import torch

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import BRIDGES, ParallelLayout, bridge_for
from tests.model_fixtures import FAMILIES, tiny_hf_model


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_hf_model(request.param)
    return request.param, model.config.to_dict(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_registry_is_explicit():
    assert set(BRIDGES) == {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def test_round_trip_every_tensor_is_bit_exact(family):
    arch, config, sd = family
    bridge = bridge_for(config)
    seen = set()
    for spec in bridge.tensor_map():
        full = bridge.to_megatron(spec, sd.__getitem__)
        assert tuple(full.shape) == spec.shape, spec.megatron
        for name, t in bridge.to_hf(spec, full).items():
            assert torch.equal(t, sd[name]) and t.dtype == sd[name].dtype, name
            seen.add(name)
    expected = set(sd) - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    assert seen == expected


def _rank_qkv(q, k, v, heads, groups, d, rank, tp):
    """Rank r of TP holds groups [r*G/tp, (r+1)*G/tp); for each, its q heads, then k, then v."""
    per_rank, p = groups // tp, heads // groups
    rows = []
    for g in range(rank * per_rank, (rank + 1) * per_rank):
        rows += [q[h * d:(h + 1) * d] for h in range(g * p, (g + 1) * p)]
        rows += [k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(rows)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_of_fused_tensors_match_an_independent_construction(family, tp):
    arch, config, sd = family
    bridge = bridge_for(config)
    d = bridge.dims
    bridge.check_layout(ParallelLayout(tp=tp))
    for spec in bridge.layer_map(1):
        full = bridge.to_megatron(spec, sd.__getitem__)
        for rank in range(tp):
            shard = bridge.tp_shard(spec, full, rank, tp)
            if spec.megatron.endswith("linear_qkv.weight") or spec.megatron.endswith("linear_qkv.bias"):
                q, k, v = (sd[n] for n in spec.hf)
                want = _rank_qkv(q, k, v, d.num_heads, d.num_groups, d.head_dim, rank, tp)
            elif spec.megatron.endswith("linear_fc1.weight"):
                gate, up = (sd[n] for n in spec.hf)
                f = d.ffn_hidden_size // tp
                want = torch.cat([gate[rank * f:(rank + 1) * f], up[rank * f:(rank + 1) * f]])
            elif spec.megatron.endswith("linear_proj.weight") or spec.megatron.endswith("linear_fc2.weight"):
                w = sd[spec.hf[0]]
                c = w.shape[1] // tp
                want = w[:, rank * c:(rank + 1) * c]
            else:
                want = sd[spec.hf[0]]
            assert torch.equal(shard, want), (spec.megatron, rank)


def test_vocab_is_padded_to_128_times_tp(family):
    arch, config, sd = family
    bridge = bridge_for(config)
    assert bridge.padded_vocab_size(1) % 128 == 0 and bridge.padded_vocab_size(4) % 512 == 0
    spec = bridge.tensor_map()[0]
    full = bridge.to_megatron(spec, sd.__getitem__)
    assert full.shape[0] == bridge.padded_vocab_size(1)
    assert torch.count_nonzero(full[bridge.dims.vocab_size:]) == 0
    shards = [bridge.tp_shard(spec, full, r, 4) for r in range(4)]
    assert sum(s.shape[0] for s in shards) == bridge.padded_vocab_size(4)


def test_transformer_config_kwargs_carry_the_architecture(family):
    arch, config, sd = family
    bridge = bridge_for(config)
    kw = bridge.transformer_config_kwargs(ParallelLayout(tp=2, pp=2))
    d = bridge.dims
    assert kw["num_query_groups"] == d.num_groups and kw["kv_channels"] == d.head_dim
    assert kw["add_qkv_bias"] == (arch == "Qwen2ForCausalLM")
    assert kw["qk_layernorm"] == (arch == "Qwen3ForCausalLM")
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and not kw["add_bias_linear"]
    gpt = bridge.gpt_model_kwargs(ParallelLayout(tp=2))
    assert gpt["share_embeddings_and_output_weights"] == config["tie_word_embeddings"]
    assert gpt["vocab_size"] == bridge.padded_vocab_size(2)
    assert gpt["rope_scaling"] is True if arch == "LlamaForCausalLM" else "rope_scaling" not in gpt


def test_megatron_core_accepts_the_config_kwargs(family):
    """TransformerConfig validates its arguments on construction (no GPU needed)."""
    from megatron.core.transformer import TransformerConfig

    arch, config, sd = family
    cfg = TransformerConfig(**bridge_for(config).transformer_config_kwargs(ParallelLayout(tp=1)))
    assert cfg.num_query_groups == bridge_for(config).dims.num_groups


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(ConfigError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        bridge_for({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    with pytest.raises(ConfigError, match="unsupported architecture"):
        bridge_for({"architectures": ["LlamaForCausalLMX"], "model_type": "llama"})


def test_heads_not_divisible_by_tp_is_a_clear_error(family):
    arch, config, sd = family
    with pytest.raises(ConfigError, match="parallel.tp.*num_key_value_heads"):
        bridge_for(config).check_layout(ParallelLayout(tp=8))


def test_misshaped_hf_tensor_is_named(family):
    arch, config, sd = family
    bridge = bridge_for(config)
    spec = next(s for s in bridge.tensor_map() if s.megatron.endswith("linear_fc2.weight"))
    bad = dict(sd)
    bad[spec.hf[0]] = sd[spec.hf[0]][:, :-1]
    with pytest.raises(ValueError, match=f"{spec.hf[0]}.*shape"):
        bridge.to_megatron(spec, bad.__getitem__)


def test_unsupported_rope_scaling_is_rejected():
    config = tiny_hf_model("LlamaForCausalLM").config.to_dict()
    config["rope_parameters"] = dict(config["rope_parameters"], high_freq_factor=2.0)
    with pytest.raises(ConfigError, match="high_freq_factor"):
        bridge_for(config)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ConfigError, match="llama3"):
        bridge_for(config)
