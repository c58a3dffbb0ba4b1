"""FP8 KV-cache scale calibration math (precision/kv_cache.py) against hand-computed values."""

import pytest
import torch

from megatron_jetrl.precision.kv_cache import (
    KvAmaxObserver,
    kv_scale_names,
    kv_scales_from_amax,
    nearest_rank_percentile,
    token_amax,
)


def test_token_amax_over_heads_and_dims():
    x = torch.zeros(3, 2, 4)
    x[0, 1, 3] = -5.0
    x[1, 0, 0] = 2.0
    x[2] = 0.5
    assert token_amax(x.bfloat16()).tolist() == [5.0, 2.0, 0.5]
    with pytest.raises(ValueError, match="tokens"):
        token_amax(torch.ones(3))


def test_nearest_rank_percentile():
    v = torch.arange(1, 2001, dtype=torch.float32)[torch.randperm(2000)]
    assert nearest_rank_percentile(v).item() == 1998.0  # ceil(0.999 * 2000) = 1998th smallest
    assert nearest_rank_percentile(v, 1.0).item() == 2000.0
    assert nearest_rank_percentile(torch.tensor([7.0])).item() == 7.0
    with pytest.raises(ValueError):
        nearest_rank_percentile(torch.tensor([]))


def test_scales_and_names():
    amax = torch.tensor([[448.0, 0.0, 4.48]])
    assert torch.allclose(kv_scales_from_amax(amax), torch.tensor([[1.05, 1.0, 0.0105]]))
    assert kv_scale_names(2)[:3] == [f"model.layers.0.self_attn.attn.{t}_scale" for t in "qkv"]
    assert kv_scale_names(2)[-1] == "model.layers.1.self_attn.attn.v_scale"


def test_observer_keeps_the_max_over_micro_batches():
    obs = KvAmaxObserver(2, "cpu")
    q = torch.ones(10, 2, 8)
    obs.observe(1, q, 2 * q, 3 * q)
    obs.observe(1, 4 * q, q, q)
    assert obs.amax.tolist() == [[0, 0, 0], [4.0, 2.0, 3.0]]


def test_observer_leaves_out_the_padding_sequence():
    """The actor sets ``tokens`` per micro-batch: the rows of the padding sequence that aligns it
    (token 0 from position 0) do not move the scales."""
    obs = KvAmaxObserver(1, "cpu")
    q = torch.ones(12, 2, 8)
    q[10:] = 100.0  # the padding sequence's rows
    obs.tokens = 10
    obs.observe(0, q, q, q)
    assert obs.amax.tolist() == [[1.0, 1.0, 1.0]]
    obs.tokens = None
    obs.observe(0, q, q, q)
    assert obs.amax[0, 0] > 1.0
