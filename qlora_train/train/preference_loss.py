"""Preference objectives (DPO, IPO, ORPO) on sequence log-probabilities made like the SFT loss.

A batch of B pairs is one ``[2B, L]`` batch, chosen rows first (``PairCollator``). What an objective needs
from it is, per row, the summed log-probability of its trained tokens and their count (``sequence_logps``):
``log pi(y | x) = sum over trained positions t of log softmax(h_t @ W.T)[y_t]``, the labels shifted as the SFT
loss shifts them (``loss.trained_positions``). As for the SFT loss, only the hidden states of trained positions
reach the head, ``CHUNK_TOKENS`` at a time; no vocabulary-sized logits of the batch exist, and backward
recomputes each chunk's logits instead of keeping them.

The objectives (``PreferenceObjective``), with ``pi`` the policy (the adapter being trained), ``ref`` the
reference (where training started), ``w`` the chosen and ``l`` the rejected response:

- DPO (Rafailov et al. 2023), ``dpo_loss: sigmoid``: ``h = (log pi(w) - log ref(w)) - (log pi(l) - log ref(l))``,
  ``loss = -log sigmoid(beta h)``; with ``label_smoothing`` e, conservative DPO (cDPO, Mitchell 2023: labels
  flipped with probability e): ``-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)``;
- robust DPO (rDPO, Chowdhury et al. 2024), ``dpo_loss: robust``: the unbiased estimate of the clean loss under
  flips with probability e, ``(-(1 - e) log sigmoid(beta h) + e log sigmoid(-beta h)) / (1 - 2e)`` (TRL's
  ``robust``);
- IPO (Azar et al. 2023), ``dpo_loss: ipo``: ``loss = (h - 1 / (2 beta))^2`` on the summed log-probs, as in the
  paper (TRL divides each log-prob by its token count first);
- ORPO (Hong et al. 2024), reference-free: ``loss = NLL(w) - lambda log sigmoid(log odds(w) - log odds(l))``,
  ``odds(y) = P(y) / (1 - P(y))`` with ``log P(y)`` the mean log-prob of y's trained tokens; NLL(w) is the mean
  over the chosen tokens of the batch, as the SFT loss.

- KTO (Ethayarajh et al. 2024), ``train.method: kto``, on unpaired rows (a completion ``y`` labelled desirable or
  not): with ``r = log pi(y) - log ref(y)`` and ``z`` the batch's KL estimate, ``loss = w_d (1 - sigmoid(beta (r -
  z)))`` for a desirable row, ``w_u (1 - sigmoid(beta (z - r)))`` for an undesirable one, a mean over the rows.
  ``z`` is TRL's: the mean over the batch of ``log pi(y') - log ref(y')`` for each row's prompt paired with another
  row's completion ``y'`` (``collator.UnpairedCollator``), detached, averaged over the ranks, clamped at 0
  (``kto_kl``).

Each returns the loss (a mean over the pairs) and the metrics users watch (``rewards/*``, ``logps/*``; ORPO's
``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``). DPO's reward of a response is ``beta (log pi - log ref)``;
ORPO's, as TRL logs it, ``lambda`` times its mean log-prob.

    >>> policy = SequenceLogps(torch.tensor([-5.0, -7.0]), torch.tensor([5, 5]))  # one pair: chosen, rejected
    >>> loss, metrics = PreferenceObjective("dpo", beta=0.5)(policy, policy)  # reference = policy: log 2
    >>> round(loss.item(), 4), metrics["rewards/margins"]
    (0.6931, 0.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qlora_train.config import DpoLoss
from qlora_train.masking import IGNORE_INDEX
from qlora_train.train.loss import CHUNK_TOKENS, head_dtype, log_softmax_at_targets_, trained_positions


@dataclass(frozen=True)
class SequenceLogps:
    """Per row of a pair batch (chosen rows first): the summed log-prob of its trained tokens and their count."""

    sums: torch.Tensor  # [2B] float32
    counts: torch.Tensor  # [2B] long

    def halves(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[2B]`` -> (chosen ``[B]``, rejected ``[B]``)."""
        n = values.shape[0] // 2
        return values[:n], values[n:]

    @property
    def chosen(self) -> torch.Tensor:
        return self.halves(self.sums)[0]

    @property
    def rejected(self) -> torch.Tensor:
        return self.halves(self.sums)[1]

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Length-normalised log-probs (sum / trained tokens) -> (chosen, rejected)."""
        return self.halves(self.sums / self.counts.clamp(min=1).to(self.sums.dtype))

    @property
    def real(self) -> torch.Tensor:
        """``[B]`` bool: the pairs that are not blank (``global_batches``): a real pair's chosen response has
        trained tokens, a blank pair none."""
        return self.halves(self.counts)[0] > 0

    def select(self, pairs: torch.Tensor) -> SequenceLogps:
        """The rows of the pairs ``pairs`` (``[B]`` bool) picks, chosen rows first again."""
        chosen, rejected = self.halves(self.sums)
        chosen_counts, rejected_counts = self.halves(self.counts)
        return SequenceLogps(torch.cat([chosen[pairs], rejected[pairs]]),
                             torch.cat([chosen_counts[pairs], rejected_counts[pairs]]))


def sequence_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                   chunk_tokens: int = CHUNK_TOKENS) -> SequenceLogps:
    """Hidden states ``[batch, seq, hidden]`` before a bias-free LM head of ``weight [vocab, hidden]`` and
    ``labels [batch, seq]`` -> per row the summed float32 log-prob of the labels at trained positions (shifted as
    the SFT loss) and their count; differentiable in ``hidden`` and ``weight``."""
    targets = trained_positions(labels).to(hidden.device)
    trained = targets != IGNORE_INDEX
    rows = trained.nonzero()[:, 0]  # the row of each trained position, in the order hidden[trained] takes them
    h, t = hidden[trained], targets[trained]
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        token_logps = TokenLogProbs.apply(h, weight, t, chunk_tokens)
    else:
        token_logps = chunked_token_logps(h, weight, t, chunk_tokens, head_dtype(h, weight))
    sums = torch.zeros(labels.shape[0], dtype=torch.float32, device=hidden.device).index_add(0, rows, token_logps)
    return SequenceLogps(sums, trained.sum(dim=1))


def token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """As ``sequence_logps``, per token: ``[batch, seq]`` float32, at position t the log-prob of ``labels[t]`` given
    the tokens before it under ``softmax(logits / temperature)`` where ``labels[t]`` is trained, 0 elsewhere (and at
    t = 0); differentiable in ``hidden`` and ``weight``. The logits are divided by ``temperature`` by dividing the
    hidden states (the head has no bias), as GRPO scores its sampled tokens (TRL's ``temperature``)."""
    targets = trained_positions(labels).to(hidden.device)
    trained = targets != IGNORE_INDEX
    h, t = hidden[trained], targets[trained]
    if temperature != 1.0:
        h = h / temperature
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        values = TokenLogProbs.apply(h, weight, t, chunk_tokens)
    else:
        values = chunked_token_logps(h, weight, t, chunk_tokens, head_dtype(h, weight))
    predicted = F.pad(trained[:, :-1], (1, 0), value=False)  # position t + 1 is the token position t predicts
    return torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device).masked_scatter(predicted, values)


