"""RL math as pure tensor functions: losses, advantages (and, later, rollout correction, metrics).

Imports torch only; every function is tested on CPU against hand-computed values.
"""

from megatron_jetrl.algo.advantages import ADVANTAGES, advantages
from megatron_jetrl.algo.loss import LossFn, LossInputs, cross_entropy_loss, ppo_clip_loss

__all__ = ["ADVANTAGES", "LossFn", "advantages", "LossInputs", "cross_entropy_loss", "ppo_clip_loss"]
