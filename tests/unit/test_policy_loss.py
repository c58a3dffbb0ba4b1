"""Policy losses against hand-computed values (algo/loss.py)."""

import math
import pickle

import pytest
import torch

from megatron_jetrl.algo import LossInputs, PolicyLossSettings, make_policy_loss, policy_loss, ppo_clip_loss
from megatron_jetrl.config import ConfigError


def inputs(logprobs, old, adv, mask=None, cu=None, *, global_tokens=None, global_sequences=None, entropy=None,
           **fields):
    """LossInputs with ``logprobs`` as a leaf that records its gradient."""
    lp = torch.tensor(logprobs, dtype=torch.float32, requires_grad=True)
    n = lp.numel()
    mask = torch.ones(n) if mask is None else torch.tensor(mask, dtype=torch.float32)
    cu = torch.tensor([0, n]) if cu is None else torch.tensor(cu)
    f = {"loss_mask": mask, "advantages": torch.tensor(adv, dtype=torch.float32),
         "old_logprobs": torch.tensor(old, dtype=torch.float32)}
    f.update({k: torch.tensor(v, dtype=torch.float32) for k, v in fields.items()})
    ent = None if entropy is None else torch.tensor(entropy, dtype=torch.float32, requires_grad=True)
    return LossInputs(logprobs=lp, entropy=ent, fields=f, cu_seqlens=cu,
                      global_tokens=float(mask.sum()) if global_tokens is None else global_tokens,
                      global_sequences=cu.numel() - 1 if global_sequences is None else global_sequences)


def with_ratios(ratios, adv, old=-1.0, **kw):
    """Tokens whose ratio π/π_old is exactly ``ratios`` (old logprob ``old`` everywhere)."""
    return inputs([old + math.log(r) for r in ratios], [old] * len(ratios), adv, **kw)


# PPO example, clip 0.2 / 0.28 -> ratio kept in [0.8, 1.28]
#   t0 r=1.5 A=+1: max(-1.5, -1.28) = -1.28   clipped term taken
#   t1 r=0.5 A=-1: max( 0.5,  0.80) =  0.80   clipped term taken
#   t2 r=1.1 A=-1: max( 1.1,  1.10) =  1.10   inside the range
#   t3 r=0.7 A=+1: max(-0.7, -0.80) = -0.70   unclipped (below the range but A > 0)
R = [1.5, 0.5, 1.1, 0.7]
A = [1.0, -1.0, -1.0, 1.0]
PPO_L = [-1.28, 0.8, 1.1, -0.7]


def test_ppo_values_and_metrics():
    inp = with_ratios(R, A)
    loss, m = policy_loss(inp, PolicyLossSettings())
    assert loss.item() == pytest.approx(sum(PPO_L) / 4, abs=1e-6)  # -0.08 / 4 = -0.02
    assert m["loss"].item() == pytest.approx(-0.02, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(-0.02, abs=1e-6)
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(0.95, abs=1e-6)
    assert m["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in R) / 4, abs=1e-6)
    assert "dual_clip_fraction" not in m and "kl" not in m


def test_ppo_gradient_flows_only_through_unclipped_tokens():
    inp = with_ratios(R, A)
    loss, _ = policy_loss(inp, PolicyLossSettings())
    loss.backward()
    # d(-A r)/d log π = -A r; clipped tokens t0, t1 get none; / N = 4
    assert inp.logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 1.1 / 4, -0.7 / 4], abs=1e-6)


def test_ppo_clip_loss_keeps_symmetric_default():
    # clip 0.2 both sides: t0 becomes -1.2, so the sum is -1.2 + 0.8 + 1.1 - 0.7 = 0
    loss, m = ppo_clip_loss(with_ratios(R, A))
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert m["clip_fraction"].item() == pytest.approx(0.5)
    with pytest.raises(ConfigError, match="algo.loss.clip_low"):
        ppo_clip_loss(with_ratios(R, A), clip_low=-0.1)


