"""Advantage estimators against hand-computed values (algo/advantages.py)."""

import math

import pytest
import torch

from megatron_jetrl.algo.advantages import ADVANTAGES, advantages
from megatron_jetrl.config import ConfigError

# two prompts x 4 samples: rewards [1, 0, 0, 1] and [1, 1, 1, 0]
R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
S1 = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
S2 = math.sqrt(0.25)   # unbiased std of [1, 1, 1, 0]: sum sq dev 0.75 / 3


def test_grpo():
    want = [0.5 / S1, -0.5 / S1, -0.5 / S1, 0.5 / S1, 0.25 / S2, 0.25 / S2, 0.25 / S2, -0.75 / S2]
    assert advantages("grpo", R, 4).tolist() == pytest.approx(want, rel=1e-5)


def test_dr_grpo_and_rloo():
    centred = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]
    assert advantages("dr_grpo", R, 4).tolist() == pytest.approx(centred)
    # RLOO: r_i minus the mean of the other three, e.g. 1 - (0 + 0 + 1) / 3 = 2/3
    assert advantages("rloo", R, 4).tolist() == pytest.approx([c * 4 / 3 for c in centred])
    assert advantages("rloo", R, 4)[0].item() == pytest.approx(2 / 3)


def test_reinforce_pp_variants():
    mean, std = 5 / 8, math.sqrt(sum((x - 5 / 8) ** 2 for x in R.tolist()) / 7)
    assert advantages("reinforce_pp", R, 4).tolist() == pytest.approx([(x - mean) / std for x in R.tolist()],
                                                                     rel=1e-5)
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    want = (centred / centred.std()).tolist()
    assert advantages("reinforce_pp_baseline", R, 4).tolist() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_uniform_groups_give_zero(name):
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    adv = advantages(name, r, 3)
    assert adv.dtype == torch.float32 and adv.shape == (6,)
    if name not in ("reinforce_pp",):  # global whitening keeps the between-group difference
        assert adv.abs().max().item() == 0.0


def test_bad_input_is_named():
    with pytest.raises(ConfigError, match="algo.advantage"):
        advantages("ppo", R, 4)
    with pytest.raises(ValueError, match="groups of 3"):
        advantages("grpo", R, 3)
    with pytest.raises(ConfigError, match="RLOO needs at least 2"):
        advantages("rloo", R, 1)
    with pytest.raises(ConfigError, match="algo.group_size"):
        advantages("grpo", R, 0)
