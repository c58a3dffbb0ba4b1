"""PromptSampler (data/sampler.py): deterministic epochs, epoch crossing, exact resume."""

import json

import pytest
import torch

from megatron_jetrl.data.sampler import PromptSampler


def test_each_epoch_is_a_permutation_and_deterministic():
    a, b = PromptSampler(10, seed=3), PromptSampler(10, seed=3)
    e0, e1 = a.next(10), a.next(10)
    assert sorted(e0) == list(range(10)) and sorted(e1) == list(range(10))
    assert e0 != e1  # a new order every epoch
    assert b.next(20) == e0 + e1
    assert PromptSampler(10, seed=4).next(10) != e0


def test_independent_of_global_rng():
    torch.manual_seed(0)
    first = PromptSampler(50, seed=1).next(50)
    torch.manual_seed(12345)
    torch.rand(100)
    assert PromptSampler(50, seed=1).next(50) == first


def test_no_shuffle_walks_in_order():
    s = PromptSampler(4, seed=0, shuffle=False)
    assert s.next(6) == [0, 1, 2, 3, 0, 1]
    assert (s.epoch, s.position) == (1, 2)


def test_epoch_crossing():
    s = PromptSampler(5, seed=7)
    ref = PromptSampler(5, seed=7).next(15)
    assert s.next(3) == ref[:3] and (s.epoch, s.position) == (0, 3)
    assert s.next(4) == ref[3:7] and (s.epoch, s.position) == (1, 2)
    assert s.next(2) == ref[7:9]
    assert s.next(0) == []
    assert s.next(6) == ref[9:15] and (s.epoch, s.position) == (2, 5)
    assert s.next(12) == PromptSampler(5, seed=7).next(27)[15:]  # n larger than the dataset


@pytest.mark.parametrize("shuffle", [True, False])
def test_resume_returns_the_same_next_indices(shuffle):
    original = PromptSampler(7, seed=11, shuffle=shuffle)
    for n in (3, 5, 7):
        original.next(n)
    state = json.loads(json.dumps(original.state_dict()))  # what a checkpoint stores
    restored = PromptSampler(7, seed=11, shuffle=shuffle)
    restored.load_state_dict(state)
    assert (restored.epoch, restored.position) == (original.epoch, original.position)
    for n in (4, 1, 9, 7):
        assert restored.next(n) == original.next(n)


def test_resume_at_an_epoch_boundary():
    original = PromptSampler(4, seed=2)
    original.next(4)
    restored = PromptSampler(4, seed=2)
    restored.load_state_dict(original.state_dict())
    assert restored.next(6) == original.next(6)


def test_state_mismatch_errors():
    s = PromptSampler(10, seed=1)
    s.next(3)
    state = s.state_dict()
    with pytest.raises(ValueError, match="walked 10 prompts but the dataset now has 9"):
        PromptSampler(9, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="used seed 1 but data.seed is 2"):
        PromptSampler(10, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle=True but data.shuffle is False"):
        PromptSampler(10, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match=r"lacks \['position'\]"):
        PromptSampler(10, seed=1).load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(ValueError, match="position must be an integer in"):
        PromptSampler(10, seed=1).load_state_dict({**state, "position": 11})


def test_argument_errors():
    with pytest.raises(ValueError, match="num_items"):
        PromptSampler(0, seed=1)
    with pytest.raises(ValueError, match="n must be"):
        PromptSampler(3, seed=1).next(-1)
