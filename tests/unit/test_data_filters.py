"""DAPO overlong reward shaping (data/filters.py) against hand-computed values."""

import pytest
import torch

from megatron_jetrl.data.filters import overlong_penalty


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