def chunked_token_logps(hidden, weight, targets, chunk_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """``hidden [n, h]``, ``targets [n]`` -> ``log softmax(hidden @ weight.T)[targets]`` ``[n]`` float32, one chunk
    of logits at a time (in ``dtype``, upcast to float32, as the SFT loss computes them)."""
    w = weight.to(dtype)
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens].to(dtype), targets[start:start + chunk_tokens]
        out[start:start + chunk_tokens], probs = log_softmax_at_targets_(F.linear(h, w).float(), t)
        del probs
    return out


class TokenLogProbs(torch.autograd.Function):
    """``(hidden [n, h], weight [v, h], targets [n], chunk_tokens)`` -> the log-prob of each target ``[n]``.

    Unlike the SFT loss, the gradient of each token's log-prob is weighted by what comes after (the DPO sigmoid
    of the whole pair), unknown in forward; so forward keeps only its inputs, and backward makes each chunk's
    logits again: ``d logp_i / d logits_i = one_hot(t_i) - softmax_i``, times the incoming gradient of token i.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens):
        dtype = head_dtype(hidden, weight)  # read here: backward runs outside autocast
        ctx.save_for_backward(hidden, weight, targets)
        ctx.dtype, ctx.chunk_tokens = dtype, chunk_tokens
        return chunked_token_logps(hidden, weight, targets, chunk_tokens, dtype)

    @staticmethod
    def backward(ctx, grad_logps):
        hidden, weight, targets = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype, size = ctx.dtype, ctx.chunk_tokens
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], size):
            h, t = hidden[start:start + size].to(dtype), targets[start:start + size]
            g = grad_logps[start:start + size].float()
            _, probs = log_softmax_at_targets_(F.linear(h, w).float(), t)
            grad_logits = probs.mul_(-g[:, None])
            grad_logits[torch.arange(len(t), device=t.device), t] += g
            grad_logits = grad_logits.to(dtype)
            if want_hidden:
                grad_hidden[start:start + size] = grad_logits @ w
            if want_weight:
                grad_weight += (grad_logits.t() @ h).float()
            del probs, grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


# ----------------------------------------------------------------------------------------------------- objectives


def dpo_loss(policy: SequenceLogps, reference: SequenceLogps, *, beta: float, loss_type: DpoLoss = "sigmoid",
             label_smoothing: float = 0.0, pairs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO (``sigmoid``, with ``label_smoothing`` cDPO), robust DPO (``robust``) or IPO (``ipo``) -> (loss, metrics).
    The loss is the pairs' summed loss over ``pairs`` (``mean_over``)."""
    chosen_ratio = policy.chosen - reference.chosen.detach()
    rejected_ratio = policy.rejected - reference.rejected.detach()
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) / (
            1 - 2 * label_smoothing)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    chosen_rewards, rejected_rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    return mean_over(losses, pairs), reward_metrics(chosen_rewards, rejected_rewards, policy)


