"""The loss interface between the actor and the algorithms, and the losses themselves.

The actor runs a batch as micro-batches spread over data-parallel ranks. So that the gradient is
the gradient of one batch loss however the batch was split, a loss function returns its
micro-batch's **share** of the batch loss: token sums divided by the batch-wide counts that
``LossInputs`` carries (``global_tokens``, ``global_sequences``). Shares of every micro-batch on
every rank add up to the batch loss. Metrics are shares in the same sense (a clip fraction share
is clipped tokens / ``global_tokens``), so their sum over micro-batches and ranks is the batch mean.
Sequences are whole inside a micro-batch, so per-sequence quantities (GSPO's ratio, a sequence's
token mean) are computed locally from ``cu_seqlens``.

Legend: T = tokens of the micro-batch (packed sequences), B = its sequences, m_t the loss mask,
A_t the advantage, log π the current policy, log π_old the policy that scored the batch before
the update (the recompute phase, or the rollout engine in bypass mode), sg(·) stop-gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Mapping, Optional

import torch

from megatron_jetrl.algo.settings import PolicyLossSettings


@dataclass(frozen=True)
class LossInputs:
    """What a loss sees for one micro-batch; every per-token tensor is [T], aligned with tokens.

    ``logprobs[t]`` = log π(token_t | tokens before t of its sequence) under the current policy,
    fp32, differentiable; 0 at the first token of each sequence (which no loss mask selects).
    ``fields`` holds the batch's per-token inputs by name (``loss_mask``, ``advantages``,
    ``old_logprobs``, ``rollout_logprobs``, ...), sliced to this micro-batch.
    """

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor]
    fields: Mapping[str, torch.Tensor]
    cu_seqlens: torch.Tensor
    global_tokens: float
    """Loss-mask tokens in the whole batch (all micro-batches, all data-parallel ranks); >= 1."""
    global_sequences: int

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.fields["loss_mask"]

    def require(self, *names: str) -> None:
        missing = [n for n in names if n not in self.fields]
        if missing:
            raise KeyError(f"the loss needs batch fields {missing}; the batch has {sorted(self.fields)}")


LossFn = Callable[[LossInputs], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""(inputs) -> (loss share, {metric name: metric share}); see the module docstring."""


def cross_entropy_loss(inp: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised next-token loss, token mean over the batch: −Σ_t m_t log π(y_t) / N_tokens."""
    mask = inp.loss_mask.float()
    loss = -(inp.logprobs * mask).sum() / inp.global_tokens
    return loss, {"loss": loss.detach()}


def segment_sum(x_T: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[B] float64 sums of ``x_T`` over each packed sequence. A float64 prefix sum rather than an
    atomic scatter: deterministic on GPU, and exact enough for sums of ~1e5 fp32 terms."""
    prefix = torch.cat([x_T.new_zeros(1, dtype=torch.float64), x_T.double().cumsum(0)])
    cu = cu_seqlens.to(device=x_T.device, dtype=torch.long)
    return prefix[cu[1:]] - prefix[cu[:-1]]


def to_tokens(v_B: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] with each sequence's value of ``v_B`` repeated over its tokens."""
    lens = cu_seqlens.to(device=v_B.device, dtype=torch.long).diff()
    return torch.repeat_interleave(v_B, lens, output_size=num_tokens)


def check_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """``cu_seqlens`` is [B+1], starts at 0 and ends at T (one host sync)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [B+1] with B >= 1; got shape {tuple(cu_seqlens.shape)}")
    first, last = cu_seqlens[[0, -1]].tolist()
    if first != 0 or last != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to T = {num_tokens} tokens; got {first}..{last}")


def _aggregate(l_T: torch.Tensor, keep_T: torch.Tensor, seq_weight_T: Optional[torch.Tensor], inp: LossInputs,
               mode: str) -> torch.Tensor:
    """This micro-batch's share of the batch loss (see ``policy_loss``)."""
    total = torch.where(keep_T, l_T, torch.zeros_like(l_T))
    if mode == "token-mean":
        return total.sum() / inp.global_tokens
    if mode == "seq-mean-token-sum":
        return total.sum() / inp.global_sequences
    return (total * seq_weight_T).sum() / inp.global_sequences


def _ppo(adv: torch.Tensor, ratio: torch.Tensor, s: PolicyLossSettings):
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    pg = torch.maximum(unclipped, clipped)
    flags = {"clip_fraction": clipped > unclipped}
    if s.dual_clip is not None:
        cap = -adv * s.dual_clip
        negative = adv < 0
        flags["dual_clip_fraction"] = negative & (pg > cap)
        pg = torch.where(negative, torch.minimum(pg, cap), pg)
    return pg, flags, ratio.detach()


def _gspo(adv: torch.Tensor, logprobs: torch.Tensor, log_ratio: torch.Tensor, keep: torch.Tensor,
          cu_seqlens: torch.Tensor, s: PolicyLossSettings):
    mask = keep.float()
    n_B = segment_sum(mask, cu_seqlens)
    log_s_B = segment_sum(log_ratio.detach() * mask, cu_seqlens) / n_B.clamp(min=1.0)
    log_s_T = to_tokens(log_s_B.float(), cu_seqlens, logprobs.numel())
    ratio = torch.exp(logprobs - logprobs.detach() + log_s_T)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - s.gspo_clip_low, 1.0 + s.gspo_clip_high)
    return torch.maximum(unclipped, clipped), {"clip_fraction": clipped > unclipped}, ratio.detach()


