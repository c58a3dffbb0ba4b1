"""Backend selection errors the actor raises before touching a GPU, and the Transformer Engine
contract (runs where TE imports; this project's hosts have no TE, so it is skipped there)."""

import importlib.util

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_jetrl.actor.build import check_fp8_device, check_te_backend  # noqa: E402
from megatron_jetrl.actor.settings import ActorSettings  # noqa: E402
from megatron_jetrl.config import ConfigError  # noqa: E402
from megatron_jetrl.precision import PrecisionRecipe  # noqa: E402

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def test_native_fp8_without_block_fp8_gemm_names_what_works():
    settings = ActorSettings(precision=PrecisionRecipe(mode="fp8"))
    with pytest.raises(ConfigError, match="needs torch's blockwise scaled_mm.*precision.mode='bf16'"):
        check_fp8_device(settings, torch.device("cpu"))
    check_fp8_device(ActorSettings(precision=PrecisionRecipe(mode="bf16")), torch.device("cpu"))
    check_fp8_device(ActorSettings(precision=PrecisionRecipe(mode="fp8"), fp8_gemm="emulate"), torch.device("cpu"))


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed here; the missing-TE error cannot occur")
def test_te_backend_without_te_says_so():
    settings = ActorSettings(precision=PrecisionRecipe(mode="fp8"), fp8_backend="te")
    expected = "Transformer Engine is not installed; install it or use fp8_backend='native'"
    with pytest.raises(ConfigError, match=expected):
        check_te_backend(settings, num_layers=4)


@pytest.mark.skipif(not HAVE_TE, reason="Transformer Engine is not installed here: pip install 'megatron-jetrl[te]'")
def test_te_backend_contract(monkeypatch):
    """TE accepts the recipe's Float8BlockScaling kwargs, the launcher env is enforced, and the TE
    layer spec is megatron's."""
    from transformer_engine.common.recipe import Float8BlockScaling

    recipe = PrecisionRecipe(mode="fp8")
    te = recipe.te_settings(num_layers=4)
    Float8BlockScaling(**te.recipe_kwargs)
    settings = ActorSettings(precision=recipe, fp8_backend="te")
    for name, value in te.env.items():
        monkeypatch.setenv(name, "wrong")
        with pytest.raises(ConfigError, match=f"set {name}={value} in the launcher"):
            check_te_backend(settings, num_layers=4)
        monkeypatch.setenv(name, value)
    assert check_te_backend(settings, num_layers=4) == te.megatron_kwargs


def test_fp8_micro_batches_are_padded_to_whole_token_groups():
    """FP8 training pads micro-batches to 128 tokens per rank: aligned GEMM operands (no padding
    copies), the quantization's vector stores, and the token counts TE's FP8 GEMMs accept."""
    from megatron_jetrl.actor.actor import token_multiple
    from megatron_jetrl.models import ParallelLayout

    def settings(mode, backend="native", tp=1):
        return ActorSettings(precision=PrecisionRecipe(mode=mode), fp8_backend=backend,
                             parallel=ParallelLayout(tp=tp, sequence_parallel=tp > 1))

    assert token_multiple(settings("bf16"), False) == 1
    assert token_multiple(settings("bf16", tp=2), True) == 2
    assert token_multiple(settings("bf16-train+fp8-rollout"), False) == 1  # BF16 training
    assert token_multiple(settings("fp8"), False) == 128
    assert token_multiple(settings("fp8", "te"), False) == 128
    assert token_multiple(settings("fp8", tp=2), True) == 256  # 128 tokens on each TP rank


def test_deep_gemm_wgrad_is_refused_where_it_cannot_run():
    """``actor.fp8_wgrad=deep_gemm`` is the native FP8 linears' WGrad on Hopper: refused, naming the
    key, with the te backend (when the settings are made) and beside emulated GEMMs (before the
    model is built)."""
    with pytest.raises(ConfigError, match="backend runs its own") as e:
        ActorSettings(precision=PrecisionRecipe(mode="fp8"), fp8_backend="te", fp8_wgrad="deep_gemm")
    assert e.value.key == "actor.fp8_wgrad"
    emulated = ActorSettings(precision=PrecisionRecipe(mode="fp8"), fp8_gemm="emulate", fp8_wgrad="deep_gemm")
    with pytest.raises(ConfigError, match="set actor.fp8_wgrad=gemm") as e:
        check_fp8_device(emulated, torch.device("cpu"))
    assert e.value.key == "actor.fp8_wgrad"
    check_fp8_device(ActorSettings(precision=PrecisionRecipe(mode="bf16"), fp8_wgrad="deep_gemm"), torch.device("cpu"))
