"""PrecisionRecipe: the one place every FP8 setting (trainer, TE, vLLM, export) is derived from."""

import json
import re

import pytest
import torch

from megatron_jetrl.config import ConfigError, build
from megatron_jetrl.precision import Fp8Options, PrecisionMode, PrecisionRecipe

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
"""A Llama-family layer's linears (the bridge's ``linear_names``; tests/unit/test_bridges.py pins them)."""

QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def test_defaults():
    r = PrecisionRecipe()
    assert r.mode is PrecisionMode.FP8
    assert r.fp8 == Fp8Options()
    assert r.fp8.format == "e4m3"
    assert r.fp8.weight_block == (128, 128)
    assert r.fp8.activation_group == (1, 128) and r.fp8.grad_group == (1, 128)
    assert r.fp8.pow2_scales is False
    assert r.fp8.amax_epsilon == 0.0
    assert r.fp8.bf16_first_layers == 0 and r.fp8.bf16_last_layers == 0


@pytest.mark.parametrize(
    "mode, train_fp8, rollout_fp8, dtype, loss_scaling",
    [
        ("fp8", True, True, torch.bfloat16, False),
        ("bf16", False, False, torch.bfloat16, False),
        ("fp16", False, False, torch.float16, True),
        ("bf16-train+fp8-rollout", False, True, torch.bfloat16, False),
    ],
)
def test_mode_properties(mode, train_fp8, rollout_fp8, dtype, loss_scaling):
    r = PrecisionRecipe(mode=mode)
    assert r.mode is PrecisionMode(mode)
    assert r.train_fp8 is train_fp8
    assert r.rollout_fp8 is rollout_fp8
    assert r.compute_dtype is dtype
    assert r.loss_scaling is loss_scaling


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"mdoe": "fp8"}, "precision.mdoe"),
        ({"fp8": {"blok": [128, 128]}}, "precision.fp8.blok"),
        ({"fp8": {"weight_block": [128, 128], "pow2_scale": True}}, "precision.fp8.pow2_scale"),
    ],
)
def test_the_loader_rejects_unknown_keys(raw, key):
    with pytest.raises(ConfigError, match=re.escape(key) + r".*unknown key") as e:
        build(PrecisionRecipe, raw, "precision")
    assert e.value.key == key


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"mode": "fp4"}, "precision.mode"),
        ({"fp8": {"format": "e5m2"}}, "precision.fp8.format"),
        ({"fp8": {"weight_block": [64, 64]}}, "precision.fp8.weight_block"),
        ({"fp8": {"weight_block": [128]}}, "precision.fp8.weight_block"),
        ({"fp8": {"activation_group": [1, 64]}}, "precision.fp8.activation_group"),
        ({"fp8": {"grad_group": [128, 128]}}, "precision.fp8.grad_group"),
        ({"fp8": {"amax_epsilon": -1}}, "precision.fp8.amax_epsilon"),
        ({"fp8": {"amax_epsilon": float("nan")}}, "precision.fp8.amax_epsilon"),
        ({"fp8": {"amax_epsilon": "tiny"}}, "precision.fp8.amax_epsilon"),  # "1e-4" is a number (YAML reads it as text)
        ({"fp8": {"bf16_first_layers": -1}}, "precision.fp8.bf16_first_layers"),
        ({"fp8": {"bf16_first_layers": "2"}}, "precision.fp8.bf16_first_layers"),
        ({"fp8": {"bf16_last_layers": True}}, "precision.fp8.bf16_last_layers"),
        ({"fp8": {"pow2_scales": "yes"}}, "precision.fp8.pow2_scales"),
    ],
)
def test_bad_values_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=re.escape(key) + ": got ") as e:
        build(PrecisionRecipe, raw, "precision")
    assert e.value.key == key


