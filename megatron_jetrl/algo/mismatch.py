"""Train-inference mismatch metrics, under the names other systems log them (verl's rollout_corr/*
and training/*, NeMo-RL's token_mult_prob_error), so numbers compare across frameworks.

Over the loss-mask tokens, in float64, with t = log p_train(y_t), g = log p_rollout(y_t) (the
generating engine), r = p_train / p_rollout = exp(clamp(t − g, −20, 20)):

    rollout_corr/kl                  mean(g − t)          k1 estimate of KL(π_rollout ‖ π_train)
    rollout_corr/k3_kl               mean(r − log r − 1)  k3 estimate of the same KL (>= 0)
    rollout_corr/ppl_ratio           ppl_train / ppl_rollout = exp(mean(g − t)) over all tokens;
                                     with ``cu_seqlens``, verl's form: the mean over sequences of
                                     exp(mean_{t in i}(g − t))
    rollout_corr/chi2_token          mean(r²) − 1
    training/rollout_probs_diff_mean mean |e^t − e^g|     (on probabilities)
    training/rollout_probs_diff_max  max  |e^t − e^g|
    training/rollout_actor_probs_pearson_corr
                                     Pearson correlation of e^t and e^g; where it is undefined
                                     (either side constant, e.g. one token) it is 1.0 if the two
                                     agree exactly and 0.0 otherwise, so the metric is never NaN
    token_mult_prob_error            mean exp(|g − t|)    (1.0 is perfect; < 1.03 is healthy)
    rollout_corr/max_abs_dlogp       max |t − g|          (0 when the two agree bit for bit)
    rollout_corr/unequal_tokens      how many tokens have t != g (the exact rollout's check: 0)
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_jetrl.algo.loss import check_cu_seqlens, segment_sum


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if bool(x.max() == x.min()) or bool(y.max() == y.min()):
        return 1.0 if torch.equal(x, y) else 0.0
    xc, yc = x - x.mean(), y - y.mean()
    corr = (xc * yc).sum() / torch.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float(corr.clamp(-1.0, 1.0))


def mismatch_metrics(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """The module docstring's metrics for [T] logprobs of the same tokens (packed; ``cu_seqlens``
    [B+1] only changes ``ppl_ratio`` to the per-sequence form)."""
    for name, t in (("rollout_logprobs", rollout_logprobs), ("loss_mask", loss_mask)):
        if t.shape != train_logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; train_logprobs has {tuple(train_logprobs.shape)}")
    keep = loss_mask > 0
    if not bool(keep.any()):
        raise ValueError("loss_mask selects no token; mismatch metrics need at least one")
    t = train_logprobs.detach()[keep].double()
    g = rollout_logprobs.detach()[keep].double()
    log_r = (t - g).clamp(-20.0, 20.0)
    r = torch.exp(log_r)
    if cu_seqlens is None:
        ppl_ratio = float(torch.exp((g - t).mean()))
    else:
        check_cu_seqlens(cu_seqlens, train_logprobs.numel())
        zero = torch.zeros((), dtype=torch.float64, device=train_logprobs.device)
        diff = torch.where(keep, rollout_logprobs.detach().double() - train_logprobs.detach().double(), zero)
        n_B = segment_sum(keep.float(), cu_seqlens)
        has = n_B > 0
        ppl_ratio = float(torch.exp(segment_sum(diff, cu_seqlens)[has] / n_B[has]).mean())
    p_train, p_rollout = torch.exp(t), torch.exp(g)
    probs_diff = (p_train - p_rollout).abs()
    abs_dlogp = (g - t).abs()
    return {
        "rollout_corr/kl": float((g - t).mean()),
        "rollout_corr/k3_kl": float((r - log_r - 1.0).mean()),
        "rollout_corr/ppl_ratio": ppl_ratio,
        "rollout_corr/chi2_token": float((r * r).mean() - 1.0),
        "training/rollout_probs_diff_mean": float(probs_diff.mean()),
        "training/rollout_probs_diff_max": float(probs_diff.max()),
        "training/rollout_actor_probs_pearson_corr": _pearson(p_train, p_rollout),
        "token_mult_prob_error": float(torch.exp(abs_dlogp).mean()),
        "rollout_corr/max_abs_dlogp": float(abs_dlogp.max()),
        "rollout_corr/unequal_tokens": float((t != g).sum()),
    }
