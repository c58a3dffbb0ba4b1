"""Vocab-parallel logprobs and entropy over a TP=2 gloo group equal a full-vocab log_softmax on one
process, values and gradients, with the padded vocab tail split across ranks."""

import os

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


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=TP)
    try:
        from megatron_jetrl.actor.logprobs import vocab_parallel_logprobs

        logits, labels, w_lp, w_ent = _inputs()
        width = V_PADDED // TP
        local = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_()
        lp, ent = vocab_parallel_logprobs(local, labels, vocab_start=rank * width, vocab_size=V_REAL,
                                          group=torch.distributed.group.WORLD, with_entropy=True)
        (lp * w_lp + ent * w_ent).sum().backward()
        results.put((rank, lp.tolist(), ent.tolist(), local.grad.tolist(), None))  # tensors die with the process
    except Exception as e:  # reported to the test
        results.put((rank, None, None, None, repr(e)))
    finally:
        torch.distributed.destroy_process_group()


def test_tp2_logprobs_entropy_and_grads_equal_full_vocab():
    port = free_port()
    out = run_ranks(_worker, TP, port, timeout=120)
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
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
        width = V_PADDED // TP
        torch.testing.assert_close(grad, full.grad[:, rank * width:(rank + 1) * width], rtol=1e-5, atol=1e-5)