def test_dual_clip_caps_negative_advantage_loss():
    # c = 3, clip 0.2 / 0.28
    #   r=5 A=-1: max(5, 1.28) = 5, capped at 3·|A| = 3   (dual clip, no gradient)
    #   r=2 A=-1: max(2, 1.28) = 2 < 3                   (unchanged)
    #   r=5 A=+1: max(-5, -1.28) = -1.28                 (A > 0: ordinary clip)
    inp = with_ratios([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, m = policy_loss(inp, PolicyLossSettings(dual_clip=3.0))
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.28) / 3, abs=1e-6)
    assert m["dual_clip_fraction"].item() == pytest.approx(1 / 3)
    assert m["clip_fraction"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert inp.logprobs.grad.tolist() == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-6)


# GSPO example: two sequences, cu = [0, 3, 5]; the first token of each is outside the loss mask
# (its log ratio 5.0 / -3.0 must not count). Sequence ratios over masked tokens:
#   s1 = exp(mean(0.1, 0.3)) = e^0.2,  A = +1
#   s2 = exp(-0.5),                     A = -1
GSPO_LOG_RATIO = [5.0, 0.1, 0.3, -3.0, -0.5]
GSPO_ADV = [1.0, 1.0, 1.0, -1.0, -1.0]
GSPO_MASK = [0.0, 1.0, 1.0, 0.0, 1.0]
S1, S2 = math.exp(0.2), math.exp(-0.5)


def gspo_inputs():
    old = [-1.0, -2.0, -0.5, -1.5, -1.0]
    return inputs([o + d for o, d in zip(old, GSPO_LOG_RATIO, strict=True)], old, GSPO_ADV, GSPO_MASK, [0, 3, 5])


