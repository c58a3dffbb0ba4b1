"""What the algorithm is given: typed, validated settings (the ``algo`` section of a job config).

Validation happens at construction and names the dotted key, so a bad value fails before any GPU
work. Defaults, and the papers they come from:

    algo.loss.clip_low / clip_high         0.2 / 0.28   PPO ε, DAPO's clip-higher (ε_high > ε_low)
    algo.loss.gspo_clip_low / _high        3e-4 / 4e-4  GSPO paper (sequence ratios sit near 1)
    algo.loss.cispo_clip_low / _high       1.0 / 4.0    CISPO (MiniMax-M1): no lower bound on the
                                                        IS weight (1 − 1 = 0), weight capped at 5
    algo.correction.clip                   2.0          TIS truncation C (Yao et al., verl default)
    algo.correction.low / high             0.5 / 2.0    MIS / IcePop acceptance region [α, β]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_jetrl.algo.advantages import ADVANTAGES
from megatron_jetrl.config import ConfigError, check_fields, check_integer, check_number



def _choice(key: str, value, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(key, value, f"must be one of {allowed}")


@dataclass(frozen=True)
class PolicyLossSettings:
    """The policy objective (``algo.loss``); formulas in ``algo/loss.py``.

    ``type``: ``ppo`` (token-ratio clip, with optional ``dual_clip`` c > 1 that caps the loss of
    negative-advantage tokens at c·|A|), ``gspo`` (sequence ratio, clipped with ``gspo_clip_*``),
    ``cispo`` (clipped, stop-gradient IS weight times log π, bounds ``cispo_clip_*``). ``aggregation``
    turns per-token losses into the batch loss (GSPO's paper uses ``seq-mean-token-mean``; DAPO and
    Dr. GRPO use ``token-mean``). ``kl_coef`` > 0 adds a KL penalty to the reference policy (needs the
    batch field ``ref_logprobs``); ``entropy_coef`` > 0 subtracts an entropy bonus.
    """

    type: Literal["ppo", "gspo", "cispo"] = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: Optional[float] = None
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cispo_clip_low: float = 1.0
    cispo_clip_high: float = 4.0
    aggregation: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k3"] = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        k = "algo.loss"
        check_fields(self, k, ("type", "aggregation", "kl_type"))
        check_number(f"{k}.clip_low", self.clip_low, low=0.0, high=1.0, low_open=True, high_open=True)
        check_number(f"{k}.clip_high", self.clip_high, low=0.0, low_open=True)
        if self.dual_clip is not None:
            check_number(f"{k}.dual_clip", self.dual_clip, low=1.0, low_open=True)
            if self.type != "ppo":
                raise ConfigError(f"{k}.dual_clip", self.dual_clip,
                                  f"applies to type 'ppo' only; remove it for type {self.type!r}")
        check_number(f"{k}.gspo_clip_low", self.gspo_clip_low, low=0.0, high=1.0, low_open=True, high_open=True)
        check_number(f"{k}.gspo_clip_high", self.gspo_clip_high, low=0.0, low_open=True)
        check_number(f"{k}.cispo_clip_low", self.cispo_clip_low, low=0.0, high=1.0)
        check_number(f"{k}.cispo_clip_high", self.cispo_clip_high, low=0.0, low_open=True)
        check_number(f"{k}.kl_coef", self.kl_coef, low=0.0)
        check_number(f"{k}.entropy_coef", self.entropy_coef, low=0.0)


@dataclass(frozen=True)
class CorrectionSettings:
    """Train-inference mismatch correction (``algo.correction``); formulas in ``algo/correction.py``.

    ``mode``: ``none``; ``token_tis`` / ``seq_tis`` (truncated IS, weights min(ρ, ``clip``));
    ``token_mis`` / ``seq_mis`` (masked IS: weight ρ inside [``low``, ``high``], token or whole
    sequence dropped outside); ``icepop`` (token-level masked IS under its paper's name: identical to
    ``token_mis``). ``bypass`` uses the rollout logprobs as the old policy (no recompute phase); the
    PPO ratio π/π_rollout then carries the correction itself, so ``mode`` must be ``none``.
    """

    mode: Literal["none", "token_tis", "seq_tis", "token_mis", "seq_mis", "icepop"] = "none"
    clip: float = 2.0
    low: float = 0.5
    high: float = 2.0
    bypass: bool = False

    def __post_init__(self) -> None:
        k = "algo.correction"
        check_fields(self, k, ("mode", "bypass"))
        check_number(f"{k}.clip", self.clip, low=1.0)
        check_number(f"{k}.low", self.low, low=0.0, high=1.0, high_open=True)
        check_number(f"{k}.high", self.high, low=1.0, low_open=True)
        if self.bypass and self.mode != "none":
            raise ConfigError(f"{k}.bypass", self.bypass,
                              f"bypass makes π_old = π_rollout, so mode {self.mode!r} has nothing to correct; "
                              "set mode: none or bypass: false")


GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
"""Advantages computed against the other samples of the same prompt (all 0 for one sample)."""


@dataclass(frozen=True)
class AlgoSettings:
    """The RL algorithm: advantage estimator (a key of ``ADVANTAGES``), samples per prompt, the
    policy loss and the rollout correction."""

    advantage: str = "grpo"
    group_size: int = 8
    loss: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    correction: CorrectionSettings = field(default_factory=CorrectionSettings)

    def __post_init__(self) -> None:
        _choice("algo.advantage", self.advantage, tuple(sorted(ADVANTAGES)))
        check_integer("algo.group_size", self.group_size, minimum=1)
        if self.advantage in GROUP_RELATIVE and self.group_size < 2:
            raise ConfigError("algo.group_size", self.group_size,
                              f"advantage {self.advantage!r} compares the samples of a prompt with each other: with "
                              "one sample every advantage is 0 and nothing is learned; use group_size >= 2 (or "
                              "advantage reinforce_pp)")
        if not isinstance(self.loss, PolicyLossSettings):
            raise ConfigError("algo.loss", self.loss, "must be a PolicyLossSettings")
        if not isinstance(self.correction, CorrectionSettings):
            raise ConfigError("algo.correction", self.correction, "must be a CorrectionSettings")
