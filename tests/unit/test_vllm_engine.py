"""The parts of the vllm rollout engine that need no vLLM: options, the environment check, the
``vllm.LLM`` arguments, and the error when vLLM is missing. Everything that talks to vLLM is in
tests/contract (run in the vLLM venv of .ci/run)."""

import sys

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import bridge_for
from megatron_jetrl.precision import Fp8Options, PrecisionMode, PrecisionRecipe
from megatron_jetrl.rollout.vllm_engine import (
    VllmEngine,
    VllmOptions,
    check_environment,
    check_vllm_version,
    engine_env,
    llm_kwargs,
    require_vllm,
)
from tests.model_fixtures import tiny_hf_model


@pytest.mark.parametrize("key, value", [
    ("tensor_parallel_size", 0), ("max_model_len", 1.5), ("gpu_memory_utilization", 1.0),
    ("kv_cache_dtype", "fp8_e5m2"), ("sleep_level", 0), ("enforce_eager", "yes"), ("seed", None),
    ("weight_update", "copy"), ("fp8_gemm", "triton"), ("cuda_graph_max_batch", 0),
    ("attention_backend", "FLASHINFER"),
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
    assert PrecisionRecipe().vllm_env == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
    assert PrecisionRecipe(mode=PrecisionMode.BF16).vllm_env == {}


def test_engine_environment_names_the_fp8_gemm():
    assert engine_env(PrecisionRecipe(), VllmOptions()) == {"VLLM_USE_DEEP_GEMM_E8M0": "0",
                                                                "VLLM_USE_DEEP_GEMM": "1"}
    assert engine_env(PrecisionRecipe(), VllmOptions(fp8_gemm="cutlass"))["VLLM_USE_DEEP_GEMM"] == "0"
    assert engine_env(PrecisionRecipe(), VllmOptions(fp8_gemm="deep_gemm"))["VLLM_USE_DEEP_GEMM"] == "1"


def test_auto_fp8_gemm_is_deep_gemm_also_for_the_exact_rollout():
    exact = PrecisionRecipe(exact=True)
    assert VllmOptions().fp8_gemm_kernel == "deep_gemm"
    assert engine_env(exact, VllmOptions())["VLLM_USE_DEEP_GEMM"] == "1"
    assert engine_env(exact, VllmOptions(fp8_gemm="cutlass"))["VLLM_USE_DEEP_GEMM"] == "0"
    assert VllmOptions(fp8_gemm="cutlass").fp8_gemm_kernel == "cutlass"
    assert engine_env(PrecisionRecipe(mode=PrecisionMode.BF16), VllmOptions()) == {}


@pytest.mark.parametrize("version", ["0.26.0", "0.28.1", "0.32.0", "0.32.1rc1"])
def test_supported_vllm_versions(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "1.0.0", "nightly"])
def test_unsupported_vllm_version_names_the_range_and_the_fix(version):
    with pytest.raises(ConfigError, match=rf"^rollout\.engine: got 'vllm'.*0\.26\.x to 0\.32\.x.*{version}.*"
                                          r"pip install vllm==0\.32\.0, or rollout\.engine=hf"):
        check_vllm_version(version)


def test_llm_kwargs_carry_the_recipe():
    config = tiny_hf_model("Qwen3ForCausalLM").config.to_dict()
    recipe = PrecisionRecipe(fp8=Fp8Options(bf16_last_layers=1))
    kw = llm_kwargs("/ckpt", config, recipe, VllmOptions(tensor_parallel_size=2, kv_cache_dtype="fp8"))
    names = bridge_for(config).linear_names
    assert kw["hf_overrides"] == {"quantization_config": recipe.quantization_config(2, linear_names=names)}
    assert kw["quantization"] == "fp8" and kw["dtype"] == "bfloat16"
    assert kw["hf_overrides"]["quantization_config"]["ignored_layers"][0] == "model.layers.1.self_attn.q_proj"
    assert (kw["distributed_executor_backend"], kw["load_format"], kw["logprobs_mode"]) == (
        "external_launcher", "dummy", "raw_logprobs")
    assert kw["enable_sleep_mode"] and kw["skip_tokenizer_init"] and kw["tensor_parallel_size"] == 2
    assert kw["kv_cache_dtype"] == "fp8"  # the trainer's quantization (default): vLLM's fusions off
    assert kw["compilation_config"] == {"pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False}}
    own = llm_kwargs("/ckpt", config, recipe, VllmOptions(activation_quant="vllm"))
    assert "compilation_config" not in own
    assert "attention_config" not in kw  # auto: vLLM picks
    triton = llm_kwargs("/ckpt", config, recipe, VllmOptions(attention_backend="triton_attn"))
    assert triton["attention_config"] == {"backend": "TRITON_ATTN"}
    assert kw["max_model_len"] == bridge_for(config).dims.max_position_embeddings  # when the job sets none
    bf16 = llm_kwargs("/ckpt", config, PrecisionRecipe(mode=PrecisionMode.BF16),
                      VllmOptions(max_model_len=96, cuda_graph_max_batch=20))
    assert bf16["quantization"] is None and bf16["hf_overrides"] == {"quantization_config": None}
    assert bf16["max_model_len"] == 96
    assert bf16["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 20]}


def _no_vllm(monkeypatch):
    """What an environment without vLLM looks like: no package metadata, no module."""
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "vllm":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setitem(sys.modules, "vllm", None)


def test_missing_vllm_says_how_to_install_it(monkeypatch):
    _no_vllm(monkeypatch)
    with pytest.raises(ConfigError, match=r"pip install 'megatron-jetrl\[vllm\]'"):
        require_vllm()
    for var, value in engine_env(PrecisionRecipe(), VllmOptions()).items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=r"pip install 'megatron-jetrl\[vllm\]'"):
        VllmEngine(tiny_hf_model("Qwen3ForCausalLM").config.to_dict(), PrecisionRecipe())


def test_engine_checks_its_inputs_before_vllm(tmp_path, monkeypatch):
    _no_vllm(monkeypatch)
    with pytest.raises(TypeError, match=r"hf_config must be the HF config as a dict"):
        VllmEngine(tmp_path, PrecisionRecipe())
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM_E8M0", raising=False)
    with pytest.raises(ConfigError, match=r"VLLM_USE_DEEP_GEMM_E8M0=0"):
        VllmEngine(tiny_hf_model("Qwen3ForCausalLM").config.to_dict(), PrecisionRecipe())


@pytest.mark.parametrize("m", [0, 5, 8, 9])
def test_trainer_quant_op_gives_the_scale_layouts_vllm_asks_for(m):
    """The op vLLM's QuantFP8 calls with activation_quant=trainer: the same codes and scales with
    scale rows column-major (strides (1, M)) or TMA-aligned (M rounded up to 4, DeepGEMM), also when
    torch.compile traces it with a symbolic M (its aligned copy once failed there)."""
    import torch

    from megatron_jetrl.precision import quantize_fp8_blockwise
    from megatron_jetrl.rollout.vllm_activation_quant import quantize_rows_op

    op = quantize_rows_op()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    q1, s1 = op(x, False, 0.0, 1)
    q4, s4 = op(x, False, 0.0, 4)
    assert s1.stride() == (1, max(m, 1)) and s4.stride() == (1, max((m + 3) // 4 * 4, 1))
    assert torch.equal(q1.view(torch.uint8), q4.view(torch.uint8)) and torch.equal(s1, s4)
    if m:
        ref_q, ref_s = quantize_fp8_blockwise(x, (1, 128))
        assert torch.equal(q1.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s1, ref_s)
    compiled = torch.compile(lambda t: op(t, False, 0.0, 4), dynamic=True, backend="eager")
    qc, sc = compiled(x)
    assert sc.stride() == s4.stride() and torch.equal(sc, s4)
    torch.library.opcheck(op, (x, False, 0.0, 4))


@pytest.mark.parametrize("awake, expected", [
    ({"weights": True, "kv_cache": True}, 0),
    ({"weights": False, "kv_cache": False}, 40 * 2**30),            # its whole share of the GPU
    ({"weights": True, "kv_cache": False}, 40 * 2**30 - 3 * 2**30),  # less the weights a sync woke
])
def test_wake_bytes_is_the_engines_share_less_what_is_awake(monkeypatch, awake, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1, 100 * 2**30))
    engine = object.__new__(VllmEngine)
    engine.options, engine._awake = VllmOptions(gpu_memory_utilization=0.4), dict(awake)
    engine._weight_bytes = 3 * 2**30
    assert engine.wake_bytes() == expected
