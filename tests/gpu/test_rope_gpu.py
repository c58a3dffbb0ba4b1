"""The exact forward's CUDA RoPE kernel equals its eager torch reference on CUDA bit for bit (the
reference is what megatron computes, tests/unit/test_exact.py), at the positions of long sequences,
for strided inputs as vLLM passes them, and alone or in any batch."""

import pytest
import torch

from megatron_jetrl.actor.exact import exact_rope
from megatron_jetrl.ops.exact import rope, rope_inv_freq, rope_reference
from tests.unit.test_rms_norm_kernel import DTYPES, assert_same_bits

pytestmark = pytest.mark.gpu

BASES = [10000.0, 1000000.0]


def _inputs(tokens: int, heads: int, dim: int, dtype, seed: int, max_position: int = 40960):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(tokens, heads, dim, generator=g, device="cuda") * 4).to(dtype)
    positions = torch.randint(0, max_position, (tokens,), generator=g, device="cuda")
    return x, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("dim", [64, 128])
def test_kernel_equals_reference(dtype, base, dim):
    x, positions = _inputs(4096, 8, dim, dtype, seed=dim)
    positions[:dim] = torch.arange(dim, device="cuda")  # the first positions too
    inv = rope_inv_freq(dim, base, x.device)
    assert_same_bits(rope(x, positions, inv), rope_reference(x, positions, inv), f"{dtype} D={dim} base={base}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_as_vllm_passes_them(dtype):
    """q and k are column slices of vLLM's qkv output: rows of a larger stride."""
    qkv, positions = _inputs(333, 32 + 8 + 8, 128, dtype, seed=3)
    flat = qkv.view(333, -1)
    q, k = flat[:, : 32 * 128].view(333, 32, 128), flat[:, 32 * 128 : 40 * 128].view(333, 8, 128)
    inv = rope_inv_freq(128, 1000000.0, qkv.device)
    for t in (q, k):
        assert not t.is_contiguous()
        assert_same_bits(rope(t, positions, inv), rope_reference(t.contiguous(), positions, inv), "strided")


def test_a_token_gets_the_same_bits_alone_or_in_a_batch():
    x, positions = _inputs(1000, 8, 128, torch.bfloat16, seed=5)
    inv = rope_inv_freq(128, 1000000.0, x.device)
    whole = rope(x, positions, inv)
    for i in (0, 1, 511, 999):
        assert_same_bits(rope(x[i : i + 1], positions[i : i + 1], inv), whole[i : i + 1], f"token {i} alone")


def test_trainer_rope_forward_is_the_kernel_and_backward_the_references():
    x, positions = _inputs(512, 8, 128, torch.bfloat16, seed=7)
    x.requires_grad_()
    y = exact_rope(x, positions, 1000000.0)
    inv = rope_inv_freq(128, 1000000.0, x.device)
    assert_same_bits(y.detach(), rope_reference(x.detach(), positions, inv), "forward")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(rope_reference(xr, positions, inv), xr, dy)
    assert torch.equal(dx, want)