def test_gspo_inside_the_range_uses_the_sequence_ratio():
    inp = gspo_inputs()
    settings = PolicyLossSettings(type="gspo", gspo_clip_low=0.5, gspo_clip_high=0.5)  # [0.5, 1.5]: none clip
    loss, m = policy_loss(inp, settings)
    # tokens of s1: -A s1 each; token of s2: -A s2 = +s2
    assert loss.item() == pytest.approx((-2 * S1 + S2) / 3, abs=1e-6)
    assert m["clip_fraction"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx((2 * S1 + S2) / 3, abs=1e-6)
    loss.backward()
    # token form: d s_it / d log π_t = s_i
    assert inp.logprobs.grad.tolist() == pytest.approx([0.0, -S1 / 3, -S1 / 3, 0.0, S2 / 3], abs=1e-6)


def test_gspo_default_bounds_clip_both_sequences():
    # defaults keep s in [1 - 3e-4, 1 + 4e-4]: s1 > 1.0004 with A > 0 and s2 < 0.9997 with A < 0 clip
    loss, m = policy_loss(gspo_inputs(), PolicyLossSettings(type="gspo"))
    assert loss.item() == pytest.approx((-2 * 1.0004 + 0.9997) / 3, abs=1e-6)
    assert m["clip_fraction"].item() == pytest.approx(1.0)


def test_gspo_seq_mean_token_mean_matches_the_sequence_objective():
    # GSPO's paper: J = mean_i -A_i s_i with s_i = exp(mean_t log ratio); same value and gradient
    settings = PolicyLossSettings(type="gspo", gspo_clip_low=0.5, gspo_clip_high=0.5,
                                  aggregation="seq-mean-token-mean")
    inp = gspo_inputs()
    loss, _ = policy_loss(inp, settings)
    loss.backward()
    lp = inp.logprobs.detach().clone().requires_grad_(True)
    d = lp - inp.fields["old_logprobs"]
    ref = (-1.0 * torch.exp((d[1] + d[2]) / 2) + 1.0 * torch.exp(d[4])) / 2
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert inp.logprobs.grad.tolist() == pytest.approx(lp.grad.tolist(), abs=1e-6)


def test_cispo_clipped_stop_gradient_weight_times_logprob():
    # ratios 1.5, 0.5, 7.0; defaults bound the weight to [0, 5] -> weights 1.5, 0.5, 5.0
    # l = -w A log π: -1.5·1·(-0.5) = 0.75, -0.5·(-1)·(-1.5) = -0.75, -5·1·(-1.0) = 5.0
    lp = [-0.5, -1.5, -1.0]
    ratios = [1.5, 0.5, 7.0]
    inp = inputs(lp, [x - math.log(r) for x, r in zip(lp, ratios, strict=True)], [1.0, -1.0, 1.0])
    loss, m = policy_loss(inp, PolicyLossSettings(type="cispo"))
    assert loss.item() == pytest.approx(5.0 / 3, abs=1e-5)
    assert m["clip_fraction"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert inp.logprobs.grad.tolist() == pytest.approx([-1.5 / 3, 0.5 / 3, -5.0 / 3], abs=1e-5)


def test_cispo_lower_bound():
    # cispo_clip_low = 0.6 -> weight >= 0.4: the ratio 0.25 token is clipped up to 0.4
    lp = [-1.0, -2.0]
    inp = inputs(lp, [lp[0] - math.log(0.25), lp[1]], [1.0, 1.0])
    loss, m = policy_loss(inp, PolicyLossSettings(type="cispo", cispo_clip_low=0.6))
    assert loss.item() == pytest.approx((0.4 * 1.0 + 1.0 * 2.0) / 2, abs=1e-5)
    assert m["clip_fraction"].item() == pytest.approx(0.5)


# Aggregation example, ratio 1 so l_t = -A_t: seq 1 has 3 masked tokens (l = -1, -2, -3), seq 2 one
# (l = -4); the first token of each is unmasked (A = 100 there must not count).
AGG = dict(adv=[100.0, 1.0, 2.0, 3.0, 100.0, 4.0], mask=[0.0, 1.0, 1.0, 1.0, 0.0, 1.0], cu=[0, 4, 6])


@pytest.mark.parametrize("aggregation,want", [
    ("token-mean", (-1 - 2 - 3 - 4) / 4),           # -2.5
    ("seq-mean-token-sum", (-6 + -4) / 2),          # -5
    ("seq-mean-token-mean", (-6 / 3 + -4 / 1) / 2),  # -3
])
def test_aggregations(aggregation, want):
    inp = inputs([-1.0] * 6, [-1.0] * 6, **AGG)
    loss, m = policy_loss(inp, PolicyLossSettings(aggregation=aggregation))
    assert loss.item() == pytest.approx(want)
    assert m["pg_loss"].item() == pytest.approx(want)


def test_is_weights_multiply_the_policy_term():
    # PPO example with weights 2, 0.5, 0, 1: (-2.56 + 0.4 + 0 - 0.7) / 4
    inp = with_ratios(R, A, is_weights=[2.0, 0.5, 0.0, 1.0])
    loss, m = policy_loss(inp, PolicyLossSettings())
    assert loss.item() == pytest.approx(-2.86 / 4, abs=1e-6)
    assert m["pg_loss"].item() == pytest.approx(-2.86 / 4, abs=1e-6)
    loss.backward()
    assert inp.logprobs.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.7 / 4], abs=1e-6)


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_kl_penalty(kl_type):
    # A = 0 and ratio 1, so only the penalty is left; log π - log π_ref = 0.1, -0.2
    lp = [-1.0, -2.0]
    inp = inputs(lp, lp, [0.0, 0.0], ref_logprobs=[-1.1, -1.8])
    loss, m = policy_loss(inp, PolicyLossSettings(kl_coef=0.5, kl_type=kl_type))
    if kl_type == "k1":
        kl = [0.1, -0.2]
        grad = [0.5 / 2, 0.5 / 2]                      # d(lp - ref)/d lp = 1
    else:  # d = ref - lp = -0.1, 0.2: e^d - d - 1
        kl = [math.exp(-0.1) + 0.1 - 1, math.exp(0.2) - 0.2 - 1]
        grad = [0.5 * (1 - math.exp(-0.1)) / 2, 0.5 * (1 - math.exp(0.2)) / 2]
    assert m["kl"].item() == pytest.approx(sum(kl) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.5 * sum(kl) / 2, abs=1e-6)
    assert m["pg_loss"].item() == 0.0
    loss.backward()
    assert inp.logprobs.grad.tolist() == pytest.approx(grad, abs=1e-6)


def test_entropy_bonus():
    lp = [-1.0, -2.0]
    inp = inputs(lp, lp, [0.0, 0.0], entropy=[0.5, 1.5])
    loss, _ = policy_loss(inp, PolicyLossSettings(entropy_coef=0.1))
    assert loss.item() == pytest.approx(-0.1 * (0.5 + 1.5) / 2)
    loss.backward()
    assert inp.entropy.grad.tolist() == pytest.approx([-0.05, -0.05])
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(inputs(lp, lp, [0.0, 0.0]), PolicyLossSettings(entropy_coef=0.1))


