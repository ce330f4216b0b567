"""GRPO's advantages and loss on per-token log-probs: TRL 1.16's ``GRPOTrainer`` formulas, term for term.

With ``G`` completions per prompt, reward functions ``f`` of weights ``w_f`` (``rl.rewards``), and ``r_i`` completion
i's summed reward ``sum_f w_f r_if`` (a None left out of the sum; nan when every function left it out):

- advantage (``group_advantages``): ``A_i = r_i - mean(r over i's group)``, divided by ``std + 1e-4`` with
  ``rl.scale_rewards: group`` (the group's std, Bessel-corrected) or ``batch`` (the std of every r of the batch),
  not divided with ``none``; a completion that no function scored gets 0; means and stds skip the unscored;
- per token t of completion i: the ratio ``rho = exp(log pi(t) - log pi_old(t))`` (``pi_old`` the policy that sampled
  it; the same as ``pi``, detached, when ``rl.num_iterations`` is 1), the clipped surrogate ``-min(rho A_i,
  clip(rho, 1 - epsilon, 1 + epsilon_high) A_i)``, plus ``beta rho (exp(ref - log pi) - (ref - log pi) - 1)`` when
  ``rl.beta > 0``: the k3 estimate of the KL to the reference, weighted by the ratio so that its gradient is the
  unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default ``use_bias_correction_kl``; the weight is 1 in value
  on-policy, not in gradient);
- the loss (``grpo_loss``) reduces the per-token terms over the completions' tokens (``mask``; a truncated one's
  are 0 under ``rl.mask_truncated``): ``grpo``, each completion's mean over its tokens, then the mean over the
  completions; ``dr_grpo``, their sum over ``completions x max_completion_length``; ``dapo``, their sum over the
  tokens of every micro-batch of the optimizer step (``normalizer``). ``grpo`` and ``dr_grpo`` are divided by the
  micro-batches of the step (``accumulation``); ``dapo``'s normalizer already spans them.

    >>> # rewards 1, 0 (std 0.7071) and 1 beside an unscored one (no std: its group's advantages are 0)
    >>> adv = group_advantages(torch.tensor([[1.0], [0.0], [float("nan")], [1.0]]), torch.tensor([1.0]), 2, "group")
    >>> [round(a, 4) for a in adv.advantages.tolist()], adv.std_zero.tolist()
    ([0.707, -0.707, 0.0, 0.0], [False, False, False, False])
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from qlora_train.config import GrpoLoss, ScaleRewards

STD_EPSILON = 1e-4  # TRL's: advantages divided by std + 1e-4


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The Bessel-corrected std ignoring nan (nan with fewer than two values): TRL's ``nanstd``."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(values), dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance)
    return std if keepdim else (std.squeeze(dim) if dim is not None else std.reshape(()))


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N] the summed reward, nan where no function scored the completion
    std_zero: torch.Tensor  # [N] bool: the std it was scaled by is 0 (its group all alike: no signal)


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale: ScaleRewards = "group") -> Advantages:
    """``rewards [N, F]`` (nan where a function returned None; each prompt's ``num_generations`` completions in a
    row) and ``weights [F]`` -> ``Advantages`` (see the module doc)."""
    unscored = torch.isnan(rewards).all(dim=1)
    total = (rewards * weights[None, :]).nansum(dim=1)
    total[unscored] = float("nan")
    groups = total.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale == "batch":
        std = nanstd(total).expand_as(total) if total.numel() > 1 else torch.zeros_like(total)
    else:  # group (and none: the std only says which groups are all alike)
        std = nanstd(groups, dim=1).repeat_interleave(num_generations)
    advantages = total - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPSILON)
    return Advantages(torch.nan_to_num(advantages, nan=0.0), total, torch.isclose(std, torch.zeros_like(std)))


class LossTerms(NamedTuple):
    loss: torch.Tensor
    clip_low: float  # share of the completion tokens whose ratio was clipped below (A < 0)
    clip_high: float  # ... above (A > 0)
    clip_region: float  # either
    kl: float | None  # the mean per-token KL estimate (beta > 0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))


def grpo_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *, loss_type: GrpoLoss,
              old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None, epsilon: float = 0.2,
              epsilon_high: float | None = None, beta: float = 0.0, max_completion_length: int | None = None,
              normalizer: float | torch.Tensor | None = None, accumulation: float = 1.0) -> LossTerms:
    """Per-token log-probs ``logps [N, T]`` of the completions (the policy's, differentiable), their ``mask
    [N, T]`` (1 at a completion's tokens) and ``advantages [N]`` -> ``LossTerms`` (see the module doc).
    ``old_logps`` (default: ``logps`` detached) and ``ref_logps`` (with ``beta > 0``) as ``logps``;
    ``max_completion_length`` is ``dr_grpo``'s, ``normalizer`` ``dapo``'s (default: this batch's tokens)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages[:, None].to(logps.dtype)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        delta = ref_logps - logps
        per_token_kl = (torch.exp(delta) - delta - 1) * ratio  # weighted by the ratio: unbiased (TRL's default)
        per_token = per_token + beta * per_token_kl
        kl = masked_mean(per_token_kl.detach(), mask)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length) / accumulation
    elif loss_type == "dapo":
        tokens = mask.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=logps.dtype)
        loss = (per_token * mask).sum() / tokens.clamp(min=1.0)
    else:
        raise ValueError(f"unknown rl.loss_type {loss_type!r}")
    ratio = ratio.detach()
    low_clip = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)
    high_clip = ((ratio > 1 + high) & (adv > 0)).to(mask.dtype)
    return LossTerms(loss, masked_mean(low_clip, mask), masked_mean(high_clip, mask),
                     masked_mean(torch.clamp(low_clip + high_clip, max=1.0), mask), kl)
