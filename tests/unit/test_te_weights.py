"""``actor.model.te_fp8_weight`` against a stand-in for Transformer Engine 2.20's block quantizer
(TE needs CUDA): the glue around TE, i.e. which quantizer is used, the settings check, and the
trimming of TE's pad-to-4 ``scale_inv`` columns. tests/gpu/test_te_backend.py checks real TE's
bytes against the reference on the GPU host."""

import sys
import types

import pytest
import torch

from megatron_jetrl.config import ConfigError
from megatron_jetrl.config import build
from megatron_jetrl.precision import PrecisionRecipe, quantize_fp8_blockwise

pytest.importorskip("megatron.core")


class FakeBlockQuantizer:
    """TE 2.20's Float8BlockQuantizer as its source describes it: 128x128 blocks, row-wise data
    [N, K] uint8, row-wise scale_inv [ceil(N/128), roundup(ceil(K/128), 4)] whose pad columns are
    never written; ``copy()``, ``set_usage``, ``internal``."""

    calls = []

    def __init__(self, fp8_dtype, *, rowwise, columnwise, amax_epsilon=0.0, force_pow_2_scales=True,
                 block_scaling_dim=2):
        self.rowwise, self.columnwise, self.internal = rowwise, columnwise, True
        self.amax_epsilon, self.force_pow_2_scales, self.block_scaling_dim = amax_epsilon, force_pow_2_scales, \
            block_scaling_dim

    def copy(self):
        other = FakeBlockQuantizer(None, rowwise=self.rowwise, columnwise=self.columnwise,
                                   amax_epsilon=self.amax_epsilon, force_pow_2_scales=self.force_pow_2_scales,
                                   block_scaling_dim=self.block_scaling_dim)
        other.internal = self.internal
        return other

    def set_usage(self, *, rowwise, columnwise):
        self.rowwise, self.columnwise = rowwise, columnwise

    def __call__(self, w):
        FakeBlockQuantizer.calls.append(self)
        q, s = quantize_fp8_blockwise(w, (128, 128), pow2_scales=self.force_pow_2_scales, eps=self.amax_epsilon)
        pad = -s.shape[1] % 4
        garbage = torch.full((s.shape[0], pad), float("nan"))
        return types.SimpleNamespace(_rowwise_data=q.view(torch.uint8), _rowwise_scale_inv=torch.cat([s, garbage], 1))


@pytest.fixture
def fake_te(monkeypatch):
    tensor_mod = types.ModuleType("transformer_engine.pytorch.tensor.float8_blockwise_tensor")
    tensor_mod.Float8BlockQuantizer = FakeBlockQuantizer
    tex = types.ModuleType("transformer_engine_torch")
    tex.DType = types.SimpleNamespace(kFloat8E4M3="e4m3")
    for name, mod in {"transformer_engine_torch": tex,
                      "transformer_engine.pytorch.tensor.float8_blockwise_tensor": tensor_mod}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    FakeBlockQuantizer.calls = []


def _recipe(**fp8):
    return build(PrecisionRecipe, {"mode": "fp8", "fp8": fp8}, "precision")


def _module(n=300, k=520):
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Module()
    m.weight = torch.nn.Parameter((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
    return m


def test_before_its_first_forward_a_quantizer_with_the_recipes_settings(fake_te):
    from megatron_jetrl.actor.build import te_fp8_weight

    m = _module()
    got = te_fp8_weight(m, _recipe())
    want_q, want_s = quantize_fp8_blockwise(m.weight.detach(), (128, 128))
    assert torch.equal(got.data.view(torch.uint8), want_q.view(torch.uint8))
    assert got.scale_inv.shape == (3, 5) and torch.equal(got.scale_inv, want_s)  # TE's 8 columns trimmed
    assert got.block_shape == (128, 128) and got.data.dtype == torch.float8_e4m3fn
    (q,) = FakeBlockQuantizer.calls
    assert (q.block_scaling_dim, q.rowwise, q.columnwise, q.internal) == (2, True, False, False)


def test_the_modules_own_quantizer_is_copied_not_changed(fake_te):
    from megatron_jetrl.actor.build import te_fp8_weight

    m = _module()
    own = FakeBlockQuantizer(None, rowwise=True, columnwise=True, amax_epsilon=0.0, force_pow_2_scales=False)
    m.quantizers = {"scaling_fwd": [object(), own, object()], "scaling_bwd": []}
    te_fp8_weight(m, _recipe())
    (used,) = FakeBlockQuantizer.calls
    assert used is not own and (own.columnwise, own.internal) == (True, True)


def test_a_quantizer_unlike_the_recipe_is_refused_naming_the_environment(fake_te):
    from megatron_jetrl.actor.build import te_fp8_weight

    m = _module()
    m.quantizers = {"scaling_fwd": [None, FakeBlockQuantizer(None, rowwise=True, columnwise=True), None]}
    with pytest.raises(ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES"):
        te_fp8_weight(m, _recipe())  # TE's default power-of-2 scales; the recipe's are fp32
    assert not FakeBlockQuantizer.calls
