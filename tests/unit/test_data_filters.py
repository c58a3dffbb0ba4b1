"""DAPO batch shaping (data/filters.py) against hand-computed values."""

import pytest
import torch

from megatron_jetrl.data.filters import overlong_filter_mask, overlong_penalty, select_groups, uniform_groups


def test_uniform_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    # groups of 3: [1 1 1] [0 1 0] [0 0 0] [.5 .5 .5]
    assert uniform_groups(r, 3).tolist() == [True, False, True, True]
    # groups of 4: [1 1 1 0] [1 0 0 0] [0 .5 .5 .5]
    assert uniform_groups(r, 4).tolist() == [False, False, False]
    assert uniform_groups(r, 1).tolist() == [True] * 12  # one sample: never any signal
    assert uniform_groups(torch.tensor([1, 1, 0, 1]), 2).tolist() == [True, False]


def test_uniform_groups_errors():
    with pytest.raises(ValueError, match="do not form groups of 3"):
        uniform_groups(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="1-D"):
        uniform_groups(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="NaN"):
        uniform_groups(torch.tensor([1.0, float("nan")]), 2)


def test_select_groups():
    keep = ~uniform_groups(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]), 2)
    assert keep.tolist() == [False, True, True, False, True]
    assert select_groups(keep, 2) == [1, 2]
    assert select_groups(keep, 5) == [1, 2, 4]  # fewer kept than asked: all of them
    assert select_groups(keep, 0) == []
    with pytest.raises(ValueError, match="bool"):
        select_groups(torch.tensor([1, 0]), 1)


def test_overlong_penalty_hand_computed():
    # L_max = 100, L_cache = 20: free up to 80, linear to -p at 100, -p beyond
    lengths = torch.tensor([10, 80, 81, 90, 95, 100, 130])
    want = [0.0, 0.0, -0.05, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(lengths, 100, 20, 1.0).tolist() == pytest.approx(want)
    assert overlong_penalty(lengths, 100, 20, 0.5).tolist() == pytest.approx([w / 2 for w in want])
    out = overlong_penalty(lengths, 100, 100, 1.0)  # the whole budget is the buffer
    assert out.dtype == torch.float32 and out.tolist() == pytest.approx([-0.1, -0.8, -0.81, -0.9, -0.95, -1.0, -1.0])


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty(torch.tensor([1]), 10, 11, 1.0)
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty(torch.tensor([1]), 10, 0, 1.0)
    with pytest.raises(ValueError, match="penalty"):
        overlong_penalty(torch.tensor([1]), 10, 5, -1.0)


def test_overlong_filter_mask():
    assert overlong_filter_mask(["stop", "length", "stop", "length"]).tolist() == [False, True, False, True]
    assert overlong_filter_mask([]).dtype == torch.bool
