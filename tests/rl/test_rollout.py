"""The draw behind ``rl.rollout.sample``: the Gumbel-max processor samples softmax(logits / T) (restricted to the
top-p nucleus), from its own seeded generator. ``sample`` itself runs on the tiny model in
tests/train/test_grpo_e2e.py."""

from __future__ import annotations

import torch

from qlora_train.rl.rollout import GumbelSampler

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])


def draws(temperature: float, top_p: float, n: int = 20_000, seed: int = 0) -> torch.Tensor:
    sampler = GumbelSampler(temperature, top_p, torch.Generator().manual_seed(seed))
    picks = []
    for _ in range(n // 100):
        scores = sampler(torch.zeros((100, 1), dtype=torch.long), LOGITS.expand(100, -1).clone())
        assert ((scores == 0).sum(dim=1) == 1).all() and torch.isinf(scores).sum() == 300  # one token, rest -inf
        picks.append(scores.argmax(dim=1))
    return torch.bincount(torch.cat(picks), minlength=4) / n


def test_the_draw_follows_the_tempered_softmax():
    for temperature in (1.0, 0.5):
        want = torch.softmax(LOGITS[0] / temperature, dim=0)
        assert (draws(temperature, 1.0) - want).abs().max() < 0.015, temperature


def test_top_p_keeps_the_nucleus_only():
    """softmax([2, 1, 0, -1]) = 0.64, 0.24, 0.09, 0.03: top_p 0.8 keeps the first two, renormalised."""
    got = draws(1.0, 0.8)
    assert got[2:].sum() == 0
    assert abs(got[0] - 0.64 / 0.88) < 0.015


def test_the_same_seed_draws_the_same_tokens():
    assert torch.equal(draws(1.0, 1.0, n=500, seed=3), draws(1.0, 1.0, n=500, seed=3))
    assert not torch.equal(draws(1.0, 1.0, n=500, seed=3), draws(1.0, 1.0, n=500, seed=4))
