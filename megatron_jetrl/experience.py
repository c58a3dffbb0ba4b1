"""One step's rollouts between the engine and the actor: which prompts a rank generates, the
scored groups, dynamic-sampling bookkeeping, and the packed training batch. Pure Python/torch.

Order convention: responses are prompt-major (the ``group_size`` samples of a prompt are
consecutive), as the engines return them and as ``algo.advantages`` expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megatron_jetrl.actor.packing import PackedBatch


@dataclass(frozen=True)
class Response:
    """One scored response. ``score`` is the reward function's; ``reward`` adds shaping (the soft
    overlong penalty). ``truncated``: it ran into ``max_new_tokens`` without a stop token."""

    tokens: list[int]
    logprobs: list[float]
    truncated: bool
    score: float
    reward: float


@dataclass(frozen=True)
class Group:
    """The ``group_size`` responses to one prompt (dataset index ``prompt_index``)."""

    prompt_index: int
    prompt_ids: tuple[int, ...]
    responses: list[Response]

    @property
    def uniform(self) -> bool:
        """All rewards equal: no learning signal in group-relative advantages."""
        rewards = [r.reward for r in self.responses]
        return max(rewards) == min(rewards)


@dataclass
class StepRollouts:
    """The groups kept for training this step, and what it took to collect them."""

    groups: list[Group] = field(default_factory=list)
    rounds: int = 0
    prompts_sampled: int = 0
    groups_generated: int = 0
    reward_timeouts: int = 0
    reward_errors: int = 0

    @property
    def responses(self) -> list[Response]:
        return [r for g in self.groups for r in g.responses]

    def metrics(self) -> dict[str, float]:
        rs = self.responses
        lens = torch.tensor([float(len(r.tokens)) for r in rs])
        rewards = torch.tensor([r.reward for r in rs], dtype=torch.float64)
        scores = torch.tensor([r.score for r in rs], dtype=torch.float64)
        indices = [g.prompt_index for g in self.groups]
        return {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item() if len(rs) > 1 else 0.0,
            "reward/score_mean": scores.mean().item(),
            "response/length_mean": lens.mean().item(),
            "response/length_max": lens.max().item(),
            "response/truncated_fraction": sum(r.truncated for r in rs) / len(rs),
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/kept_fraction": len(self.groups) / max(1, self.groups_generated),
            "data/prompts_sampled": float(self.prompts_sampled),
            "data/prompt_index_fingerprint": float(fingerprint(indices)),
            "reward/timeouts": float(self.reward_timeouts),
            "reward/errors": float(self.reward_errors),
        }


def fingerprint(indices: Sequence[int]) -> int:
    """An order-sensitive 24-bit checksum of a batch's prompt indices (exact in a float32 log), so
    two runs can be compared batch by batch from their metrics."""
    h = 0
    for i in indices:
        h = (h * 1000003 + int(i) + 1) % 16777213
    return h


def replica_share(items: Sequence[Any], replica: int, replicas: int) -> list[int]:
    """Positions of ``items`` that rollout replica ``replica`` of ``replicas`` generates: a strided
    split, so the share sizes differ by at most one."""
    return list(range(replica, len(items), replicas))


def prompt_major(pieces: Sequence[Sequence[tuple[int, Any]]]) -> list[Any]:
    """Merge every replica's (position, item) lists into one list ordered by position; each
    position must appear exactly once."""
    merged = sorted((pos, i, item) for part in pieces for i, (pos, item) in enumerate(part))
    positions = [pos for pos, _, _ in merged]
    if positions != list(range(len(positions))):
        raise RuntimeError(f"rollout replicas returned positions {positions}; expected 0..{len(positions) - 1} once")
    return [item for _, _, item in merged]


def training_batch(groups: Sequence[Group], advantages: torch.Tensor, *, mask_truncated: bool) -> PackedBatch:
    """prompt + response sequences with per-token fields: ``loss_mask`` (response tokens; none of a
    truncated response when ``mask_truncated``), ``advantages`` (the response's value on its
    tokens), ``rollout_logprobs`` (the engine's, 0 on prompt tokens)."""
    responses = [(g, r) for g in groups for r in g.responses]
    if advantages.shape != (len(responses),):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected ({len(responses)},)")
    seqs, masks, advs, lps = [], [], [], []
    for (g, r), a in zip(responses, advantages.tolist(), strict=True):
        p, n = len(g.prompt_ids), len(r.tokens)
        if n == 0:
            raise ValueError(f"an empty response to prompt {g.prompt_index}; engines return at least one token")
        keep = 0.0 if (mask_truncated and r.truncated) else 1.0
        seqs.append(torch.tensor([*g.prompt_ids, *r.tokens], dtype=torch.int64))
        masks.append(torch.cat([torch.zeros(p), torch.full((n,), keep)]))
        advs.append(torch.cat([torch.zeros(p), torch.full((n,), float(a))]))
        lps.append(torch.cat([torch.zeros(p), torch.tensor(r.logprobs, dtype=torch.float32)]))
    return PackedBatch.from_sequences(seqs, loss_mask=masks, advantages=advs, rollout_logprobs=lps)


def supervised_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> PackedBatch:
    """prompt + response sequences with ``loss_mask`` on the response tokens (cross-entropy)."""
    seqs = [torch.tensor([*p, *r], dtype=torch.int64) for p, r in zip(prompts, responses, strict=True)]
    masks = [torch.cat([torch.zeros(len(p)), torch.ones(len(r))]) for p, r in zip(prompts, responses, strict=True)]
    return PackedBatch.from_sequences(seqs, loss_mask=masks)
