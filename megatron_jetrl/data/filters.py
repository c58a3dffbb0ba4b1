"""DAPO's overlong reward shaping as a pure tensor function. (Dynamic sampling lives with the
rollout groups: ``rollouts.Group.uniform`` and ``Trainer.collect``; overlong *filtering*, which
masks truncated responses out of the loss, is ``rollouts.training_batch(mask_truncated=...)``.)

Overlong reward shaping (DAPO eq. 13), with L_max = max_new_tokens, L_cache = buffer_tokens and
p = penalty, for a response of |y| tokens:

    R_length(y) = 0                                   |y| <= L_max - L_cache
                = -p * (|y| - (L_max - L_cache)) / L_cache    L_max - L_cache < |y| <= L_max
                = -p                                  |y| > L_max

(at |y| = L_max the middle line already gives -p). It is added to the task reward.
"""

from __future__ import annotations

import torch


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
