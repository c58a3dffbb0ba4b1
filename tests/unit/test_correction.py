"""Rollout correction and mismatch metrics against hand-computed values (algo/correction.py,
algo/mismatch.py)."""

import math

import pytest
import torch

from megatron_jetrl.algo import CorrectionSettings, mismatch_metrics, rollout_correction

# Two sequences, cu = [0, 3, 6]; the first token of each is outside the loss mask, where the ratio
# is 100 and must not count. Masked ratios ρ = π_old / π_rollout: seq 1 = 1.5, 3.0; seq 2 = 0.4, 1.0.
CU = torch.tensor([0, 3, 6])
MASK = torch.tensor([0, 1, 1, 0, 1, 1])
RHO = [100.0, 1.5, 3.0, 100.0, 0.4, 1.0]
ROLLOUT = torch.full((6,), -1.0)
OLD = ROLLOUT + torch.tensor([math.log(r) for r in RHO])


def correct(mode, **kw):
    return rollout_correction(OLD, ROLLOUT, MASK, CU, CorrectionSettings(mode=mode, **kw))


def test_none_changes_nothing():
    c = correct("none")
    assert c.weights.dtype == torch.float32 and c.weights.tolist() == [1.0] * 6
    assert torch.equal(c.loss_mask, MASK)
    assert c.metrics["rollout_corr/is_weight_mean"] == 1.0
    assert c.metrics["rollout_corr/clipped_fraction"] == 0.0
    assert c.metrics["rollout_corr/masked_fraction"] == 0.0
    assert c.metrics["rollout_corr/seq_masked_fraction"] == 0.0
    assert c.metrics["rollout_corr/ratio_max"] == pytest.approx(3.0)
    assert c.metrics["rollout_corr/ratio_min"] == pytest.approx(0.4)


def test_token_tis():
    # min(ρ, 2): 1.5, 2.0 (clipped), 0.4, 1.0; off-mask tokens keep 1
    c = correct("token_tis", clip=2.0)
    assert c.weights.tolist() == pytest.approx([1.0, 1.5, 2.0, 1.0, 0.4, 1.0])
    assert torch.equal(c.loss_mask, MASK)
    assert c.metrics["rollout_corr/clipped_fraction"] == pytest.approx(1 / 4)
    assert c.metrics["rollout_corr/is_weight_mean"] == pytest.approx((1.5 + 2.0 + 0.4 + 1.0) / 4)
    assert c.metrics["rollout_corr/masked_fraction"] == 0.0


def test_seq_tis():
    # sequence ratios 1.5·3 = 4.5 -> min(4.5, 2) = 2, and 0.4·1 = 0.4; broadcast to masked tokens
    c = correct("seq_tis", clip=2.0)
    assert c.weights.tolist() == pytest.approx([1.0, 2.0, 2.0, 1.0, 0.4, 0.4])
    assert c.metrics["rollout_corr/clipped_fraction"] == pytest.approx(2 / 4)
    assert c.metrics["rollout_corr/is_weight_mean"] == pytest.approx((2 + 2 + 0.4 + 0.4) / 4)
    assert c.metrics["rollout_corr/ratio_max"] == pytest.approx(4.5)
    assert c.metrics["rollout_corr/ratio_min"] == pytest.approx(0.4)


@pytest.mark.parametrize("mode", ["token_mis", "icepop"])
def test_token_masking(mode):
    # [0.5, 2]: 1.5 kept (weight ρ), 3.0 dropped, 0.4 dropped, 1.0 kept
    c = correct(mode, low=0.5, high=2.0)
    assert c.weights.tolist() == pytest.approx([1.0, 1.5, 0.0, 1.0, 0.0, 1.0])
    assert c.loss_mask.tolist() == [0, 1, 0, 0, 0, 1]
    assert c.loss_mask.dtype == MASK.dtype
    assert c.metrics["rollout_corr/masked_fraction"] == pytest.approx(2 / 4)
    assert c.metrics["rollout_corr/seq_masked_fraction"] == pytest.approx(1.0)  # both lost a token
    assert c.metrics["rollout_corr/is_weight_mean"] == pytest.approx((1.5 + 1.0) / 2)
    assert c.metrics["rollout_corr/clipped_fraction"] == 0.0


def test_seq_mis():
    # [0.3, 2]: sequence 1 (4.5) is dropped whole; sequence 2 (0.4) is kept with weight 0.4
    c = correct("seq_mis", low=0.3, high=2.0)
    assert c.weights.tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0, 0.4, 0.4])
    assert c.loss_mask.tolist() == [0, 0, 0, 0, 1, 1]
    assert c.metrics["rollout_corr/masked_fraction"] == pytest.approx(0.5)
    assert c.metrics["rollout_corr/seq_masked_fraction"] == pytest.approx(0.5)
    assert c.metrics["rollout_corr/is_weight_mean"] == pytest.approx(0.4)
    # default bounds [0.5, 2] drop both sequences; no token is left
    c = correct("seq_mis")
    assert c.loss_mask.sum().item() == 0 and c.metrics["rollout_corr/is_weight_mean"] == 0.0


