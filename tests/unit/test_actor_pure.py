"""The actor's pure parts: packing, micro-batch / data-parallel plans, vocab-parallel logprobs on
one process, settings validation, and the packed attention reference."""

import math

import pytest
import torch

from megatron_jetrl.actor.logprobs import CHUNK_ELEMENTS, vocab_parallel_logprobs
from megatron_jetrl.actor.packing import (
    PackedBatch,
    align_to_tokens,
    next_token_labels,
    partition_for_data_parallel,
    plan_batch,
    plan_micro_batches,
)
from megatron_jetrl.actor.settings import ActorSettings, OptimizerSettings
from megatron_jetrl.config import ConfigError
from megatron_jetrl.models import ParallelLayout


def test_packed_batch_from_sequences_and_select():
    b = PackedBatch.from_sequences([[1, 2, 3], [4, 5], [6]], loss_mask=[[0, 1, 1], [0, 1], [0]])
    assert b.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 6]
    assert b.seq_lens == [3, 2, 1]
    s = b.select([2, 0])
    assert s.tokens.tolist() == [6, 1, 2, 3]
    assert s.fields["loss_mask"].tolist() == [0, 0, 1, 1]
    assert s.cu_seqlens.tolist() == [0, 1, 4]


def test_packed_batch_rejects_bad_input():
    with pytest.raises(ValueError, match="field 'loss_mask' of sequence 1 has 1 values for 2 tokens"):
        PackedBatch.from_sequences([[1, 2], [3, 4]], loss_mask=[[0, 1], [1]])
    with pytest.raises(ValueError, match="at least one token"):
        PackedBatch(torch.tensor([1, 2]), torch.tensor([0, 0, 2]))
    with pytest.raises(ValueError, match="at least one sequence"):
        PackedBatch.from_sequences([])


def test_padded_to_appends_one_padding_sequence():
    b = PackedBatch.from_sequences([[1, 2, 3], [4, 5]], loss_mask=[[0, 1, 1], [0, 1]])
    p = b.padded_to(4)
    assert p.tokens.tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert p.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert p.fields["loss_mask"].tolist() == [0, 1, 1, 0, 1, 0, 0, 0]
    assert b.padded_to(5) is b


def test_labels_and_alignment_roundtrip():
    tokens = torch.tensor([10, 11, 12, 20, 21])
    cu = torch.tensor([0, 3, 5])
    labels = next_token_labels(tokens, cu)
    assert labels.tolist() == [11, 12, 0, 21, 0]
    per_position = torch.tensor([1.0, 2.0, 9.0, 3.0, 9.0])  # score of labels[t]
    assert align_to_tokens(per_position, cu).tolist() == [0.0, 1.0, 2.0, 0.0, 3.0]


def test_partition_balances_tokens_and_is_deterministic():
    lens = [100, 1, 50, 50, 2, 98]
    parts = partition_for_data_parallel(lens, 2)
    assert sorted(i for p in parts for i in p) == list(range(6))
    loads = [sum(lens[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 3
    assert parts == partition_for_data_parallel(lens, 2)
    with pytest.raises(ValueError, match="every data-parallel rank needs at least one sequence"):
        partition_for_data_parallel([5, 5], 4)


def test_micro_batches_respect_budget_and_keep_long_sequences_alone():
    lens = [5, 9, 3, 20, 4, 4]
    plan = plan_micro_batches(lens, 10)
    assert sorted(i for mb in plan for i in mb) == list(range(6))
    for mb in plan:
        total = sum(lens[i] for i in mb)
        assert total <= 10 or len(mb) == 1
    assert [3] in plan


def test_plan_batch_gives_each_rank_its_share_in_micro_batches():
    lens = [100, 1, 50, 50, 2, 98, 30]
    plan = plan_batch(lens, 2, 120)
    shards = partition_for_data_parallel(lens, 2)
    assert len(plan) == 2
    for groups, shard in zip(plan, shards, strict=True):
        assert sorted(i for g in groups for i in g) == shard
        assert all(sum(lens[i] for i in g) <= 120 or len(g) == 1 for g in groups)
    assert plan == plan_batch(lens, 2, 120)


def _reference(logits, labels, vocab_size):
    z = logits.float()[:, :vocab_size]
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    return logp.gather(1, labels[:, None]).squeeze(1), -(p * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_match_log_softmax_with_vocab_padding(dtype):
    torch.manual_seed(0)
    T, V, real = 7, 40, 33
    logits = (torch.randn(T, V) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, real, (T,))
    lp, ent = vocab_parallel_logprobs(logits, labels, vocab_start=0, vocab_size=real, with_entropy=True)
    ref_logits = logits.detach().clone().requires_grad_()
    ref_lp, ref_ent = _reference(ref_logits, labels, real)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    w1, w2 = torch.randn(T), torch.randn(T)
    (lp * w1 + ent * w2).sum().backward()
    (ref_lp * w1 + ref_ent * w2).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad.float(), rtol=tol, atol=tol)
    assert (logits.grad[:, real:] == 0).all()


def test_logprobs_chunking_gives_the_same_result(monkeypatch):
    torch.manual_seed(1)
    logits = torch.randn(9, 16, requires_grad=True)
    labels = torch.randint(0, 16, (9,))
    whole, _ = vocab_parallel_logprobs(logits, labels, vocab_start=0, vocab_size=16)
    g_whole, = torch.autograd.grad(whole.sum(), logits)
    monkeypatch.setattr("megatron_jetrl.actor.logprobs.CHUNK_ELEMENTS", 32)  # 2 rows per chunk
    chunked, _ = vocab_parallel_logprobs(logits, labels, vocab_start=0, vocab_size=16)
    g_chunked, = torch.autograd.grad(chunked.sum(), logits)
    assert CHUNK_ELEMENTS > 32
    assert torch.equal(whole, chunked) and torch.equal(g_whole, g_chunked)


def test_logprobs_do_not_modify_fp32_logits():
    logits = torch.randn(3, 8)
    before = logits.clone()
    vocab_parallel_logprobs(logits, torch.tensor([0, 1, 2]), vocab_start=0, vocab_size=5, with_entropy=True)
    assert torch.equal(logits, before)


def test_settings_validation_names_the_key():
    with pytest.raises(ConfigError, match="actor.fp8_backend"):
        ActorSettings(fp8_backend="cublas")
    with pytest.raises(ConfigError, match="actor.max_tokens_per_microbatch"):
        ActorSettings(max_tokens_per_microbatch=0)
    with pytest.raises(ConfigError, match="actor.attention_impl.*set actor.attention_impl=torch"):
        ActorSettings(fp8_backend="te", attention_impl="te")  # TE's layers attend with TE already
    with pytest.raises(ConfigError, match="actor.attention_impl"):
        ActorSettings(attention_impl="flash")
    with pytest.raises(ConfigError, match="actor.optimizer.min_lr"):
        OptimizerSettings(lr=1e-6, min_lr=1e-5)
    with pytest.raises(ConfigError, match="actor.optimizer.decay_steps"):
        OptimizerSettings(decay_style="cosine")
    with pytest.raises(ConfigError, match=r"TP x PP = 4 must divide the world size \(6 processes\)"):
        ActorSettings(parallel=ParallelLayout(tp=2, pp=2)).data_parallel_size(6)
    assert ActorSettings(parallel=ParallelLayout(tp=2)).data_parallel_size(8) == 4


def test_te_attention_is_refused_without_te_and_in_the_exact_mode(monkeypatch):
    pytest.importorskip("megatron.core")
    import importlib.util

    from megatron_jetrl.actor.build import check_te_attention
    from megatron_jetrl.precision import PrecisionRecipe

    assert check_te_attention(ActorSettings()) is False  # torch's: nothing to check
    with pytest.raises(ConfigError, match="actor.attention_impl.*precision.exact"):
        ActorSettings(precision=PrecisionRecipe(mode="fp8", exact=True), attention_impl="te")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="actor.attention_impl.*Transformer Engine is not installed"):
        check_te_attention(ActorSettings(attention_impl="te"))


def test_packed_attention_reference_equals_masked_softmax():
    pytest.importorskip("megatron.core")
    from megatron_jetrl.actor.layers import reference_packed_causal_attention

    torch.manual_seed(0)
    T, Hq, Hkv, D = 9, 4, 2, 8
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    cu = torch.tensor([0, 4, 9])
    out = reference_packed_causal_attention(q, k, v, cu, 1 / math.sqrt(D))
    seg = torch.repeat_interleave(torch.arange(2), torch.tensor([4, 5]))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(D)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("hts,shd->thd", probs, vv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_sync_free_grad_norm_is_the_l2_norm_and_replaces_only_megatrons_fallback(monkeypatch):
    """megatron's clipping without apex/TE reads every parameter's norm to the host; the actor points
    it at a foreach norm that stays on the device (same value up to fp32 summation order)."""
    pytest.importorskip("megatron.core")
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    from megatron_jetrl.actor.build import foreach_l2_norm, use_sync_free_grad_norm

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * s for n, s in ((1000, 1e-3), (37, 5.0), (4096, 0.2))]
    norm, none = foreach_l2_norm(2048 * 32, torch.zeros(1, dtype=torch.int), [grads], False)
    assert none is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], torch.linalg.vector_norm(torch.cat(grads)), rtol=1e-6, atol=0)
    with pytest.raises(NotImplementedError, match="per-tensor"):
        foreach_l2_norm(2048 * 32, None, [grads], True)

    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
    use_sync_free_grad_norm()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    apex_like = object()
    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex_like)
    use_sync_free_grad_norm()
    assert clip_grads.l2_norm_impl is apex_like


@pytest.mark.parametrize("vocab_start", [0, 96])
def test_compiled_logprobs_equal_the_eager_reference(monkeypatch, vocab_start):
    """``impl="compiled"``: the same logprobs, entropy and gradients (logprob and entropy terms,
    padded vocabulary columns, labels held by another rank) as the eager ops, over several chunks
    of varying rows, up to fp32 rounding; BF16 logits give BF16 gradients."""
    import megatron_jetrl.actor.logprobs as lp_mod

    monkeypatch.setattr(lp_mod, "CHUNK_ELEMENTS", 160 * 7)  # chunks of 7 rows: 3 chunks of 7 and one of 2
    g = torch.Generator().manual_seed(5)
    T, width, vocab_size = 23, 160, vocab_start + 130  # 130 real columns of 160 here
    labels = torch.randint(0, vocab_size + vocab_start, (T,), generator=g).clamp(max=vocab_size - 1)
    w_lp, w_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        base = torch.randn(T, width, generator=g) * 4
        out = {}
        for impl in ("eager", "compiled"):
            logits = base.to(dtype).requires_grad_()
            lp, ent = vocab_parallel_logprobs(logits, labels, vocab_start=vocab_start, vocab_size=vocab_size,
                                              with_entropy=True, impl=impl)
            (lp * w_lp + ent * w_ent).sum().backward()
            out[impl] = (lp.detach(), ent.detach(), logits.grad)
        (lp_e, ent_e, g_e), (lp_c, ent_c, g_c) = out["eager"], out["compiled"]
        torch.testing.assert_close(lp_c, lp_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_c, ent_e, rtol=1e-5, atol=1e-5)
        assert g_c.dtype == dtype and (g_c[:, vocab_size - vocab_start:] == 0).all()
        torch.testing.assert_close(g_c.float(), g_e.float(), rtol=tol, atol=1e-6)
    # logprobs alone (the logprob pass), no entropy
    logits = base.to(torch.float32)
    got, none = vocab_parallel_logprobs(logits, labels, vocab_start=vocab_start, vocab_size=vocab_size,
                                        impl="compiled")
    want, _ = vocab_parallel_logprobs(logits, labels, vocab_start=vocab_start, vocab_size=vocab_size)
    assert none is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl 'fused'"):
        vocab_parallel_logprobs(logits, labels, vocab_start=vocab_start, vocab_size=vocab_size, impl="fused")


def test_release_frees_storages_that_others_still_refer_to():
    """``memory.release`` (what ``Actor.close`` runs on parameters, gradients and optimizer state):
    every storage goes to zero bytes, so views and references kept elsewhere hold no memory;
    storages shared by several tensors count once."""
    from megatron_jetrl.actor.offload import release

    buffer = torch.zeros(1000)
    params = [buffer[:600].view(20, 30), buffer[600:]]  # megatron's parameters: views of one buffer
    kept = {"hook": params[0], "optimizer": torch.ones(50)}  # references that outlive the owner
    assert release([*params, None, kept["optimizer"]], cuda_only=False) == 1000 * 4 + 50 * 4
    assert all(t.untyped_storage().nbytes() == 0 for t in (buffer, params[1], kept["hook"], kept["optimizer"]))
    assert release([buffer], cuda_only=False) == 0  # already empty
    assert release([torch.ones(3)]) == 0  # by default only GPU memory is released
