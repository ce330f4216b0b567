"""GRPO's advantages and loss by hand on numbers small enough to check on paper (TRL's equality: tests/train/
test_grpo_vs_trl.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qlora_train.rl.loss import group_advantages, grpo_loss, nanstd

NAN = float("nan")


def test_advantages_by_hand():
    """Two groups of two: rewards (1, 0) -> +-0.5 / (std 0.7071 + 1e-4); a group all alike -> 0 and std_zero."""
    adv = group_advantages(torch.tensor([[1.0], [0.0], [0.5], [0.5]]), torch.tensor([1.0]), 2)
    std = math.sqrt(0.5)  # Bessel: ((0.5^2 + 0.5^2) / 1) ** 0.5
    assert adv.advantages.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0, 0.0])
    assert adv.std_zero.tolist() == [False, False, True, True]


def test_weights_sum_the_functions_and_none_is_left_out():
    """[f1, f2] weighted (1, 0.5); a None (nan) of one function counts as nothing in the sum; a completion no
    function scored is left out of its group's mean and std and gets 0."""
    rewards = torch.tensor([[1.0, 2.0], [0.0, NAN], [NAN, NAN], [1.0, 0.0]])
    adv = group_advantages(rewards, torch.tensor([1.0, 0.5]), 4, "none")
    total = adv.rewards.tolist()
    assert total[:2] == [2.0, 0.0] and math.isnan(total[2]) and total[3] == 1.0
    assert adv.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])  # mean of 2, 0, 1 is 1; not scaled


def test_batch_scaling_uses_the_std_of_every_reward():
    adv = group_advantages(torch.tensor([[1.0], [0.0], [3.0], [2.0]]), torch.tensor([1.0]), 2, "batch")
    std = float(torch.tensor([1.0, 0.0, 3.0, 2.0]).std())  # Bessel-corrected, as torch.std
    assert adv.advantages.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 2)


def test_nanstd_is_bessel_corrected_and_nan_below_two_values():
    assert nanstd(torch.tensor([1.0, 3.0, NAN])).item() == pytest.approx(math.sqrt(2))
    assert math.isnan(nanstd(torch.tensor([1.0, NAN])).item())


@given(st.lists(st.lists(st.floats(-5, 5), min_size=3, max_size=3), min_size=1, max_size=4))
def test_each_group_of_advantages_has_mean_zero(groups):
    """Scaled or not, a group's advantages sum to 0: the baseline is the group's own mean."""
    rewards = torch.tensor([[r] for group in groups for r in group], dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, torch.tensor([1.0], dtype=torch.float64), 3, scale).advantages.view(-1, 3)
        assert adv.sum(dim=1).abs().max().item() < 1e-6


# one completion of 2 tokens, one of 1 (its second position padding): log-probs, old log-probs, advantages
LOGPS = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])


def test_on_policy_the_surrogate_is_minus_the_advantage_per_token():
    """ratio 1 (no old log-probs): each token's term is -A; grpo: mean per completion, then over completions ->
    (-1 + 1) / 2 = 0; dr_grpo: sum / (2 completions x max length 4) = (-2 + 1) / 8; dapo: sum / 3 tokens."""
    grpo = grpo_loss(LOGPS, MASK, ADV, loss_type="grpo").loss.item()
    dr = grpo_loss(LOGPS, MASK, ADV, loss_type="dr_grpo", max_completion_length=4).loss.item()
    dapo = grpo_loss(LOGPS, MASK, ADV, loss_type="dapo").loss.item()
    assert (grpo, dr, dapo) == pytest.approx((0.0, -1 / 8, -1 / 3))
    assert grpo_loss(LOGPS, MASK, ADV, loss_type="dapo", normalizer=6).loss.item() == pytest.approx(-1 / 6)
    assert grpo_loss(LOGPS, MASK, ADV, loss_type="grpo", accumulation=2).loss.item() == pytest.approx(0.0)


def test_the_clip_by_hand():
    """Ratios e^0.5 = 1.65 (A = +1: clipped to 1 + 0.28) and e^-0.5 = 0.61 (A = -1: clipped to 1 - 0.2): the
    surrogate takes the smaller of the two products, -min(r A, clip(r) A)."""
    old = LOGPS - torch.tensor([[0.5, 0.0], [-0.5, 0.0]])
    terms = grpo_loss(LOGPS, MASK, ADV, loss_type="dapo", old_logps=old, epsilon=0.2, epsilon_high=0.28)
    first = -min(math.exp(0.5), 1.28) + -1.0  # completion 0: its 2 tokens, ratios e^0.5 and 1, A = 1
    second = -min(-math.exp(-0.5), -0.8)  # completion 1: ratio e^-0.5, A = -1: -min(-0.61, -0.8) = 0.8
    assert terms.loss.item() == pytest.approx((first + second) / 3)
    assert (terms.clip_high, terms.clip_low, terms.clip_region) == pytest.approx((1 / 3, 1 / 3, 2 / 3))


def test_the_kl_term_by_hand():
    """beta (exp(ref - logp) - (ref - logp) - 1), weighted by the ratio (1 on policy); kl is its mean per token."""
    ref = LOGPS - 0.1
    k3 = math.exp(-0.1) + 0.1 - 1
    terms = grpo_loss(LOGPS, MASK, torch.zeros(2), loss_type="dapo", ref_logps=ref, beta=0.5)
    assert terms.kl == pytest.approx(k3, rel=1e-5)  # float32
    assert terms.loss.item() == pytest.approx(0.5 * k3, rel=1e-5)


def test_the_gradient_reaches_the_log_probs_of_kept_tokens_only():
    logps = LOGPS.clone().requires_grad_(True)
    grpo_loss(logps, MASK, ADV, loss_type="dapo").loss.backward()
    # d(-r A) / d logp = -A r = -A on policy, over the 3 tokens; the padding position gets nothing
    assert logps.grad.flatten().tolist() == pytest.approx([-1 / 3, -1 / 3, 1 / 3, 0.0])
