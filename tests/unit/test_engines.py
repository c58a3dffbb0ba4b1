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


def test_rollout_tp_kv_cache_and_sequence_limits_come_from_the_options():
    assert RolloutSettings().tp == 1 and not RolloutSettings().fp8_kv_cache
    vllm = RolloutSettings(engine="vllm", vllm=VllmOptions(tensor_parallel_size=2, kv_cache_dtype="fp8",
                                                           max_model_len=4096))
    assert vllm.tp == 2 and vllm.fp8_kv_cache
    vllm.options.check_sequence(4096)
    with pytest.raises(ConfigError, match=r"rollout.vllm.max_model_len: got 4096; must hold the longest prompt \+ "
                                          r"response \(4097 tokens"):
        vllm.options.check_sequence(4097)
    VllmOptions().check_sequence(10**6)  # unset: the job's longest sequence
    HfOptions(max_batch_tokens=100).check_sequence(101)  # the last token is not cached
    with pytest.raises(ConfigError, match=r"rollout.hf.max_batch_tokens: got 100; must hold one prompt \+ response "
                                          r"\(101 KV-cache slots"):
        HfOptions(max_batch_tokens=100).check_sequence(102)
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


def test_each_engine_states_its_own_exact_rules_and_keys():
    """The rules an exact rollout sets on an engine's options are the engine's (``exact_rules``),
    named by its own keys; the job's validation only asks for them."""
    assert HfOptions().exact_rules(1) == []
    rules = {key: ok for key, _, ok, _ in VllmOptions(tensor_parallel_size=2).exact_rules(2)}
    assert rules == {"rollout.vllm.tensor_parallel_size": True, "rollout.vllm.attention_backend": True,
                     "rollout.vllm.activation_quant": True}
    bad = VllmOptions(tensor_parallel_size=1, attention_backend="triton_attn", activation_quant="vllm")
    assert [ok for _, _, ok, _ in bad.exact_rules(2)] == [False, False, False]
    assert VllmOptions(attention_backend="flash_attn").exact_rules(1)[1][2]
    assert (HfOptions.tp_key, HfOptions.kv_cache_key, HfOptions.share_key) == ("rollout.engine", None, None)
    assert (VllmOptions.kv_cache_key, VllmOptions.share_key) == ("rollout.vllm.kv_cache_dtype",
                                                                 "rollout.vllm.gpu_memory_utilization")
    assert HfOptions().fp8_gemm_label is None and VllmOptions().fp8_gemm_label == "DeepGEMM"
    assert VllmOptions(fp8_gemm="cutlass").fp8_gemm_label == "CUTLASS"


def test_no_code_outside_the_engine_table_names_an_engine():
    """``rollout.engine`` is tested by name only inside ``rollout/`` (the table and the engines)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "megatron_jetrl"
    pattern = re.compile(r"""engine\s*[!=]=\s*["'](hf|vllm)["']|["'](hf|vllm)["']\s*[!=]=\s*\S*engine""")
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py")) if path.parts[-2] != "rollout"
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []


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
