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
