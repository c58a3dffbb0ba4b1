"""The ``algo`` settings: defaults valid, every bad value names its dotted key (algo/settings.py)."""

import dataclasses
import typing

import pytest

from megatron_jetrl.algo import AlgoSettings, CorrectionSettings, PolicyLossSettings
from megatron_jetrl.config import ConfigError


def test_defaults():
    s = AlgoSettings()
    assert (s.advantage, s.group_size) == ("grpo", 8)
    assert (s.loss.type, s.loss.clip_low, s.loss.clip_high, s.loss.dual_clip) == ("ppo", 0.2, 0.28, None)
    assert (s.loss.aggregation, s.loss.kl_coef, s.loss.kl_type, s.loss.entropy_coef) == ("token-mean", 0.0, "k3", 0.0)
    assert (s.correction.mode, s.correction.clip, s.correction.bypass) == ("none", 2.0, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.group_size = 4  # type: ignore[misc]


def test_type_hints_are_plain_and_resolvable():
    # the YAML loader builds these from typing.get_type_hints
    assert typing.get_type_hints(AlgoSettings) == {"advantage": str, "group_size": int, "loss": PolicyLossSettings,
                                                   "correction": CorrectionSettings}
    hints = typing.get_type_hints(PolicyLossSettings)
    assert hints["dual_clip"] == typing.Optional[float]
    assert hints["type"] == typing.Literal["ppo", "gspo", "cispo"]  # the loader checks the choice
    assert typing.get_type_hints(CorrectionSettings)["bypass"] is bool


def test_valid_variants():
    PolicyLossSettings(type="ppo", clip_low=0.2, clip_high=0.2, dual_clip=3, kl_coef=0.01, kl_type="k1")
    PolicyLossSettings(type="gspo", aggregation="seq-mean-token-mean")
    PolicyLossSettings(type="cispo", cispo_clip_low=0.0, entropy_coef=0.001)
    CorrectionSettings(mode="icepop", low=0.5, high=5.0)
    CorrectionSettings(bypass=True)
    AlgoSettings(advantage="rloo", group_size=2)
    AlgoSettings(advantage="reinforce_pp", group_size=1)  # a batch baseline: one sample per prompt is fine


@pytest.mark.parametrize("cls,kwargs,key", [
    (PolicyLossSettings, {"type": "grpo"}, "algo.loss.type"),
    (PolicyLossSettings, {"clip_low": 0.0}, "algo.loss.clip_low"),
    (PolicyLossSettings, {"clip_low": 1.2}, "algo.loss.clip_low"),
    (PolicyLossSettings, {"clip_high": -0.1}, "algo.loss.clip_high"),
    (PolicyLossSettings, {"clip_high": True}, "algo.loss.clip_high"),
    (PolicyLossSettings, {"clip_high": float("nan")}, "algo.loss.clip_high"),
    (PolicyLossSettings, {"dual_clip": 0.9}, "algo.loss.dual_clip"),
    (PolicyLossSettings, {"type": "gspo", "dual_clip": 3.0}, "algo.loss.dual_clip"),
    (PolicyLossSettings, {"gspo_clip_low": 1.0}, "algo.loss.gspo_clip_low"),
    (PolicyLossSettings, {"gspo_clip_high": 0.0}, "algo.loss.gspo_clip_high"),
    (PolicyLossSettings, {"cispo_clip_low": 1.5}, "algo.loss.cispo_clip_low"),
    (PolicyLossSettings, {"cispo_clip_high": 0.0}, "algo.loss.cispo_clip_high"),
    (PolicyLossSettings, {"aggregation": "token-sum"}, "algo.loss.aggregation"),
    (PolicyLossSettings, {"kl_coef": -0.01}, "algo.loss.kl_coef"),
    (PolicyLossSettings, {"kl_type": "k2"}, "algo.loss.kl_type"),
    (PolicyLossSettings, {"entropy_coef": -1.0}, "algo.loss.entropy_coef"),
    (CorrectionSettings, {"mode": "tis"}, "algo.correction.mode"),
    (CorrectionSettings, {"clip": 0.5}, "algo.correction.clip"),
    (CorrectionSettings, {"low": 1.0}, "algo.correction.low"),
    (CorrectionSettings, {"low": -0.1}, "algo.correction.low"),
    (CorrectionSettings, {"high": 1.0}, "algo.correction.high"),
    (CorrectionSettings, {"bypass": "yes"}, "algo.correction.bypass"),
    (CorrectionSettings, {"bypass": True, "mode": "token_tis"}, "algo.correction.bypass"),
    (AlgoSettings, {"advantage": "gae"}, "algo.advantage"),
    (AlgoSettings, {"group_size": 0}, "algo.group_size"),
    (AlgoSettings, {"group_size": 2.0}, "algo.group_size"),
    (AlgoSettings, {"advantage": "rloo", "group_size": 1}, "algo.group_size"),
    (AlgoSettings, {"advantage": "grpo", "group_size": 1}, "algo.group_size"),
    (AlgoSettings, {"advantage": "dr_grpo", "group_size": 1}, "algo.group_size"),
    (AlgoSettings, {"advantage": "reinforce_pp_baseline", "group_size": 1}, "algo.group_size"),
    (AlgoSettings, {"loss": {"type": "ppo"}}, "algo.loss"),
    (AlgoSettings, {"correction": None}, "algo.correction"),
])
def test_bad_values_name_their_key(cls, kwargs, key):
    with pytest.raises(ConfigError) as err:
        cls(**kwargs)
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}: got ")
