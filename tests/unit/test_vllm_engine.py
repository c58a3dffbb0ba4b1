"""The parts of the vllm rollout engine that need no vLLM: options, the environment check, the
``vllm.LLM`` arguments, and the error when vLLM is missing. Everything that talks to vLLM is in
tests/contract (run in the vLLM venv of .ci/run)."""

import sys

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import bridge_for
from megatron_jetrl.precision import Fp8Options, PrecisionMode, PrecisionRecipe
from megatron_jetrl.rollout.vllm_engine import VllmEngine, VllmOptions, check_environment, llm_kwargs, require_vllm
from tests.model_fixtures import tiny_hf_model


@pytest.mark.parametrize("key, value", [
    ("tensor_parallel_size", 0), ("max_model_len", 1.5), ("gpu_memory_utilization", 1.0),
    ("kv_cache_dtype", "fp8_e5m2"), ("sleep_level", 0), ("enforce_eager", "yes"), ("seed", None),
])
def test_options_name_the_bad_key(key, value):
    with pytest.raises(ConfigError, match=rf"^rollout\.vllm\.{key}: got"):
        VllmOptions(**{key: value})


def test_environment_check_names_variable_and_value():
    check_environment({"VLLM_USE_DEEP_GEMM_E8M0": "0"}, {"VLLM_USE_DEEP_GEMM_E8M0": "0"})
    for environ in ({}, {"VLLM_USE_DEEP_GEMM_E8M0": "1"}):
        with pytest.raises(ConfigError, match=r"environment:VLLM_USE_DEEP_GEMM_E8M0.*export VLLM_USE_DEEP_GEMM_E8M0=0"):
            check_environment({"VLLM_USE_DEEP_GEMM_E8M0": "0"}, environ)


def test_recipe_environment_keeps_fp32_scales():
    assert PrecisionRecipe().vllm_settings(2).env == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert PrecisionRecipe(mode=PrecisionMode.BF16).vllm_settings(2).env == {}


def test_llm_kwargs_carry_the_recipe():
    bridge = bridge_for(tiny_hf_model("Qwen3ForCausalLM").config.to_dict())
    recipe = PrecisionRecipe(fp8=Fp8Options(bf16_last_layers=1))
    kw = llm_kwargs("/ckpt", bridge, recipe, VllmOptions(tensor_parallel_size=2, kv_cache_dtype="fp8"))
    assert kw["hf_overrides"] == {"quantization_config": recipe.quantization_config(2)}
    assert kw["quantization"] == "fp8" and kw["dtype"] == "bfloat16"
    assert kw["hf_overrides"]["quantization_config"]["ignored_layers"][0] == "model.layers.1.self_attn.q_proj"
    assert (kw["distributed_executor_backend"], kw["load_format"], kw["logprobs_mode"]) == (
        "external_launcher", "dummy", "raw_logprobs")
    assert kw["enable_sleep_mode"] and kw["skip_tokenizer_init"] and kw["tensor_parallel_size"] == 2
    assert kw["kv_cache_dtype"] == "fp8"
    bf16 = llm_kwargs("/ckpt", bridge, PrecisionRecipe(mode=PrecisionMode.BF16), VllmOptions())
    assert bf16["quantization"] is None and bf16["hf_overrides"] == {"quantization_config": None}


def test_missing_vllm_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to import
    with pytest.raises(ImportError, match=r"pip install 'megatron-jetrl\[vllm\]'"):
        require_vllm()
    tiny_hf_model("Qwen3ForCausalLM").config.to_json_file(tmp_path / "config.json")
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "0")
    with pytest.raises(ImportError, match=r"pip install 'megatron-jetrl\[vllm\]'"):
        VllmEngine(tmp_path, PrecisionRecipe())


def test_engine_checks_its_inputs_before_vllm(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"rollout\.model_path"):
        VllmEngine(tmp_path, PrecisionRecipe())
    tiny_hf_model("Qwen3ForCausalLM").config.to_json_file(tmp_path / "config.json")
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM_E8M0", raising=False)
    with pytest.raises(ConfigError, match=r"VLLM_USE_DEEP_GEMM_E8M0=0"):
        VllmEngine(tmp_path, PrecisionRecipe())
