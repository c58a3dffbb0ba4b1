"""Rollout correction: reweight or drop tokens where the trainer and the rollout engine disagree.

The engine samples from π_rollout while the trainer computes π_old for the same weights; kernels,
precision (FP8 rollout) and MoE routing make them differ. With ρ_t = π_old(y_t) / π_rollout(y_t),
from logprobs with log ρ_t clamped to [−20, 20], and only loss-mask tokens counted:

    none       w_t = 1
    token_tis  w_t = min(ρ_t, C)                                  truncated IS (Yao et al.)
    seq_tis    w_i = min(exp(Σ_{t in i} log ρ_t), C), broadcast to the sequence's tokens
    token_mis  w_t = ρ_t if low <= ρ_t <= high, else the token is dropped        masked IS
    seq_mis    ρ_i = exp(Σ_{t in i} log ρ_t) (the sequence likelihood ratio, as seq_tis and verl's
               "sequence" level; not the geometric mean): w_i = ρ_i inside [low, high], else
               the whole sequence is dropped
    icepop     token_mis under its paper's name: IcePop's M(k) = k on [α, β], 0 outside
               (α = low, β = high)

A sequence sum Σ log ρ_t is clamped to [−20, 20] again before exp. Sequence ratios multiply over
tokens, so with long responses seq_mis rejects much more than token_mis at the same bounds.

``weights`` multiply the per-token policy loss (the batch field ``is_weights``; see
``policy_loss``). A dropped token gets weight 0 *and* is removed from the returned ``loss_mask``:
training with the returned mask normalises by the kept tokens (verl's rejection sampling);
training with the input mask and these weights normalises by all tokens (IcePop's formula).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_jetrl.algo.loss import check_cu_seqlens, segment_sum, to_tokens
from megatron_jetrl.algo.settings import CorrectionSettings

SEQUENCE_MODES = ("seq_tis", "seq_mis")


@dataclass(frozen=True)
class Correction:
    """Per-token weights [T] fp32 (stop-gradient; 1.0 off the loss mask and in mode ``none``), the
    loss mask [T] with dropped tokens zeroed (input dtype), and batch metrics:

    ``rollout_corr/is_weight_mean``   mean weight over the tokens kept
    ``rollout_corr/clipped_fraction`` loss-mask tokens whose weight TIS truncated at C
    ``rollout_corr/masked_fraction``  loss-mask tokens dropped (MIS, IcePop)
    ``rollout_corr/seq_masked_fraction`` sequences (with a loss-mask token) that lost at least one
                                      token
    ``rollout_corr/ratio_max`` / ``ratio_min``  ρ at the mode's level (per sequence for seq_*,
                                      per token otherwise) before truncation or masking
    """

    weights: torch.Tensor
    loss_mask: torch.Tensor
    metrics: dict[str, float]


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    settings: CorrectionSettings,
) -> Correction:
    """Correction weights and mask for a packed batch ([T] tensors, ``cu_seqlens`` [B+1]); see the
    module docstring for the formulas of each ``settings.mode``."""
    if not isinstance(settings, CorrectionSettings):
        raise TypeError(f"rollout_correction needs a CorrectionSettings; got {type(settings).__name__}")
    for name, t in (("rollout_logprobs", rollout_logprobs), ("loss_mask", loss_mask)):
        if t.shape != old_logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; old_logprobs has {tuple(old_logprobs.shape)}")
    if old_logprobs.dim() != 1:
        raise ValueError(f"old_logprobs must be 1-D [T] (packed); got shape {tuple(old_logprobs.shape)}")
    num_tokens = old_logprobs.numel()
    check_cu_seqlens(cu_seqlens, num_tokens)
    keep = loss_mask > 0
    n_tokens = int(keep.sum())
    if n_tokens == 0:
        raise ValueError("loss_mask selects no token; there is nothing to correct")

    zero = torch.zeros((), dtype=torch.float64, device=old_logprobs.device)
    diff = old_logprobs.detach().double() - rollout_logprobs.detach().double()
    log_rho = torch.where(keep, diff.clamp(-20.0, 20.0), zero)
    mode = settings.mode
    n_B = segment_sum(keep.float(), cu_seqlens)
    has_tokens_B = n_B > 0
    if mode in SEQUENCE_MODES:
        rho_B = torch.exp(segment_sum(log_rho, cu_seqlens).clamp(-20.0, 20.0))
        rho = to_tokens(rho_B, cu_seqlens, num_tokens)
        ratio_max, ratio_min = rho_B[has_tokens_B].max(), rho_B[has_tokens_B].min()
    else:
        rho = torch.exp(log_rho)
        ratio_max, ratio_min = rho[keep].max(), rho[keep].min()

    no = torch.zeros_like(keep)
    if mode == "none":
        weights, clipped, dropped = torch.ones_like(rho), no, no
    elif mode in ("token_tis", "seq_tis"):
        weights, clipped, dropped = rho.clamp(max=settings.clip), rho > settings.clip, no
    else:
        inside = (rho >= settings.low) & (rho <= settings.high)
        weights, clipped, dropped = torch.where(inside, rho, zero), no, ~inside
    clipped, dropped = clipped & keep, dropped & keep
    kept = keep & ~dropped
    weights = torch.where(keep, weights, torch.ones_like(weights))

    n_kept = int(kept.sum())
    seq_hit = segment_sum(dropped.float(), cu_seqlens) > 0
    metrics = {
        "rollout_corr/is_weight_mean": float(weights[kept].sum() / n_kept) if n_kept else 0.0,
        "rollout_corr/clipped_fraction": int(clipped.sum()) / n_tokens,
        "rollout_corr/masked_fraction": int(dropped.sum()) / n_tokens,
        "rollout_corr/seq_masked_fraction": int(seq_hit.sum()) / int(has_tokens_B.sum()),
        "rollout_corr/ratio_max": float(ratio_max),
        "rollout_corr/ratio_min": float(ratio_min),
    }
    return Correction(weights=weights.float(), loss_mask=loss_mask.masked_fill(dropped, 0), metrics=metrics)