def test_log_ratio_is_clamped():
    # log ρ = 30 on one token -> clamped to 20; two tokens of log ρ 15 sum to 30 -> clamped to 20
    cu = torch.tensor([0, 1, 3])
    rollout = torch.zeros(3)
    old = torch.tensor([30.0, 15.0, 15.0])
    mask = torch.ones(3)
    tok = rollout_correction(old, rollout, mask, cu, CorrectionSettings(mode="token_tis"))
    assert tok.weights.tolist() == pytest.approx([2.0, 2.0, 2.0])
    assert tok.metrics["rollout_corr/ratio_max"] == pytest.approx(math.exp(20))
    seq = rollout_correction(old, rollout, mask, cu, CorrectionSettings(mode="seq_tis", clip=5.0))
    assert seq.metrics["rollout_corr/ratio_max"] == pytest.approx(math.exp(20))
    assert seq.weights.tolist() == pytest.approx([5.0, 5.0, 5.0])


def test_weights_are_stop_gradient_and_inputs_are_checked():
    old = OLD.clone().requires_grad_(True)
    c = rollout_correction(old, ROLLOUT, MASK, CU, CorrectionSettings(mode="token_tis"))
    assert not c.weights.requires_grad
    with pytest.raises(ValueError, match="rollout_logprobs"):
        rollout_correction(OLD, ROLLOUT[:5], MASK, CU, CorrectionSettings())
    with pytest.raises(ValueError, match="cu_seqlens"):
        rollout_correction(OLD, ROLLOUT, MASK, torch.tensor([0, 3, 5]), CorrectionSettings())
    with pytest.raises(ValueError, match="no token"):
        rollout_correction(OLD, ROLLOUT, torch.zeros(6), CU, CorrectionSettings())


# Mismatch metrics. Hand example: two masked tokens with p_train = 0.5, 0.2 and p_rollout = 0.4, 0.2,
# and an unmasked third token with wild values.
#   g - t = log 0.8, 0          -> kl = log(0.8) / 2
#   r = p_train / p_rollout = 1.25, 1   -> k3 = (1.25 - log 1.25 - 1) / 2, chi2 = (1.5625 + 1) / 2 - 1
#   ppl_ratio = exp(kl) = sqrt(0.8); |Δp| = 0.1, 0; mult error = (1.25 + 1) / 2
TRAIN = torch.tensor([math.log(0.5), math.log(0.2), -30.0])
GEN = torch.tensor([math.log(0.4), math.log(0.2), -0.01])
M2 = torch.tensor([1.0, 1.0, 0.0])


def test_mismatch_metrics_hand_example():
    m = mismatch_metrics(TRAIN, GEN, M2)
    assert m["rollout_corr/kl"] == pytest.approx(math.log(0.8) / 2, rel=1e-6)
    assert m["rollout_corr/k3_kl"] == pytest.approx((0.25 - math.log(1.25)) / 2, rel=1e-5)
    assert m["rollout_corr/chi2_token"] == pytest.approx(0.28125, rel=1e-5)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(math.sqrt(0.8), rel=1e-6)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.05, rel=1e-5)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1, rel=1e-5)
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)  # two points
    assert m["token_mult_prob_error"] == pytest.approx(1.125, rel=1e-6)


def test_mismatch_metrics_identical_logprobs():
    lp = torch.log(torch.tensor([0.1, 0.5, 0.9, 0.3]))
    m = mismatch_metrics(lp, lp.clone(), torch.ones(4))
    assert m["rollout_corr/kl"] == 0.0
    assert m["rollout_corr/k3_kl"] == 0.0
    assert m["rollout_corr/chi2_token"] == 0.0
    assert m["rollout_corr/ppl_ratio"] == 1.0
    assert m["training/rollout_probs_diff_mean"] == 0.0
    assert m["training/rollout_probs_diff_max"] == 0.0
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert m["token_mult_prob_error"] == 1.0


def test_pearson():
    # x = 0.1, 0.2, 0.3; y = 0.1, 0.3, 0.2: centred (-.1, 0, .1), (-.1, .1, 0) -> 0.01 / 0.02 = 0.5
    m = mismatch_metrics(torch.log(torch.tensor([0.1, 0.2, 0.3])), torch.log(torch.tensor([0.1, 0.3, 0.2])),
                         torch.ones(3))
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(0.5, rel=1e-5)
    # one token: undefined correlation -> 1.0 when equal, 0.0 when not (never NaN)
    one = torch.tensor([math.log(0.5)])
    assert mismatch_metrics(one, one.clone(), torch.ones(1))["training/rollout_actor_probs_pearson_corr"] == 1.0
    diff = mismatch_metrics(one, one - 0.1, torch.ones(1))
    assert diff["training/rollout_actor_probs_pearson_corr"] == 0.0
    assert diff["token_mult_prob_error"] == pytest.approx(math.exp(0.1), rel=1e-6)


def test_ppl_ratio_per_sequence_with_cu_seqlens():
    # one token per sequence: exp(log 0.8) = 0.8 and exp(0) = 1 -> mean 0.9 (verl's form)
    m = mismatch_metrics(TRAIN, GEN, M2, cu_seqlens=torch.tensor([0, 1, 3]))
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(0.9, rel=1e-6)
    with pytest.raises(ValueError, match="no token"):
        mismatch_metrics(TRAIN, GEN, torch.zeros(3))
    with pytest.raises(ValueError, match="loss_mask"):
        mismatch_metrics(TRAIN, GEN, torch.ones(2))
