"""The loss interface between the actor and the algorithms, and the two losses the actor needs.

The actor runs a batch as micro-batches spread over data-parallel ranks. So that the gradient is
the gradient of one batch loss however the batch was split, a loss function returns its
micro-batch's **share** of the batch loss: token sums divided by the batch-wide counts that
``LossInputs`` carries (``global_tokens``, ``global_sequences``). Shares of every micro-batch on
every rank add up to the batch loss. Metrics are shares in the same sense (a clip fraction share
is clipped tokens / ``global_tokens``), so their sum over micro-batches and ranks is the batch mean.

Legend: T = tokens of the micro-batch (packed sequences), B = its sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch


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


def ppo_clip_loss(
    inp: LossInputs, *, clip_low: float = 0.2, clip_high: float = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, token mean over the batch:

        r_t = exp(log π(y_t) − log π_old(y_t))
        L   = Σ_t m_t · max(−A_t r_t, −A_t clip(r_t, 1 − clip_low, 1 + clip_high)) / N_tokens

    Needs fields ``advantages`` and ``old_logprobs``. Metrics: ``loss``, ``clip_fraction`` (tokens
    whose clipped term was taken), ``approx_kl`` (k3 estimate of KL(π_old ‖ π)).
    """
    inp.require("advantages", "old_logprobs")
    mask = inp.loss_mask.float()
    adv = inp.fields["advantages"].float()
    log_ratio = (inp.logprobs - inp.fields["old_logprobs"].float()).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    n = inp.global_tokens
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        clip_fraction = ((clipped > unclipped).float() * mask).sum() / n
        approx_kl = ((ratio - 1.0 - log_ratio) * mask).sum() / n
    return loss, {"loss": loss.detach(), "clip_fraction": clip_fraction, "approx_kl": approx_kl}
