"""Model bridges: config translation, the tensor map's round trip, and TP shards of the fused tensors
against an independent per-rank construction."""

import re

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
    with pytest.raises(ConfigError, match=r"^actor\.parallel\.tp: got 8; must divide num_key_value_heads"):
        bridge_for(config).check_layout(ParallelLayout(tp=8))
    for tp, pp in ((0, 1), (1, 0)):
        with pytest.raises(ConfigError, match=r"^actor\.parallel\.(tp|pp): got 0; must be an integer >= 1$"):
            bridge_for(config).check_layout(ParallelLayout(tp=tp, pp=pp))


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
    for factor, reason in ((None, "required with llama3"), ("x", "must be a finite number > 0"),
                           (0, "must be a finite number > 0")):
        config["rope_parameters"] = {"rope_type": "llama3", "factor": factor, "rope_theta": 1e4}
        with pytest.raises(ConfigError, match=reason) as e:
            bridge_for(config)
        assert e.value.key == "config.json:rope_scaling.factor"


_DIMS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
         "head_dim", "vocab_size", "max_position_embeddings")


@pytest.mark.parametrize("key", _DIMS)
@pytest.mark.parametrize("value", [0, -1, 2.5, "64", True])
def test_every_dimension_must_be_a_positive_integer(key, value):
    config = tiny_hf_model("Qwen3ForCausalLM").config.to_dict()
    with pytest.raises(ConfigError, match=rf"^config\.json:{key}: got {re.escape(repr(value))}; "
                                          r"must be a positive integer$"):
        bridge_for({**config, key: value})


@pytest.mark.parametrize("key", ["rope_theta", "rms_norm_eps"])
@pytest.mark.parametrize("value", ["abc", 0, -1e-6, float("nan"), float("inf"), True, [1]])
def test_rope_theta_and_norm_eps_must_be_finite_positive_numbers(key, value):
    config = {**tiny_hf_model("Qwen3ForCausalLM").config.to_dict(), "rope_theta": 1e4, "rms_norm_eps": 1e-6}
    with pytest.raises(ConfigError, match=rf"^config\.json:{key}: got {re.escape(repr(value))}; "
                                          r"must be a finite number > 0$"):
        bridge_for({**config, key: value})
    if key == "rope_theta":  # read from rope_parameters (newer transformers) when unset
        with pytest.raises(ConfigError, match=r"^config\.json:rope_parameters\.rope_theta: got "):
            bridge_for({**config, "rope_theta": None, "rope_parameters": {"rope_type": "default", key: value}})


def test_numbers_as_yaml_strings_and_unset_epsilon():
    """YAML 1.1 reads an inline 1e-6 as a string: taken as the number. An unset epsilon is 1e-6."""
    config = tiny_hf_model("Qwen3ForCausalLM").config.to_dict()
    d = bridge_for({**config, "rope_theta": "1e6", "rms_norm_eps": "1e-5"}).dims
    assert (d.rope_theta, d.norm_eps) == (1e6, 1e-5)
    assert bridge_for({**config, "rms_norm_eps": None}).dims.norm_eps == 1e-6


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "use_sliding_window"])
def test_flags_must_be_true_or_false(key):
    config = tiny_hf_model("Qwen3ForCausalLM").config.to_dict()
    with pytest.raises(ConfigError, match=rf"^config\.json:{key}: got 'maybe'; must be true or false$"):
        bridge_for({**config, key: "maybe"})
    with pytest.raises(ConfigError, match=r"^config\.json:rope_parameters: got 3; must be a mapping"):
        bridge_for({**config, "rope_parameters": 3})


def test_dimension_defaults_and_integral_floats():
    config = tiny_hf_model("Qwen3ForCausalLM").config.to_dict()
    d = bridge_for({**config, "head_dim": None, "num_key_value_heads": None, "max_position_embeddings": None,
                    "hidden_size": 256.0}).dims
    assert (d.head_dim, d.num_groups, d.max_position_embeddings, d.hidden_size) == (32, 8, 4096, 256)
    assert isinstance(d.hidden_size, int)
    with pytest.raises(ConfigError, match=r"^config\.json:num_attention_heads: got 512; must be at most hidden_size "
                                          r"\(256\) when head_dim is not set"):
        bridge_for({**config, "head_dim": None, "num_attention_heads": 512, "num_key_value_heads": 512})


def test_index_map_by_hand():
    """The sync plan's index maps, derived by the bridge from its own conversion, against a case
    written out by hand (an independent check: the plan's other tests share the bridge's source).
    4 query heads in 2 groups, head_dim 2, TP 2: rank r holds group r = [q of heads 2r, 2r+1 | k_r | v_r],
    8 rows per rank; fc1 holds [gate_r; up_r]; the vocab (10 rows) is padded to 256 = 128 x 2."""
    b = bridge_for({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 128,
                    "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "head_dim": 2, "vocab_size": 10, "max_position_embeddings": 64,
                    "rms_norm_eps": 1e-6, "rope_theta": 1e4, "tie_word_embeddings": False})
    spec = {s.megatron: s for s in b.tensor_map()}
    qkv = spec["decoder.layers.0.self_attention.linear_qkv.weight"]
    dim, rank, local = b.index_map(qkv, 0, 2)  # q: 8 rows = 4 heads x 2
    assert dim == 0 and rank.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and local.tolist() == [0, 1, 2, 3] * 2
    _, rank, local = b.index_map(qkv, 1, 2)  # k: 2 groups x 2 rows, after the group's 4 q rows
    assert rank.tolist() == [0, 0, 1, 1] and local.tolist() == [4, 5, 4, 5]
    _, rank, local = b.index_map(qkv, 2, 2)  # v: after k
    assert rank.tolist() == [0, 0, 1, 1] and local.tolist() == [6, 7, 6, 7]
    fc1 = spec["decoder.layers.0.mlp.linear_fc1.weight"]
    _, rank, local = b.index_map(fc1, 1, 2)  # up: 256 rows, rank r holds [gate_r (128); up_r (128)]
    assert rank.tolist() == [0] * 128 + [1] * 128 and local.tolist() == list(range(128, 256)) * 2
    fc2 = spec["decoder.layers.0.mlp.linear_fc2.weight"]
    dim, rank, local = b.index_map(fc2, 0, 2)  # row-parallel: columns split
    assert dim == 1 and rank.tolist() == [0] * 128 + [1] * 128 and local.tolist() == list(range(128)) * 2
    emb = spec["embedding.word_embeddings.weight"]
    _, rank, local = b.index_map(emb, 0, 2)  # 10 rows, all in rank 0's 128-row shard
    assert rank.tolist() == [0] * 10 and local.tolist() == list(range(10))
    norm = next(s for s in spec.values() if s.tp_dim is None and s.layer == 0)  # a layer norm
    dim, rank, local = b.index_map(norm, 0, 2)  # not split: rank 0 is named
    assert dim == 0 and rank.unique().tolist() == [0] and local.tolist() == list(range(norm.shape[0]))


def test_linear_names_and_fused_projections_come_from_the_tensor_map(family):
    """The facts the recipe's quantization_config and the hf engine use, stated once (the layer map)."""
    _, config, _ = family
    b = bridge_for(config)
    assert b.linear_names == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert b.fused_projections == (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                   ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))