def orpo_loss(policy: SequenceLogps, *, orpo_lambda: float, nll_tokens: float | None = None,
              pairs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """ORPO: NLL on the chosen tokens + ``orpo_lambda`` times the odds-ratio loss (a mean over ``pairs``,
    ``mean_over``) -> (loss, metrics).

    The NLL is the chosen rows' summed log-probs over ``nll_tokens``: by default this batch's chosen tokens; on
    several processes the ranks' mean of theirs, so that DDP's mean of the ranks' gradients (and the Trainer's of
    their losses) is the NLL over all the ranks' chosen tokens, as one process with the global batch computes it."""
    own_tokens = policy.halves(policy.counts)[0].sum().clamp(min=1)
    nll = -policy.chosen.sum() / (own_tokens if nll_tokens is None else nll_tokens)
    chosen_mean, rejected_mean = policy.means()
    log_odds = (chosen_mean - log1mexp(chosen_mean)) - (rejected_mean - log1mexp(rejected_mean))
    ratio = F.logsigmoid(log_odds)
    loss = nll - orpo_lambda * mean_over(ratio, pairs)
    metrics = reward_metrics(orpo_lambda * chosen_mean.detach(), orpo_lambda * rejected_mean.detach(), policy)
    metrics.update({"nll_loss": (-policy.chosen.detach().sum() / own_tokens).item(),  # this batch's, per token
                    "log_odds_ratio": ratio.mean().item(),
                    "log_odds_chosen": log_odds.mean().item()})
    return loss, metrics


def kto_kl(policy_kl: SequenceLogps, reference_kl: SequenceLogps, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """KTO's KL estimate of a batch, before the clamp: ``(sum, count)`` of ``log pi(y') - log ref(y')`` over its
    mismatched rows (a prompt with another row's completion) whose own row is real (``rows``, ``[B]`` bool) and
    whose borrowed completion has trained tokens (a blank row lends none), detached."""
    use = rows & (policy_kl.counts > 0)
    diff = (policy_kl.sums - reference_kl.sums).detach()[use]
    return diff.sum(), int(use.sum())


def kto_loss(policy: SequenceLogps, reference: SequenceLogps, desirable: torch.Tensor, kl: torch.Tensor, *,
             beta: float, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             rows: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """KTO on the completions' log-probs (``[B]`` each, the real rows only) and their labels (``desirable``,
    ``[B]`` bool) with ``kl``, the batch's KL estimate (a detached scalar, clamped at 0) -> (loss, metrics). The
    loss is the rows' summed loss over ``rows`` (``mean_over``); TRL's: ``cat(w_d chosen, w_u rejected).nanmean()``.
    The metrics (``rewards/*``, ``logps/*``: means over the rows of that label; nan where there are none)."""
    ratio = policy.sums - reference.sums.detach()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    rewards = beta * ratio.detach()

    def mean(values: torch.Tensor, which: torch.Tensor) -> float:
        return values[which].mean().item() if bool(which.any()) else float("nan")

    chosen, rejected = mean(rewards, desirable), mean(rewards, ~desirable)
    return mean_over(losses, rows), {
        "kl": float(kl),
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "logps/chosen": mean(policy.sums.detach(), desirable),
        "logps/rejected": mean(policy.sums.detach(), ~desirable),
    }


def mean_over(losses: torch.Tensor, pairs: float | None) -> torch.Tensor:
    """``losses`` (one per pair) summed over ``pairs``: by default their own count (their mean); on several
    processes the ranks' mean count of real pairs, so that DDP's mean of the ranks' gradients (and the Trainer's
    of their losses) is the mean over the global batch's pairs, as one process computes it, also when a rank's
    batch has blank pairs (``global_batches``) or none that are real."""
    return losses.sum() / (max(losses.numel(), 1) if pairs is None else pairs)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler 2012): ``log(-expm1(x))`` near 0,
    ``log1p(-exp(x))`` below ``-log 2``."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                   policy: SequenceLogps) -> dict[str, float]:
    """The per-batch means users watch: rewards and their margin, how often chosen wins, summed log-probs."""
    return {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "logps/chosen": policy.chosen.detach().mean().item(),
        "logps/rejected": policy.rejected.detach().mean().item(),
    }


@dataclass(frozen=True)
class PreferenceObjective:
    """What a preference run optimises, from ``train.method`` and its options (``from_config``).

    ``objective(policy, reference)`` -> (loss, metrics); ``reference`` is None when ``needs_reference`` is false;
    ``nll_tokens``: what ORPO's NLL divides by (``orpo_loss``).
    """

    method: str  # train.method (config.TrainMethod) other than "sft": "dpo", "orpo" or "kto"
    beta: float = 0.1
    dpo_loss: DpoLoss = "sigmoid"
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @classmethod
    def from_config(cls, train) -> PreferenceObjective:
        """``TrainConfig`` -> the objective it names."""
        return cls(train.method, beta=train.beta, dpo_loss=train.dpo_loss, label_smoothing=train.label_smoothing,
                   orpo_lambda=train.orpo_lambda, desirable_weight=train.desirable_weight,
                   undesirable_weight=train.undesirable_weight)

    @property
    def needs_reference(self) -> bool:
        return self.method in ("dpo", "kto")

    def kto(self, policy: SequenceLogps, reference: SequenceLogps, policy_kl: SequenceLogps,
            reference_kl: SequenceLogps, desirable: torch.Tensor, *, rows: float | None = None,
            reduce_kl=None) -> tuple[torch.Tensor, dict[str, float]]:
        """KTO -> (loss, metrics) of a batch's real rows (a completion with trained tokens; blank rows left out):
        the completions' log-probs and the mismatched rows' (``policy_kl``, ``reference_kl``), each ``[B]``.
        ``reduce_kl(sum, count)`` -> the KL estimate's ``(sum, count)`` over every rank (default: this batch's)."""
        real = policy.counts > 0
        kl_sum, kl_count = kto_kl(policy_kl, reference_kl, real)
        if reduce_kl is not None:
            kl_sum, kl_count = reduce_kl(kl_sum, kl_count)
        kl = (kl_sum / max(kl_count, 1)).clamp(min=0)
        if not bool(real.all()):
            policy = SequenceLogps(policy.sums[real], policy.counts[real])
            reference = SequenceLogps(reference.sums[real], reference.counts[real])
            desirable = desirable[real]
        return kto_loss(policy, reference, desirable.to(torch.bool), kl, beta=self.beta,
                        desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
                        rows=rows)

    def __call__(self, policy: SequenceLogps, reference: SequenceLogps | None, *, nll_tokens: float | None = None,
                 pairs: float | None = None):
        """-> (loss, metrics) of the batch's real pairs (``SequenceLogps.real``: blank pairs left out); the
        metrics are means over them (nan when there are none)."""
        real = policy.real
        if not bool(real.all()):
            policy = policy.select(real)
            reference = reference.select(real) if reference is not None else None
        if self.method == "dpo":
            return dpo_loss(policy, reference, beta=self.beta, loss_type=self.dpo_loss,
                            label_smoothing=self.label_smoothing, pairs=pairs)
        if self.method == "orpo":
            return orpo_loss(policy, orpo_lambda=self.orpo_lambda, nll_tokens=nll_tokens, pairs=pairs)
        raise ValueError(f"unknown preference method {self.method!r}")