def test_missing_fields_are_named():
    with pytest.raises(KeyError, match="ref_logprobs"):
        policy_loss(with_ratios(R, A), PolicyLossSettings(kl_coef=0.1))
    inp = LossInputs(logprobs=torch.zeros(2), entropy=None, fields={"loss_mask": torch.ones(2)},
                     cu_seqlens=torch.tensor([0, 2]), global_tokens=2.0, global_sequences=1)
    with pytest.raises(KeyError, match="advantages"):
        policy_loss(inp, PolicyLossSettings())
    bad_cu = with_ratios(R, A, cu=[0, 3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        policy_loss(bad_cu, PolicyLossSettings(type="gspo"))


@pytest.mark.parametrize("settings", [
    PolicyLossSettings(dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01),
    PolicyLossSettings(type="gspo", gspo_clip_low=0.05, gspo_clip_high=0.05, aggregation="seq-mean-token-mean"),
    PolicyLossSettings(type="cispo", aggregation="seq-mean-token-sum", kl_coef=0.1, kl_type="k1"),
    PolicyLossSettings(aggregation="seq-mean-token-mean"),
])
def test_micro_batch_shares_add_up_to_the_batch_loss(settings):
    g = torch.Generator().manual_seed(0)
    lens = [4, 3, 5]
    n = sum(lens)
    old = -torch.rand(n, generator=g) * 2
    lp = old + torch.randn(n, generator=g) * 0.1
    mask = (torch.rand(n, generator=g) > 0.25).float()
    mask[[0, 4, 7]] = 0.0
    fields = {"loss_mask": mask, "advantages": torch.randn(n, generator=g), "old_logprobs": old,
              "ref_logprobs": old + torch.randn(n, generator=g) * 0.1, "is_weights": torch.rand(n, generator=g) + 0.5}
    ent = torch.rand(n, generator=g)
    cu = torch.tensor([0, 4, 7, 12])
    gt, gs = float(mask.sum()), 3

    def run(sl: slice, cu_part):
        x = lp[sl].clone().requires_grad_(True)
        inp = LossInputs(logprobs=x, entropy=ent[sl], fields={k: v[sl] for k, v in fields.items()},
                         cu_seqlens=cu_part, global_tokens=gt, global_sequences=gs)
        loss, metrics = policy_loss(inp, settings)
        loss.backward()
        return loss, metrics, x.grad

    full, m_full, g_full = run(slice(0, n), cu)
    a, m_a, g_a = run(slice(0, 7), torch.tensor([0, 4, 7]))
    b, m_b, g_b = run(slice(7, n), torch.tensor([0, 5]))
    assert (a + b).item() == pytest.approx(full.item(), abs=1e-6)
    assert sorted(m_a) == sorted(m_full)
    for k in m_full:
        assert (m_a[k] + m_b[k]).item() == pytest.approx(m_full[k].item(), abs=1e-6), k
    assert torch.cat([g_a, g_b]).tolist() == pytest.approx(g_full.tolist(), abs=1e-6)


def test_make_policy_loss_is_a_picklable_loss_fn():
    fn = make_policy_loss(PolicyLossSettings(type="cispo"))
    again = pickle.loads(pickle.dumps(fn))
    lp = [-0.5, -1.5, -1.0]
    ratios = [1.5, 0.5, 7.0]
    old = [x - math.log(r) for x, r in zip(lp, ratios, strict=True)]
    assert again(inputs(lp, old, [1.0, -1.0, 1.0]))[0].item() == pytest.approx(5.0 / 3, abs=1e-5)
    with pytest.raises(TypeError, match="PolicyLossSettings"):
        make_policy_loss({"type": "ppo"})


@pytest.mark.parametrize("kwargs,key", [
    ({"type": "grpo"}, "algo.loss.type"),
    ({"clip_low": 1.0}, "algo.loss.clip_low"),
    ({"dual_clip": 1.0}, "algo.loss.dual_clip"),
    ({"type": "cispo", "dual_clip": 3.0}, "algo.loss.dual_clip"),
    ({"aggregation": "seq-mean"}, "algo.loss.aggregation"),
])
def test_bad_settings_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        PolicyLossSettings(**kwargs)
