"""The vocabulary logprob/entropy on the GPU (actor/logprobs.py): the compiled (fused) chunks equal
the eager reference up to fp32 rounding at the real vocabulary's width, and neither makes the host
wait for the GPU in the forward or the backward."""

import pytest
import torch

from megatron_jetrl.actor.logprobs import vocab_parallel_logprobs

pytestmark = pytest.mark.gpu

T, V_PADDED, V_REAL = 2048, 151936, 151669  # Qwen3's padded and real vocabularies


def _run(impl, logits, labels, w_lp, w_ent):
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, labels, vocab_start=0, vocab_size=V_REAL, with_entropy=True, impl=impl)
    (lp * w_lp + ent * w_ent).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def test_compiled_equals_eager_and_neither_syncs_the_host():
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(T, V_PADDED, device="cuda", generator=g) * 3).to(torch.bfloat16)
    labels = torch.randint(0, V_REAL, (T,), device="cuda", generator=g)
    w_lp, w_ent = torch.randn(T, device="cuda", generator=g), torch.randn(T, device="cuda", generator=g)
    eager = _run("eager", logits, labels, w_lp, w_ent)
    compiled = _run("compiled", logits, labels, w_lp, w_ent)  # compiles here
    for got, want in zip(compiled[:2], eager[:2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(compiled[2].float(), eager[2].float(), rtol=1e-2, atol=1e-7)
    assert (compiled[2][:, V_REAL:] == 0).all()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for impl in ("eager", "compiled"):
            _run(impl, logits, labels, w_lp, w_ent)
    finally:
        torch.cuda.set_sync_debug_mode("default")
