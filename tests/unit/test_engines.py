"""The table of rollout engines (``rollout.engines.ENGINES``): everything that differs between
engines comes from an engine's entry or its options section, never from a test of its name."""

import pytest
import torch

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import bridge_for
from megatron_jetrl.precision import PrecisionRecipe
from megatron_jetrl.rollout import ENGINES, HfOptions, RolloutSettings, VllmOptions, build_engine, engine_kind
from megatron_jetrl.rollout import vllm_engine
from megatron_jetrl.rollout.vllm_engine import engine_env


def test_rollout_tp_kv_cache_and_context_limit_come_from_the_options():
    assert RolloutSettings().tp == 1 and not RolloutSettings().fp8_kv_cache
    vllm = RolloutSettings(engine="vllm", vllm=VllmOptions(tensor_parallel_size=2, kv_cache_dtype="fp8",
                                                           max_model_len=4096))
    assert vllm.tp == 2 and vllm.fp8_kv_cache and vllm.options.context_limit == 4096
    assert RolloutSettings(engine="hf").options.context_limit is None
    assert HfOptions().in_place_weights and VllmOptions().in_place_weights
    assert not VllmOptions(weight_update="reload").in_place_weights  # vLLM's own loaders take the weights
    with pytest.raises(ConfigError, match="rollout.vllm.kv_cache_dtype"):  # set for an engine not chosen
        RolloutSettings(engine="hf", vllm=VllmOptions(kv_cache_dtype="fp8"))


def test_memory_estimate_per_engine():
    dims = bridge_for({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
                       "vocab_size": 64, "rope_theta": 1e4}).dims
    kv, share = HfOptions(max_batch_tokens=1000).memory(dims)
    assert kv == 1000 * 2 * 2 * 1 * 128 * 2 and share is None
    assert VllmOptions(gpu_memory_utilization=0.3).memory(dims) == (0.0, 0.3)


def test_entries_say_what_each_engine_can_and_needs():
    recipe = PrecisionRecipe(exact=True)
    assert ENGINES["vllm"].exact and not ENGINES["hf"].exact
    assert ENGINES["vllm"].environment(recipe, VllmOptions()) == engine_env(recipe, VllmOptions())
    assert ENGINES["hf"].environment(recipe, HfOptions()) == {}
    assert ENGINES["hf"].requirements(HfOptions()) == []
    assert [f.__name__ for f in ENGINES["vllm"].requirements(VllmOptions())] == ["require_vllm_version"]
    assert engine_kind(RolloutSettings(engine="vllm")) is ENGINES["vllm"]


def test_build_engine_is_the_entrys_factory(monkeypatch):
    built = {}

    class FakeVllm:
        def __init__(self, hf_config, recipe, options):
            built.update(hf_config=hf_config, recipe=recipe, options=options)

    monkeypatch.setattr(vllm_engine, "VllmEngine", FakeVllm)
    recipe = PrecisionRecipe()
    engine = build_engine(RolloutSettings(engine="vllm"), recipe, {"a": 1}, device=torch.device("cpu"),
                          max_model_len=777)
    assert isinstance(engine, FakeVllm) and built["recipe"] is recipe and built["hf_config"] == {"a": 1}
    assert built["options"].max_model_len == 777  # the job's longest sequence where none was set
    build_engine(RolloutSettings(engine="vllm", vllm=VllmOptions(max_model_len=64)), recipe, {}, device=None,
                 max_model_len=777)
    assert built["options"].max_model_len == 64
