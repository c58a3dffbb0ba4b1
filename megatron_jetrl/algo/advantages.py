"""Outcome-reward advantages: one value per response, broadcast to its tokens by the caller.

Responses come prompt-major in groups of ``group_size`` (the n samples of one prompt are
consecutive, as ``RolloutEngine.generate`` returns them). Legend: N responses, G = N / n groups,
r the [N] rewards, r̄_g the mean of r's group, std_g its standard deviation (unbiased, as torch).

    grpo               A_i = (r_i - r̄_g) / (std_g + eps)                      (DeepSeekMath)
    dr_grpo            A_i = r_i - r̄_g             no std scaling (Dr. GRPO; its loss also drops
                                                   per-response length normalisation)
    rloo               A_i = r_i - mean_{j≠i in g} r_j = n/(n-1) · (r_i - r̄_g)     (RLOO)
    reinforce_pp       A_i = (r_i - r̄) / (std + eps)    over the whole batch (REINFORCE++,
                                                   outcome reward; global whitening)
    reinforce_pp_baseline
                       A_i = (r_i - r̄_g) / (std(r - r̄_group) + eps)  group mean removed, then
                                                   scaled by the batch std (REINFORCE++-baseline)

A group whose rewards are all equal gets advantage 0 in every estimator (no signal), which is
what DAPO's dynamic sampling then drops.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_jetrl.config import ConfigError, check_integer

EPS = 1e-6


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    check_integer("algo.group_size", group_size, minimum=1)
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size} (prompt-major order)")
    return rewards.double().view(-1, group_size)


def grpo(rewards: torch.Tensor, group_size: int, eps: float = EPS) -> torch.Tensor:
    g = _groups(rewards, group_size)
    std = g.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
    return ((g - g.mean(dim=1, keepdim=True)) / (std + eps)).flatten().float()


def dr_grpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    g = _groups(rewards, group_size)
    return (g - g.mean(dim=1, keepdim=True)).flatten().float()


def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2:
        raise ConfigError("algo.group_size", group_size, "RLOO needs at least 2 samples per prompt")
    g = _groups(rewards, group_size)
    return (group_size / (group_size - 1) * (g - g.mean(dim=1, keepdim=True))).flatten().float()


def reinforce_pp(rewards: torch.Tensor, group_size: int, eps: float = EPS) -> torch.Tensor:
    r = _groups(rewards, group_size).flatten()
    std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    return ((r - r.mean()) / (std + eps)).float()


def reinforce_pp_baseline(rewards: torch.Tensor, group_size: int, eps: float = EPS) -> torch.Tensor:
    g = _groups(rewards, group_size)
    centred = (g - g.mean(dim=1, keepdim=True)).flatten()
    std = centred.std() if centred.numel() > 1 else torch.zeros((), dtype=centred.dtype)
    return (centred / (std + eps)).float()


ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def advantages(name: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """The ``name`` estimator (a key of ``ADVANTAGES``) of prompt-major ``rewards``; [N] fp32."""
    if name not in ADVANTAGES:
        raise ConfigError("algo.advantage", name, f"must be one of {sorted(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_size)