@pytest.mark.parametrize("fp8", [True, "e4m3", [128, 128]], ids=["bool", "str", "list"])
def test_non_mapping_fp8_section_is_a_config_error(fp8):
    """A YAML slip like ``fp8: yes`` (parsed as True) must name the section, not fail inside dict()."""
    with pytest.raises(ConfigError, match=r"precision\.fp8: got"):
        build(PrecisionRecipe, {"fp8": fp8}, "precision")


def test_mode_error_lists_allowed_modes():
    with pytest.raises(ConfigError, match="must be one of 'bf16', 'fp16', 'fp8', 'bf16-train\\+fp8-rollout'"):
        PrecisionRecipe(mode="fp4")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "recipe",
    [
        PrecisionRecipe(),
        PrecisionRecipe(mode="bf16-train+fp8-rollout"),
        PrecisionRecipe(fp8=Fp8Options(pow2_scales=True, amax_epsilon=1e-4, bf16_first_layers=1, bf16_last_layers=2)),
    ],
)
def test_to_dict_and_the_loader_round_trip(recipe):
    d = recipe.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["fp8"]["weight_block"] == [128, 128]
    assert build(PrecisionRecipe, d, "precision") == recipe
    assert build(PrecisionRecipe, json.loads(json.dumps(d)), "precision").to_dict() == d


def test_the_loader_accepts_missing_or_null_fp8_section():
    assert build(PrecisionRecipe, {"mode": "bf16"}, "precision") == PrecisionRecipe(mode=PrecisionMode.BF16)
    assert build(PrecisionRecipe, {"fp8": None}, "precision") == PrecisionRecipe()
    assert build(PrecisionRecipe, {"fp8": {"amax_epsilon": 0}}, "precision").fp8.amax_epsilon == 0.0


def test_layer_in_fp8_keeps_first_and_last_layers_in_bf16():
    r = PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=2, bf16_last_layers=1))
    assert [r.layer_in_fp8(i, 6) for i in range(6)] == [False, False, True, True, True, False]
    assert all(PrecisionRecipe().layer_in_fp8(i, 4) for i in range(4))
    bf16 = PrecisionRecipe(mode="bf16-train+fp8-rollout")
    assert not any(bf16.layer_in_fp8(i, 4) for i in range(4))
    with pytest.raises(ValueError, match="layer 6 out of range for 6 layers"):
        r.layer_in_fp8(6, 6)
    with pytest.raises(ValueError, match="out of range"):
        r.layer_in_fp8(-1, 6)


def test_too_many_bf16_layers_is_a_config_error():
    r = PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=2, bf16_last_layers=2))
    for call in (lambda: r.te_settings(3), lambda: r.quantization_config(3, linear_names=LINEARS),
                 lambda: r.layer_in_fp8(0, 3)):
        with pytest.raises(ConfigError, match=r"precision\.fp8\.bf16_first_layers.*<= num_layers \(3\)"):
            call()
    assert r.te_settings(4) is not None


@pytest.mark.parametrize("pow2, env", [(False, "1"), (True, "0")])
def test_te_settings(pow2, env):
    eps = 1e-6
    s = PrecisionRecipe(fp8=Fp8Options(pow2_scales=pow2, amax_epsilon=eps)).te_settings(32)
    assert s.env == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": env}
    assert s.recipe_kwargs == {
        "fp8_format": "E4M3",
        "x_block_scaling_dim": 1,
        "w_block_scaling_dim": 2,
        "grad_block_scaling_dim": 1,
    }
    q = {"power_2_scale": pow2, "amax_epsilon": eps}
    assert s.qparams == {"fp8_quant_fwd_inp": q, "fp8_quant_fwd_weight": q, "fp8_quant_bwd_grad": q}
    assert s.megatron_kwargs == {"fp8": "e4m3", "fp8_recipe": "blockwise", "first_last_layers_bf16": False}


