"""RL math as pure tensor functions: advantages, policy losses, rollout correction, mismatch metrics,
and the typed ``algo`` settings that choose among them.

Imports torch and ``megatron_jetrl.config`` only; every function is tested on CPU against
hand-computed values.
"""

from megatron_jetrl.algo.advantages import ADVANTAGES, advantages
from megatron_jetrl.algo.correction import Correction, rollout_correction
from megatron_jetrl.algo.loss import (
    LossFn,
    LossInputs,
    cross_entropy_loss,
    make_policy_loss,
    policy_loss,
    ppo_clip_loss,
)
from megatron_jetrl.algo.mismatch import mismatch_metrics
from megatron_jetrl.algo.settings import AlgoSettings, CorrectionSettings, PolicyLossSettings

__all__ = [
    "ADVANTAGES",
    "AlgoSettings",
    "Correction",
    "CorrectionSettings",
    "LossFn",
    "LossInputs",
    "PolicyLossSettings",
    "advantages",
    "cross_entropy_loss",
    "make_policy_loss",
    "mismatch_metrics",
    "policy_loss",
    "ppo_clip_loss",
    "rollout_correction",
]
