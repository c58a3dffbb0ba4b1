"""RoPE over packed sequences without a host sync (actor/layers.py): the same values and gradients
as megatron's unfused ``thd`` RoPE, bit for bit, and megatron's attention calls it. (That it reads
nothing on the host is checked on a GPU: tests/gpu/test_actor.py, torch's sync debug mode.)"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron.core.transformer.attention as megatron_attention  # noqa: E402
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402

from megatron_jetrl.actor import layers  # noqa: E402
from megatron_jetrl.actor.layers import (  # noqa: E402
    apply_rotary_pos_emb_packed,
    attach_packed_positions,
    local_layer_spec,
    packed_positions,
)

CONFIG = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False,
                         mrope_section=None)
COMPILED = SimpleNamespace(**vars(CONFIG), jetrl_compiled_rope=True)  # actor.elementwise_impl=compiled
ONE_RANK = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # a context-parallel group of one


def rope_freqs(positions: int, dim: int) -> torch.Tensor:
    """[positions, 1, 1, dim] angles as megatron's RotaryEmbedding makes them (its forward wants CUDA)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def test_positions_restart_in_every_sequence():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("lengths", [[5, 1, 7, 3], [16], [2, 2, 2, 2, 2, 2]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [CONFIG, COMPILED], ids=["eager", "compiled"])
def test_same_values_and_gradients_as_megatrons_thd_rope(lengths, dtype, config):
    """Eager, and compiled into one kernel each way (rounded as eager torch rounds): megatron's bits."""
    g = torch.Generator().manual_seed(len(lengths))
    tokens, heads, dim = sum(lengths), 4, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for rows in (rope_freqs(max(lengths), dim), rope_freqs(tokens, dim)):  # longest sequence / whole batch
        t = torch.randn(tokens, heads, dim, generator=g).to(dtype)
        a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
        want = apply_rotary_pos_emb(a, rows, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK)
        got = apply_rotary_pos_emb_packed(b, rows, config, cu_seqlens=cu, cp_group=ONE_RANK)
        assert torch.equal(got, want)
        grad = torch.randn(want.shape, generator=g).to(dtype)
        want.backward(grad)
        got.backward(grad)
        assert torch.equal(b.grad, a.grad)


def test_other_cases_are_megatrons_and_the_spec_installs_it():
    t = torch.randn(6, 2, 32)
    freqs = rope_freqs(6, 32)
    s_b = t.unsqueeze(1)  # [s, b, h, d] without cu_seqlens
    assert torch.equal(apply_rotary_pos_emb_packed(s_b, freqs, CONFIG, cp_group=ONE_RANK),
                       apply_rotary_pos_emb(s_b, freqs, CONFIG, cp_group=ONE_RANK))
    local_layer_spec(qk_layernorm=True, fp8=False)
    assert megatron_attention.apply_rotary_pos_emb is apply_rotary_pos_emb_packed


def test_positions_attached_once_per_micro_batch_serve_every_layer(monkeypatch):
    """The actor attaches the positions to the micro-batch's cu_seqlens; each layer's q and k RoPE
    reads them (the same values as computing them again) and no layer recomputes them."""
    g = torch.Generator().manual_seed(0)
    cu = attach_packed_positions(torch.tensor([0, 5, 6, 13], dtype=torch.int32), 13)
    freqs = rope_freqs(7, 32)
    t = torch.randn(13, 2, 32, generator=g)
    fresh = torch.tensor([0, 5, 6, 13], dtype=torch.int32)  # nothing attached: computed per call
    want = apply_rotary_pos_emb_packed(t, freqs, CONFIG, cu_seqlens=fresh, cp_group=ONE_RANK)
    calls = []
    monkeypatch.setattr(layers, "packed_positions", lambda *a: calls.append(a) or packed_positions(*a))
    for _ in range(4):  # q and k of two layers
        assert torch.equal(apply_rotary_pos_emb_packed(t, freqs, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK), want)
    assert calls == []
    # a cu_seqlens whose attached positions do not fit these tokens is not trusted
    stale = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    stale.jetrl_positions = torch.zeros(5, dtype=torch.int64)
    assert torch.equal(apply_rotary_pos_emb_packed(t, freqs, CONFIG, cu_seqlens=stale, cp_group=ONE_RANK), want)
    assert len(calls) == 1


def test_compiled_rope_makes_cos_sin_once_per_micro_batch_and_leaves_other_shapes_to_megatron(monkeypatch):
    """Every layer's q and k read the micro-batch's cos/sin rows made once; a rotary dim smaller than
    the head dim (megatron's partial RoPE) is megatron's eager code, with its values."""
    g = torch.Generator().manual_seed(1)
    cu = attach_packed_positions(torch.tensor([0, 5, 6, 13], dtype=torch.int32), 13)
    freqs = rope_freqs(7, 32)
    made = []
    real_cos = torch.cos
    monkeypatch.setattr(torch, "cos", lambda x: made.append(x.shape) or real_cos(x))
    q, k = torch.randn(13, 4, 32, generator=g), torch.randn(13, 2, 32, generator=g)
    for t in (q, k, q, k):  # two layers
        want = apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK)
        assert torch.equal(apply_rotary_pos_emb_packed(t, freqs, COMPILED, cu_seqlens=cu, cp_group=ONE_RANK), want)
    assert made.count(torch.Size([13, 1, 32])) == 1  # ours; megatron's reference makes [13, 1, 1, 32] per call
    partial = rope_freqs(7, 16)
    t = torch.randn(13, 2, 32, generator=g)
    assert torch.equal(apply_rotary_pos_emb_packed(t, partial, COMPILED, cu_seqlens=cu, cp_group=ONE_RANK),
                       apply_rotary_pos_emb(t, partial, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK))
