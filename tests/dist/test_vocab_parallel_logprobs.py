"""Vocab-parallel logprobs and entropy over a TP=2 gloo group equal a full-vocab log_softmax on one
process, values and gradients, with the padded vocab tail split across ranks; the exact impl hands
the engine's kernel whole rows, so its logprobs are that kernel's on the full vocabulary, bit for bit."""

import os

import pytest
import torch
from megatron_jetrl.launch import free_port
from tests.helpers import run_ranks

TP, T, V_PADDED, V_REAL = 2, 11, 64, 45  # rank 1 holds columns 32..63, of which 32..44 are real


def _inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(T, V_PADDED, generator=g) * 4
    labels = torch.randint(0, V_REAL, (T,), generator=g)
    w_lp, w_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return logits, labels, w_lp, w_ent


def _token_logprobs(logits, ids):
    """A stand-in for the engine's kernel (``VllmKernels.token_logprobs``): [M, V], [M, 1] -> [M, 1]."""
    if logits.shape[1] != V_REAL:
        raise AssertionError(f"token_logprobs got {logits.shape[1]} columns, not the whole real vocabulary")
    return torch.log_softmax(logits.float(), -1).gather(1, ids)


def _worker(rank, port, impl, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        from megatron_jetrl.actor.logprobs import vocab_parallel_logprobs

        logits, labels, w_lp, w_ent = _inputs()
        width = V_PADDED // TP
        local = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(local, labels, vocab_start=rank * width, vocab_size=V_REAL,
                                          group=torch.distributed.group.WORLD, with_entropy=True, impl=impl,
                                          token_logprobs=_token_logprobs if impl == "exact" else None)
        (lp * w_lp + ent * w_ent).sum().backward()
        results.put((rank, lp.tolist(), ent.tolist(), local.grad.tolist(), None))  # tensors die with the process
    except Exception as e:  # reported to the test
        results.put((rank, None, None, None, repr(e)))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("impl", ["eager", "compiled", "exact"])
def test_tp2_logprobs_entropy_and_grads_equal_full_vocab(impl):
    port = free_port()
    out = run_ranks(_worker, TP, port, impl, timeout=180)
    for rank, *_, err in out:
        assert err is None, f"rank {rank}: {err}"

    logits, labels, w_lp, w_ent = _inputs()
    full = logits.clone().requires_grad_()
    logp = torch.log_softmax(full[:, :V_REAL], -1)
    ref_lp = logp.gather(1, labels[:, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    for rank, lp, ent, grad, _ in out:
        lp, ent, grad = torch.tensor(lp), torch.tensor(ent), torch.tensor(grad)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        if impl == "exact":  # the kernel's own numbers on whole rows, gathered in rank order
            assert torch.equal(lp, _token_logprobs(logits[:, :V_REAL], labels[:, None]).squeeze(1))
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
        width = V_PADDED // TP
        torch.testing.assert_close(grad, full.grad[:, rank * width:(rank + 1) * width], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_without_a_host_sync_is_bitwise_the_row_selecting_one(dtype):
    """The backward adds d_logp at the label column by a masked scatter, not by selecting the rows
    that hold their label (nonzero() syncs the host with the GPU): the same bits, labels of other
    ranks and padded vocabulary rows included."""
    from megatron_jetrl.actor.logprobs import _masked_fp32, vocab_parallel_logprobs

    g = torch.Generator().manual_seed(3)
    T, width, vocab_start, vocab_size = 37, 128, 128, 200  # this rank: columns 128..255, 72 real
    logits = (torch.randn(T, width, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab_size, (T,), generator=g)
    d_logp = torch.randn(T, generator=g)
    lp, _ = vocab_parallel_logprobs(logits, labels, vocab_start=vocab_start, vocab_size=vocab_size)
    lp.backward(d_logp)

    real = vocab_size - vocab_start
    zm = _masked_fp32(logits.detach(), real, float("-inf"))  # the forward's lse, its own way
    m = zm.max(dim=-1).values
    lse = m + torch.log(torch.exp(zm - m[:, None]).sum(dim=-1))
    z = _masked_fp32(logits.detach(), real, 0.0)
    p = torch.exp(z - lse[:, None])
    p[:, real:] = 0.0
    want = torch.zeros_like(p)
    want -= p * d_logp[:, None]
    rows = torch.nonzero((labels >= vocab_start) & (labels < vocab_start + real)).squeeze(1)
    want[rows, labels[rows] - vocab_start] += d_logp[rows]
    assert 0 < len(rows) < T
    assert torch.equal(logits.grad, want.to(dtype))
