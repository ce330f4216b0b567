"""Sampling completions with the policy: token in, token out.

``sample(model, prompts, sampling, stop=..., end=..., pad_id=..., seed=...)`` takes each prompt's ids as the data
pipeline made them (``masking.render_prompt``: the render with the generation prompt, tokenized as at inference),
left-pads them into one batch, each prompt ``num_generations`` times, and samples with transformers' ``generate``
(KV cache on, the model in eval mode, gradients off; a peft model samples with its adapter enabled, as it is). Each
completion's ids are kept exactly as sampled, cut after the first stop token: they are never decoded and tokenized
again, so the log-probs the loss takes are of the very tokens the model drew.

A completion ends when it samples one of ``stop`` (the template's end-of-turn ids and the tokenizer's eos); it is
**ended** when its last token is one of ``end`` (the end-of-turn ids), else **truncated**: cut at
``max_completion_length``, or closed by an eos that is not the template's end of turn.

The draw: ``generate`` decodes greedily over scores that ``GumbelSampler`` makes one-hot at a token drawn from
``softmax(logits / temperature)`` restricted to the top-p nucleus (transformers' ``TopPLogitsWarper``): the Gumbel-max
draw, ``argmax(logits / T + g)`` with ``g = -log(-log(u))``, is an exact sample of that distribution, far cheaper
than ``torch.multinomial`` over a 150k vocabulary on a CPU (docs/rl.md#sampling), and it draws from its own
``torch.Generator`` seeded per step (``seed``): the same step samples the same completions, also after a resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (``rl``: num_generations, max_completion_length, temperature, top_p)."""

    num_generations: int
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass(frozen=True)
class Rollout:
    """A batch's completions: ``num_generations`` per prompt, the prompt's in a row."""

    prompt_ids: list[list[int]]  # one per completion (each prompt repeated)
    completion_ids: list[list[int]]  # as sampled, through the first stop token
    ended: list[bool]  # the last token is an end-of-turn token (else truncated)
    seconds: float  # generate's wall time

    @property
    def tokens(self) -> int:
        return sum(map(len, self.completion_ids))


class GumbelSampler:
    """A logits processor that draws the next token (see the module doc): scores -> 0 at the drawn token, -inf
    elsewhere, so that greedy decoding takes it."""

    def __init__(self, temperature: float, top_p: float, generator: torch.Generator):
        from transformers import TopPLogitsWarper

        self.temperature, self.generator = temperature, generator
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logits = scores.float() / self.temperature
        if self.top_p is not None:
            logits = self.top_p(input_ids, logits)
        u = torch.rand(logits.shape, generator=self.generator, device=self.generator.device)
        drawn = (logits - torch.log(-torch.log(u.clamp_(min=torch.finfo(u.dtype).tiny)))).argmax(dim=-1)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(drawn), device=out.device), drawn] = 0
        return out


def sample(model, prompts: list[list[int]], sampling: Sampling, *, stop: tuple[int, ...], end: tuple[int, ...],
           pad_id: int, seed: int, guide=None) -> Rollout:
    """``prompts`` (ids) -> their ``Rollout`` (see the module doc); ``model`` is left in the mode it was in.
    ``guide``: a logits processor that restricts which tokens may be drawn before the draw (``rl.guide``)."""
    from transformers import GenerationConfig, LogitsProcessorList

    device = next(model.parameters()).device
    repeated = [p for p in prompts for _ in range(sampling.num_generations)]
    width = max(map(len, repeated))
    input_ids = torch.full((len(repeated), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(repeated), width), dtype=torch.long)
    for i, ids in enumerate(repeated):  # left padding: every prompt ends where generation starts
        input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention[i, width - len(ids):] = 1
    config = GenerationConfig(do_sample=False, max_new_tokens=sampling.max_completion_length,
                              eos_token_id=list(stop), pad_token_id=pad_id, use_cache=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    processor = GumbelSampler(sampling.temperature, sampling.top_p, generator)
    training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                 generation_config=config,
                                 logits_processor=LogitsProcessorList([p for p in (guide, processor) if p]))
    finally:
        model.train(training)
    seconds = time.perf_counter() - start
    stops, ends = set(stop), set(end)
    completions, ended = [], []
    for row in out[:, width:].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
        completions.append(row[:cut])
        ended.append(bool(row[:cut]) and row[cut - 1] in ends)
    return Rollout(repeated, completions, ended, seconds)