def test_te_settings_with_bf16_layers():
    s = PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=1, bf16_last_layers=2)).te_settings(8)
    assert s.megatron_kwargs == {
        "fp8": "e4m3",
        "fp8_recipe": "blockwise",
        "first_last_layers_bf16": True,
        "num_layers_at_start_in_bf16": 1,
        "num_layers_at_end_in_bf16": 2,
    }
    s = PrecisionRecipe(fp8=Fp8Options(bf16_last_layers=1)).te_settings(8)
    assert s.megatron_kwargs["first_last_layers_bf16"] is True
    assert s.megatron_kwargs["num_layers_at_start_in_bf16"] == 0


@pytest.mark.parametrize("mode", ["bf16", "fp16", "bf16-train+fp8-rollout"])
def test_te_settings_none_when_training_is_not_fp8(mode):
    assert PrecisionRecipe(mode=mode).te_settings(8) is None


@pytest.mark.parametrize("mode", ["fp8", "bf16-train+fp8-rollout"])
def test_quantization_config_for_fp8_rollout(mode):
    assert PrecisionRecipe(mode=mode).quantization_config(4, linear_names=LINEARS) == QUANT_CONFIG


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_quantization_config_none_without_fp8_rollout(mode):
    assert PrecisionRecipe(mode=mode).quantization_config(4, linear_names=LINEARS) is None


def test_quantization_config_lists_bf16_layers():
    r = PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=1, bf16_last_layers=1))
    config = r.quantization_config(4, linear_names=LINEARS)
    skipped = [f"model.layers.{i}.{name}" for i in (0, 3) for name in LINEARS]
    assert config == {**QUANT_CONFIG, "ignored_layers": skipped, "modules_to_not_convert": skipped}
    assert "model.layers.0.self_attn.q_proj" in skipped and "model.layers.3.mlp.down_proj" in skipped
    assert config["ignored_layers"] is not config["modules_to_not_convert"]


def test_quantization_config_custom_names():
    r = PrecisionRecipe(fp8=Fp8Options(bf16_last_layers=1))
    config = r.quantization_config(3, linear_names=("fc1", "fc2"), layer_prefix="decoder.layers")
    assert config["ignored_layers"] == ["decoder.layers.2.fc1", "decoder.layers.2.fc2"]


def test_ablation_mode_keeps_bf16_layers_in_rollout_config():
    r = PrecisionRecipe(mode="bf16-train+fp8-rollout", fp8=Fp8Options(bf16_first_layers=1))
    assert r.quantization_config(2, linear_names=LINEARS)["ignored_layers"] == [f"model.layers.0.{n}" for n in LINEARS]


@pytest.mark.parametrize("pow2, flag", [(False, "0"), (True, "1")])
def test_vllm_settings_fp8(pow2, flag):
    s = PrecisionRecipe(fp8=Fp8Options(pow2_scales=pow2)).vllm_settings(4, linear_names=LINEARS)
    assert s.env == {"VLLM_USE_DEEP_GEMM_E8M0": flag}
    assert s.quantization_config == QUANT_CONFIG
    assert s.dtype == "bfloat16"


@pytest.mark.parametrize("mode, dtype", [("bf16", "bfloat16"), ("fp16", "float16")])
def test_vllm_settings_without_fp8(mode, dtype):
    s = PrecisionRecipe(mode=mode).vllm_settings(4, linear_names=LINEARS)
    assert s.env == {} and s.quantization_config is None and s.dtype == dtype


def test_vllm_settings_passes_names_through():
    s = PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=1)).vllm_settings(2, linear_names=("a",), layer_prefix="m")
    assert s.quantization_config["ignored_layers"] == ["m.0.a"]


def test_recipe_is_frozen():
    r = PrecisionRecipe()
    with pytest.raises(AttributeError):
        r.mode = PrecisionMode.BF16
    with pytest.raises(AttributeError):
        r.fp8.pow2_scales = True


def test_fp8_section_must_be_options():
    with pytest.raises(ConfigError, match=r"precision\.fp8: got"):
        PrecisionRecipe(fp8={"pow2_scales": True})
