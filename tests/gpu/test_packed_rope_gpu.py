"""RoPE over packed sequences on the GPU (actor/layers.py): megatron's values, and the host never
waits for the GPU in it, where megatron's unfused ``thd`` RoPE does at every call."""

import pytest
import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from megatron_jetrl.actor.layers import apply_rotary_pos_emb_packed
from tests.unit.test_packed_rope import CONFIG, ONE_RANK, rope_freqs

pytestmark = pytest.mark.gpu


def test_packed_rope_on_the_gpu_reads_nothing_on_the_host():
    lengths = [300, 17, 1024, 5, 700]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16)
    freqs = rope_freqs(max(lengths), 128).cuda()
    want = apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = apply_rotary_pos_emb_packed(t, freqs, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK)
        with pytest.raises(RuntimeError, match="synchroniz"):  # megatron's reads the lengths to the host
            apply_rotary_pos_emb(t, freqs, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


def test_compiled_packed_rope_is_megatrons_bit_for_bit_on_the_gpu():
    """actor.elementwise_impl=compiled: the Triton kernels Inductor makes for the rotation (forward
    and backward) give megatron's eager values and gradients bit for bit, at Qwen3-8B's q and k
    shapes, over two micro-batch sizes (the second compiles with dynamic shapes)."""
    from tests.unit.test_packed_rope import COMPILED

    g = torch.Generator(device="cuda").manual_seed(0)
    for lengths in ([300, 17, 1024, 5, 700], [2048, 2048, 96]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        freqs = rope_freqs(max(lengths), 128).cuda() * 37.0  # angles over many turns, as at long positions
        for heads in (32, 8):
            t = torch.randn(sum(lengths), heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
            want = apply_rotary_pos_emb(a, freqs, CONFIG, cu_seqlens=cu, cp_group=ONE_RANK)
            got = apply_rotary_pos_emb_packed(b, freqs, COMPILED, cu_seqlens=cu, cp_group=ONE_RANK)
            assert torch.equal(got, want), (lengths, heads)
            grad = torch.randn(want.shape, device="cuda", dtype=torch.bfloat16, generator=g)
            want.backward(grad)
            got.backward(grad)
            assert torch.equal(b.grad, a.grad), (lengths, heads)
