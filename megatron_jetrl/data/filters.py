"""DAPO's batch shaping as pure tensor functions: dynamic sampling and overlong handling.

Responses come prompt-major in groups of ``group_size`` (the n samples of one prompt are
consecutive). Legend: N responses, G = N / group_size groups.

Dynamic sampling: a group whose rewards are all equal has zero advantage under every estimator,
so it adds nothing but noise to the batch; ``uniform_groups`` finds those groups, the trainer drops
them and samples more prompts until ``select_groups`` can fill the step.

Overlong reward shaping (DAPO eq. 13), with L_max = max_new_tokens, L_cache = buffer_tokens and
p = penalty, for a response of |y| tokens:

    R_length(y) = 0                                   |y| <= L_max - L_cache
                = -p * (|y| - (L_max - L_cache)) / L_cache    L_max - L_cache < |y| <= L_max
                = -p                                  |y| > L_max

(at |y| = L_max the middle line already gives -p). It is added to the task reward. The
alternative, overlong filtering, masks truncated responses out of the loss instead.
"""

from __future__ import annotations

from typing import Sequence

import torch

LENGTH_FINISH_REASON = "length"


def uniform_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [N] → bool [G]: True where every reward of the group is equal (exactly; rewards
    are verifier scores, not noisy floats). NaN rewards are an error."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1; got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size} (prompt-major order)")
    if rewards.is_floating_point() and torch.isnan(rewards).any():
        raise ValueError("rewards hold NaN")
    g = rewards.view(-1, group_size)
    return (g == g[:, :1]).all(dim=1)


def select_groups(keep: torch.Tensor, target_groups: int) -> list[int]:
    """keep bool [G] → the indices of the first ``target_groups`` kept groups, in order (fewer if
    fewer are kept: the caller decides whether to sample more)."""
    if keep.dim() != 1 or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a 1-D bool tensor [G]; got {keep.dtype} of shape {tuple(keep.shape)}")
    if isinstance(target_groups, bool) or not isinstance(target_groups, int) or target_groups < 0:
        raise ValueError(f"target_groups must be an integer >= 0; got {target_groups!r}")
    return keep.nonzero().flatten()[:target_groups].tolist()


def overlong_penalty(response_lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int,
                     penalty: float) -> torch.Tensor:
    """response_lengths [N] (tokens, EOS included if generated) → float32 [N] of R_length <= 0
    (formula in the module docstring). Needs 1 <= buffer_tokens <= max_new_tokens."""
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths must be 1-D [N]; got shape {tuple(response_lengths.shape)}")
    if not 1 <= buffer_tokens <= max_new_tokens:
        raise ValueError(f"buffer_tokens ({buffer_tokens}) must be in [1, max_new_tokens ({max_new_tokens})]")
    if penalty < 0:
        raise ValueError(f"penalty must be >= 0; got {penalty}")
    start = max_new_tokens - buffer_tokens
    over = (response_lengths.double() - start) / buffer_tokens
    return (-penalty * over.clamp(0.0, 1.0)).float()


def overlong_filter_mask(finish_reasons: Sequence[str]) -> torch.Tensor:
    """finish_reasons [N] → bool [N]: True for responses cut off by the length limit (finish reason
    ``"length"``), which overlong filtering excludes from the loss."""
    return torch.tensor([r == LENGTH_FINISH_REASON for r in finish_reasons], dtype=torch.bool)
