"""The causal-LM loss without vocabulary-sized logits: LM head and cross-entropy fused, in chunks.

The model's own loss (transformers' ``ForCausalLMLoss``) projects every position of every row onto
the vocabulary and keeps those logits, their log-softmax and their gradient in float32: at Qwen's
151,936 tokens that is 0.6 MB per position and per buffer, 2.5 GB for one 4,096-token row, spent
mostly on positions whose label is -100. ``causal_lm_loss`` computes the same number differently:

1. only the hidden states whose shifted label is trained reach the head (``trained_positions``);
2. the head and the cross-entropy run ``CHUNK_TOKENS`` trained tokens at a time
   (``LinearCrossEntropy``): a chunk's logits are made, turned into its loss and, when gradients
   are wanted, at once into the gradients of its hidden states (and of the head weight if that is
   trained), then freed. At most one chunk of float32 logits exists at any time, and backward only
   scales the gradients kept from forward;
3. the reduction is ``ForCausalLMLoss``'s: the sum over trained tokens divided by
   ``num_items_in_batch`` when the Trainer passes it (the trained tokens of the whole accumulated
   batch), else the mean over this batch's trained tokens.

    >>> loss = causal_lm_loss(hidden, lm_head.weight, labels, num_items_in_batch=n)  # == model(...).loss
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qlora_train.masking import IGNORE_INDEX

# Trained tokens per chunk. One chunk's float32 logits take CHUNK_TOKENS x vocabulary x 4 bytes:
# 0.58 GiB at Qwen's 151,936 tokens (plus a bf16 copy of the chunk's gradient on CUDA). Larger
# chunks are not faster: each is already one big matrix product.
CHUNK_TOKENS = 1024


def trained_positions(labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """``labels [batch, seq]`` -> the label each position predicts: the next position's label, -100 at
    the end of each row (``ForCausalLMLoss``'s shift); ``shift_labels`` when the batch carries them.

    >>> trained_positions(torch.tensor([[-100, 5, 6]]))
    tensor([[   5,    6, -100]])
    """
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                   num_items_in_batch: torch.Tensor | int | None = None, shift_labels: torch.Tensor | None = None,
                   chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """Hidden states ``[batch, seq, hidden]`` before a bias-free LM head of ``weight [vocab, hidden]``,
    and ``labels [batch, seq]`` -> the loss ``ForCausalLMLoss`` would give on ``hidden @ weight.T``
    (a float32 scalar), differentiable in ``hidden`` and ``weight``."""
    targets = trained_positions(labels, shift_labels).to(hidden.device)
    trained = targets != IGNORE_INDEX
    hidden, targets = hidden[trained], targets[trained]
    count = num_items_in_batch if num_items_in_batch is not None else targets.numel()
    scale = 1.0 / torch.as_tensor(count, dtype=torch.float32, device=hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, weight, targets, scale, chunk_tokens)
    loss, _, _ = chunked_loss_and_grads(hidden, weight, targets, scale, chunk_tokens, want_hidden=False,
                                        want_weight=False)
    return loss


class LinearCrossEntropy(torch.autograd.Function):
    """``(hidden [n, h], weight [v, h], targets [n], scale, chunk_tokens)`` -> ``scale * sum of
    cross_entropy(hidden @ weight.T, targets)``; the gradients are made chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, chunk_tokens):
        loss, grad_hidden, grad_weight = chunked_loss_and_grads(
            hidden, weight, targets, scale, chunk_tokens,
            want_hidden=ctx.needs_input_grad[0], want_weight=ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_loss.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_loss_and_grads(hidden, weight, targets, scale, chunk_tokens: int, *, want_hidden: bool,
                           want_weight: bool):
    """The loop of ``LinearCrossEntropy``: ``(scale * summed loss, d/d hidden or None, d/d weight or None)``.

    Per chunk, as the default path computes: logits in the head's compute dtype (``head_dtype``: under
    autocast its dtype, as for ``lm_head``), upcast to float32; loss = logsumexp - target logit;
    gradient of the logits = ``scale * (softmax - one_hot)``, cast back to the compute dtype before
    the two matrix products. The softmax is made in place in the logits' buffer, so a chunk holds one
    ``[chunk, vocab]`` float32 tensor (and its cast in reduced precision). The weight is cast to the
    compute dtype once, not per chunk.
    """
    dtype = head_dtype(hidden, weight)
    w = weight.to(dtype)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens].to(dtype), targets[start:start + chunk_tokens]
        target_logps, probs = log_softmax_at_targets_(F.linear(h, w).float(), t)
        total -= target_logps.sum()
        if want_hidden or want_weight:
            grad_logits = probs
            grad_logits[torch.arange(len(t), device=t.device), t] -= 1.0
            grad_logits = grad_logits.mul_(scale).to(dtype)
            if want_hidden:
                grad_hidden[start:start + chunk_tokens] = grad_logits @ w
            if want_weight:
                grad_weight += (grad_logits.t() @ h).float()
        del probs
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return total * scale, grad_hidden, grad_weight


def log_softmax_at_targets_(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's float32 ``logits [n, vocab]`` and ``targets [n]`` -> (log-probability of each target ``[n]``,
    the softmax ``[n, vocab]``). The softmax is made in place in ``logits``' buffer (the logits are gone after),
    so a chunk holds one ``[n, vocab]`` float32 tensor. Shared by the SFT loss and ``preference_loss``.

    >>> log_softmax_at_targets_(torch.zeros(1, 4), torch.tensor([2]))[0]  # uniform over 4: log(1/4)
    tensor([-1.3863])
    """
    target_logit = logits.gather(1, targets[:, None])
    peak = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(peak).exp_()
    sum_exp = probs.sum(dim=1, keepdim=True)
    target_logps = (target_logit - peak - sum_exp.log()).squeeze(1)
    return target_logps, probs.div_(sum_exp)


def head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``lm_head`` computes in: autocast's on this device when it is on, else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype
