"""Per-token log-probability and entropy from vocab-parallel logits, in fp32.

Each tensor-parallel rank holds logits for its slice of the vocabulary, [T, V/TP], in the model's
dtype. The full softmax is never gathered: three all-reduces over the TP group (max, sum of
exponentials, the target logit; one more for entropy) give

    log p(y_t) = z_t[y_t] − lse_t,  lse_t = log Σ_v exp z_t[v]
    H_t       = lse_t − Σ_v p_t[v] z_t[v]

Vocabulary rows past the tokenizer's size (megatron pads the vocab to 128 × TP) are excluded, so
the result equals a softmax over the real vocabulary (the HF model's). The backward pass
recomputes p from the saved logits and lse instead of keeping an fp32 [T, V/TP] tensor alive:

    ∂ log p(y_t) / ∂ z_t[v] = 1[v = y_t] − p_t[v]
    ∂ H_t / ∂ z_t[v]        = p_t[v] (Σ_u p_t[u] z_t[u] − z_t[v])

Two implementations of the per-chunk arithmetic (``impl``): ``eager``, torch ops one after another
(the reference: about 40 full-size fp32 reads and writes of [T, V/TP] per micro-batch, forward
with entropy and backward; with a 151,936-word vocabulary and 8,192-token micro-batches ~200 GB of
memory traffic, an estimated half of the actor step's elementwise time measured on an H200), and
``compiled``, the same formulas as pure functions under ``torch.compile``: each pass reads the BF16
logits once (three short passes forward, one backward, writing the gradient once). Reductions
and ``exp`` may round differently from the eager kernels (within a few fp32 ulps); the
all-reduces over the TP group stay outside the compiled code.

A third, ``exact`` (``precision.exact``), takes log p(y_t) from the kernel vLLM's sampler computes
the rollout's logprobs with (``ops.exact.VllmKernels.token_logprobs``, over the logits of the real
vocabulary), so both are equal bit for bit; lse, entropy and the backward are ``compiled``'s (the
gradient need not match anything). Under tensor parallelism the kernel reads whole rows, as vLLM's
sampler does after gathering its LM head's slices: the TP ranks all-gather theirs, a chunk of rows
at a time (one [rows, V] copy per chunk, forward only).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


CHUNK_ELEMENTS = 2**27
"""Rows are processed in chunks of about this many logits (512 MiB of fp32 temporaries), so a long
micro-batch never holds several fp32 copies of its [T, V/TP] logits."""


def _chunks(rows: int, cols: int):
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _masked_fp32(logits: torch.Tensor, real: int, fill: float) -> torch.Tensor:
    z = logits.float()
    if real < z.shape[-1]:
        if z.data_ptr() == logits.data_ptr():
            z = z.clone()
        z[:, real:] = fill
    return z


def _label_columns(labels: torch.Tensor, vocab_start: int, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which labels this rank's real columns hold, and each label's column here (clamped in range
    for the others, whose values are then masked out)."""
    local = (labels >= vocab_start) & (labels < vocab_start + real)
    return local, (labels - vocab_start).clamp(0, max(real - 1, 0))


def _forward_buffers(logits_TV, vocab_start: int, vocab_size: int, with_entropy: bool):
    """This rank's count of real vocabulary columns and the forward's fp32 outputs per row (lse,
    logp, and Σ p z with entropy)."""
    T, v_local = logits_TV.shape
    real = min(max(vocab_size - vocab_start, 0), v_local)
    lse = torch.empty(T, device=logits_TV.device, dtype=torch.float32)
    return real, lse, torch.empty_like(lse), torch.empty_like(lse) if with_entropy else None


def _save_for_backward(ctx, logits_TV, labels_T, lse, logp, sum_pz, vocab_start: int, real: int, with_entropy):
    """What both implementations keep for their backward; returns the forward's outputs."""
    ctx.save_for_backward(logits_TV, labels_T, lse, sum_pz if with_entropy else lse)
    ctx.vocab = (vocab_start, real)
    ctx.with_entropy = with_entropy
    return logp, (lse - sum_pz if with_entropy else None)


def _real_columns(z: torch.Tensor, real: int) -> torch.Tensor:
    return torch.arange(z.shape[-1], device=z.device)[None, :] < real


def _chunk_max(logits: torch.Tensor, real: int) -> torch.Tensor:
    z = logits.float()
    return torch.where(_real_columns(z, real), z, float("-inf")).max(dim=-1).values


def _chunk_sums(logits, m, labels, vocab_start: int, real: int):
    """Σ exp(z − m) over the real columns, and the label's logit where this rank holds it (else 0)."""
    z = logits.float()
    e = torch.where(_real_columns(z, real), torch.exp(z - m[:, None]), 0.0)
    local, idx = _label_columns(labels, vocab_start, real)
    target = torch.where(local, z.gather(1, idx[:, None]).squeeze(1), 0.0)
    return e.sum(dim=-1), target


def _chunk_sum_pz(logits, m, s, real: int):
    """Σ p z over the real columns, p = exp(z − m) / s."""
    z = logits.float()
    p = torch.exp(z - m[:, None]) / s[:, None]
    return torch.where(_real_columns(z, real) & (p > 0), p * z, 0.0).sum(dim=-1)


def _chunk_grad(logits, labels, lse, d_logp, sum_pz, d_entropy, vocab_start: int, real: int):
    """The logits' gradient of one chunk (see the module docstring), in the logits' dtype;
    ``d_logp`` / ``d_entropy`` may be None."""
    z = logits.float()
    cols = _real_columns(z, real)
    p = torch.where(cols, torch.exp(z - lse[:, None]), 0.0)
    g = torch.zeros_like(p)
    if d_logp is not None:
        local, idx = _label_columns(labels, vocab_start, real)
        hit = (torch.arange(z.shape[-1], device=z.device)[None, :] == idx[:, None]) & local[:, None]
        g = torch.where(hit, d_logp[:, None], 0.0) - p * d_logp[:, None]
    if d_entropy is not None:
        g = g + p * (sum_pz[:, None] - torch.where(cols, z, 0.0)) * d_entropy[:, None]
    return g.to(logits.dtype)


@functools.cache
def _compiled(fn):
    """``fn`` under torch.compile (dynamic shapes: chunks and micro-batches vary), made once."""
    return torch.compile(fn, dynamic=True)


class _CompiledVocabParallelLogprobs(torch.autograd.Function):
    """The same function as ``_VocabParallelLogprobs`` with each chunk's arithmetic fused."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, vocab_start: int, vocab_size: int, group, with_entropy: bool):
        real, lse, logp, sum_pz = _forward_buffers(logits_TV, vocab_start, vocab_size, with_entropy)
        for a, b in _chunks(*logits_TV.shape):
            chunk, labels = logits_TV[a:b], labels_T[a:b]
            m = _all_reduce(_compiled(_chunk_max)(chunk, real), dist.ReduceOp.MAX, group)
            s, target = _compiled(_chunk_sums)(chunk, m, labels, vocab_start, real)
            s = _all_reduce(s, dist.ReduceOp.SUM, group)
            lse[a:b] = m + torch.log(s)
            logp[a:b] = _all_reduce(target, dist.ReduceOp.SUM, group) - lse[a:b]
            if with_entropy:
                sum_pz[a:b] = _all_reduce(_compiled(_chunk_sum_pz)(chunk, m, s, real), dist.ReduceOp.SUM, group)
        return _save_for_backward(ctx, logits_TV, labels_T, lse, logp, sum_pz, vocab_start, real, with_entropy)

    @staticmethod
    def backward(ctx, d_logp, d_entropy):
        logits_TV, labels_T, lse, sum_pz = ctx.saved_tensors
        vocab_start, real = ctx.vocab
        d_entropy = d_entropy if ctx.with_entropy else None
        grad_TV = torch.empty_like(logits_TV)
        for a, b in _chunks(*logits_TV.shape):
            grad_TV[a:b] = _compiled(_chunk_grad)(
                logits_TV[a:b], labels_T[a:b], lse[a:b], None if d_logp is None else d_logp[a:b],
                sum_pz[a:b], None if d_entropy is None else d_entropy[a:b], vocab_start, real)
        return grad_TV, None, None, None, None, None


class _ExactLogprobs(torch.autograd.Function):
    """``compiled``'s function with log p(y_t) from ``token_logprobs`` (module docstring)."""

    @staticmethod
    def forward(ctx, logits_TV, labels_T, vocab_start: int, vocab_size: int, group, with_entropy: bool,
                token_logprobs):
        _, entropy = _CompiledVocabParallelLogprobs.forward(ctx, logits_TV, labels_T, vocab_start, vocab_size,
                                                            group, with_entropy)
        logp = torch.empty(logits_TV.shape[0], device=logits_TV.device, dtype=torch.float32)
        tp = dist.get_world_size(group) if group is not None else 1
        for a, b in _chunks(logits_TV.shape[0], logits_TV.shape[1] * tp):
            full = _full_vocabulary(logits_TV[a:b], vocab_start, group)
            logp[a:b] = token_logprobs(full[:, :vocab_size], labels_T[a:b, None]).squeeze(1)
        return logp, entropy

    @staticmethod
    def backward(ctx, d_logp, d_entropy):
        return (*_CompiledVocabParallelLogprobs.backward(ctx, d_logp, d_entropy), None)


def _full_vocabulary(logits: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """These rows' logits over the whole (padded) vocabulary: the TP ranks' slices side by side, in
    rank order, as vLLM gathers its LM head's (a copy; the slices are all-gathered under TP)."""
    if group is None or dist.get_world_size(group) == 1:
        if vocab_start != 0:
            raise ValueError(f"exact logprobs without a TP group need the whole vocabulary here; this slice starts at "
                             f"column {vocab_start}")
        return logits
    if vocab_start != dist.get_rank(group) * logits.shape[1]:
        raise ValueError(f"exact logprobs: this rank's vocabulary slice starts at {vocab_start}, not at its TP rank x "
                         f"{logits.shape[1]} columns")
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TV, labels_T, vocab_start: int, vocab_size: int, group, with_entropy: bool):
        real, lse, logp, sum_pz = _forward_buffers(logits_TV, vocab_start, vocab_size, with_entropy)
        for a, b in _chunks(*logits_TV.shape):
            z = _masked_fp32(logits_TV[a:b], real, float("-inf"))
            m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
            e = torch.exp(z - m[:, None])
            s = _all_reduce(e.sum(dim=-1), dist.ReduceOp.SUM, group)
            lse[a:b] = m + torch.log(s)
            local, idx = _label_columns(labels_T[a:b], vocab_start, real)
            target = torch.where(local, z.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(m))
            logp[a:b] = _all_reduce(target, dist.ReduceOp.SUM, group) - lse[a:b]
            if with_entropy:
                e.div_(s[:, None])
                pz = torch.where(e > 0, e * z, torch.zeros_like(e))
                sum_pz[a:b] = _all_reduce(pz.sum(dim=-1), dist.ReduceOp.SUM, group)
        return _save_for_backward(ctx, logits_TV, labels_T, lse, logp, sum_pz, vocab_start, real, with_entropy)

    @staticmethod
    def backward(ctx, d_logp, d_entropy):
        logits_TV, labels_T, lse, sum_pz = ctx.saved_tensors
        vocab_start, real = ctx.vocab
        T, v_local = logits_TV.shape
        grad_TV = torch.empty_like(logits_TV)
        for a, b in _chunks(T, v_local):
            z = _masked_fp32(logits_TV[a:b], real, 0.0)
            p = torch.exp(z - lse[a:b, None])
            if real < v_local:
                p[:, real:] = 0.0
            g = torch.zeros_like(p)
            if d_logp is not None:
                g -= p * d_logp[a:b, None]
                # + d_logp at each row's label column, on the rank that holds it; without selecting
                # the rows (a nonzero() would make the host wait for the GPU): the other rows add 0.0
                # to a column of their own, which leaves it bit for bit as it is (g is never -0.0).
                local, idx = _label_columns(labels_T[a:b], vocab_start, real)
                g.scatter_add_(1, idx[:, None], torch.where(local, d_logp[a:b], 0.0)[:, None])
            if ctx.with_entropy and d_entropy is not None:
                g += p * (sum_pz[a:b, None] - z) * d_entropy[a:b, None]
            grad_TV[a:b] = g.to(grad_TV.dtype)
        return grad_TV, None, None, None, None, None


def vocab_parallel_logprobs(
    logits_TV: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Optional[dist.ProcessGroup] = None,
    with_entropy: bool = False,
    impl: str = "eager",
    token_logprobs=None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(labels) [T], entropy [T] or None), fp32, differentiable w.r.t. ``logits_TV``.

    Args:
        logits_TV: this rank's vocab slice of the logits, columns
            ``vocab_start .. vocab_start + V/TP``.
        labels_T: global token ids to score.
        vocab_size: the real vocabulary size; columns at or past it are ignored.
        group: the tensor-parallel group holding the other slices (None: the full vocab is here).
        impl: ``eager`` (the reference), ``compiled`` (fused chunks) or ``exact`` (log p from
            ``token_logprobs(logits [M, V], ids [M, 1]) -> [M, 1]``; module docstring).
    """
    if logits_TV.dim() != 2 or labels_T.shape != logits_TV.shape[:1]:
        raise ValueError(f"logits must be [T, V] and labels [T]; got {tuple(logits_TV.shape)}, {tuple(labels_T.shape)}")
    if impl not in LOGPROB_IMPLS:
        raise ValueError(f"impl {impl!r}: one of {', '.join(LOGPROB_IMPLS)}")
    args = (logits_TV, labels_T, int(vocab_start), int(vocab_size), group, with_entropy)
    if impl == "exact":
        if token_logprobs is None:
            raise ValueError("impl 'exact' needs the token_logprobs kernel (ops.exact.VllmKernels.token_logprobs)")
        return _ExactLogprobs.apply(*args, token_logprobs)
    return LOGPROB_IMPLS[impl].apply(*args)


LOGPROB_IMPLS = {"eager": _VocabParallelLogprobs, "compiled": _CompiledVocabParallelLogprobs, "exact": _ExactLogprobs}