def _cispo(adv: torch.Tensor, logprobs: torch.Tensor, ratio: torch.Tensor, s: PolicyLossSettings):
    low, high = 1.0 - s.cispo_clip_low, 1.0 + s.cispo_clip_high
    r = ratio.detach()
    pg = -r.clamp(low, high) * adv * logprobs
    return pg, {"clip_fraction": (r < low) | (r > high)}, r


def policy_loss(inp: LossInputs, settings: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient loss chosen by ``settings`` (``algo.loss``), as a share of the batch loss.

    Per token, with r_t = exp(clamp(log π − log π_old, −20, 20)):

        ppo    l_t = max(−A r_t, −A clip(r_t, 1 − clip_low, 1 + clip_high))
               dual clip c (A < 0 only): l_t = min(l_t, −c A), i.e. the loss is capped at c·|A|
        gspo   s_i = exp(mean_{t in i, m_t = 1} (log π − log π_old))      (sequence ratio)
               s_it = sg(s_i) · exp(log π_t − sg(log π_t))   (value s_i, gradient s_i ∇log π_t)
               l_t = max(−A s_it, −A clip(s_it, 1 − gspo_clip_low, 1 + gspo_clip_high))
        cispo  l_t = −sg(clip(r_t, 1 − cispo_clip_low, 1 + cispo_clip_high)) · A · log π_t
               (MiniMax-M1; the default cispo_clip_low = 1 leaves the weight unbounded below)

    then l_t ← w_t · l_t with w the batch field ``is_weights`` when present (rollout correction,
    token or sequence weight broadcast to tokens; stop-gradient), plus ``kl_coef`` · kl_t against
    the batch field ``ref_logprobs`` (k1: log π − log π_ref; k3: e^d − d − 1 with
    d = clamp(log π_ref − log π, −20, 20)), minus ``entropy_coef`` · H_t. The batch loss is

        token-mean            Σ_t m l / N_tokens
        seq-mean-token-sum    Σ_i Σ_{t in i} m l / N_sequences
        seq-mean-token-mean   Σ_i (Σ_{t in i} m l / max(1, Σ_{t in i} m)) / N_sequences

    Needs fields ``advantages`` and ``old_logprobs``. Metrics (shares; token means over N_tokens
    unless noted): ``loss``; ``pg_loss`` (the weighted policy term, aggregated like the loss);
    ``clip_fraction`` (ppo, gspo: tokens whose clipped term was taken, i.e. that get no gradient;
    cispo: tokens whose IS weight was clipped); ``dual_clip_fraction`` (ppo with ``dual_clip``);
    ``approx_kl`` (k3 estimate of KL(π_old ‖ π) from token ratios); ``ratio_mean`` (r_t; for gspo
    the sequence ratio s_i at each token); ``kl`` (when ``kl_coef`` > 0, the unweighted kl_t).
    """
    inp.require("advantages", "old_logprobs")
    if settings.kl_coef > 0:
        inp.require("ref_logprobs")
    if settings.entropy_coef > 0 and inp.entropy is None:
        raise ValueError("algo.loss.entropy_coef > 0 needs the entropy; LossInputs.entropy is None")
    logprobs = inp.logprobs
    num_tokens = logprobs.numel()
    keep = inp.loss_mask > 0
    adv = inp.fields["advantages"].float()
    log_ratio = (logprobs - inp.fields["old_logprobs"].float()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    per_sequence = settings.type == "gspo" or settings.aggregation == "seq-mean-token-mean"
    if per_sequence:
        check_cu_seqlens(inp.cu_seqlens, num_tokens)

    if settings.type == "ppo":
        pg, flags, shown_ratio = _ppo(adv, ratio, settings)
    elif settings.type == "gspo":
        pg, flags, shown_ratio = _gspo(adv, logprobs, log_ratio, keep, inp.cu_seqlens, settings)
    else:
        pg, flags, shown_ratio = _cispo(adv, logprobs, ratio, settings)
    if "is_weights" in inp.fields:
        pg = pg * inp.fields["is_weights"].detach().float()
    per_token = pg
    kl = None
    if settings.kl_coef > 0:
        ref = inp.fields["ref_logprobs"].float()
        if settings.kl_type == "k1":
            kl = logprobs - ref
        else:
            d = (ref - logprobs).clamp(-20.0, 20.0)
            kl = torch.exp(d) - d - 1.0
        per_token = per_token + settings.kl_coef * kl
    if settings.entropy_coef > 0:
        per_token = per_token - settings.entropy_coef * inp.entropy

    seq_weight = None
    if settings.aggregation == "seq-mean-token-mean":
        n_B = segment_sum(keep.float(), inp.cu_seqlens).clamp(min=1.0)
        seq_weight = to_tokens((1.0 / n_B).float(), inp.cu_seqlens, num_tokens)
    loss = _aggregate(per_token, keep, seq_weight, inp, settings.aggregation)

    with torch.no_grad():
        def token_share(x: torch.Tensor) -> torch.Tensor:
            return torch.where(keep, x.float(), torch.zeros_like(x, dtype=torch.float32)).sum() / inp.global_tokens

        metrics = {
            "loss": loss.detach(),
            "pg_loss": _aggregate(pg.detach(), keep, seq_weight, inp, settings.aggregation),
            **{name: token_share(flag) for name, flag in flags.items()},
            "approx_kl": token_share(ratio - 1.0 - log_ratio),
            "ratio_mean": token_share(shown_ratio),
        }
        if kl is not None:
            metrics["kl"] = token_share(kl)
    return loss, metrics


def make_policy_loss(settings: PolicyLossSettings) -> LossFn:
    """``policy_loss`` bound to ``settings``: the ``LossFn`` handed to ``Actor.update`` (picklable)."""
    if not isinstance(settings, PolicyLossSettings):
        raise TypeError(f"make_policy_loss needs a PolicyLossSettings; got {type(settings).__name__}")
    return partial(policy_loss, settings=settings)


def ppo_clip_loss(
    inp: LossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, token mean over the batch (``policy_loss`` with type ``ppo``):

        r_t = exp(log π(y_t) − log π_old(y_t))
        L   = Σ_t m_t · max(−A_t r_t, −A_t clip(r_t, 1 − clip_low, 1 + clip_high)) / N_tokens

    Needs fields ``advantages`` and ``old_logprobs``; metrics as ``policy_loss``.
    """
    return policy_loss(inp, PolicyLossSettings(type="ppo", clip_low=clip_low, clip_high=clip_high))
