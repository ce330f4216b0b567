"""A prompt and its responses in, finished examples sharing the prompt out: a preference pair (``mask_pair``), or
one response after its prompt (``mask_response``: KTO's sequence, each side of a pair).

    >>> pair = mask_pair([{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "4"}],
    ...                  [{"role": "assistant", "content": "5"}], tok)  # Qwen3's template
    >>> tok.decode(pair.chosen.input_ids[:pair.prompt_length])
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
    >>> tok.decode([t for t in pair.rejected.labels if t != IGNORE_INDEX])
    '<think>\\n\\n</think>\\n\\n5<|im_end|>'

A side is exactly what SFT trains for the conversation ``prompt + response`` with only the response's assistant
turns marked trained (``mark_side``, rendered with ``pair_policy``): the same one render and verified walk, the same
tokens and labels (``example.mask_conversation``). Nothing here finds a turn: the boundary between prompt and
response is where the render says the response's first turn starts its generated part (``TurnSpan.start``: after
the header, ``[/INST]`` or whatever the template's prompt side writes, and what the generation prompt adds after
it); the render is cut there before it is tokenized, so the prompt's ids are the prompt tokenized alone, as at
inference. Where a pair's two sides start at different places (a template whose generation prompt pre-fills an
empty reasoning block, which the rejected side's turn writes whole and the chosen side's, with reasoning, parts
from after ``<think>\n``), the pair's prompt ends at the earlier one, and the other side is cut there too: its text
up to its own start stays untrained.

The shared prompt of a pair (``shared_prompt_length``), checked on every pair:

- the two renders are identical up to that boundary (else ``pair_prompt_differs``);
- the tokens wholly before the boundary are the same ids on both sides (else ``pair_prompt_differs``); their
  count (the fewer of the two sides') is ``prompt_length``;
- with a tokenizer that is not cut (``tokenize.cuttable``: one that writes a prefix before every text), one
  boundary token per side may differ: where the tokenizer merged the prompt's last characters with the response's
  first ones. It starts in the prompt, so SFT's first-character rule leaves it untrained on both sides; it is not
  counted in ``prompt_length``; ``boundary_merges`` says on how many sides a token straddles the boundary (0 where
  the render is cut). More than one differing token starting in the prompt is ``pair_prompt_differs``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from qlora_train.masking.example import MaskedConversation, finish_examples, render_example
from qlora_train.masking.layout import TemplateLayout
from qlora_train.masking.messages import DropReason, Message, RowRejected, engine_messages
from qlora_train.masking.policy import DEFAULT_POLICY, LossPolicy
from qlora_train.masking.tokenize import IGNORE_INDEX  # noqa: F401 (the doctest)

SIDES = ("chosen", "rejected")  # a pair's two sides, in this order wherever both are named


def pair_policy(policy: LossPolicy) -> LossPolicy:
    """The policy a response is rendered with: ``policy``'s ``think_loss`` and ``train_on_eos``, except that
    ``all`` trains only the response's end markers (``turn``: a prompt message's marker is never trained), and no
    ``last_turn_only`` (every assistant turn of a response is trained). Which messages are trained is not the
    role rules' to decide: ``mark_side`` marks them."""
    return replace(policy, last_turn_only=False,
                   train_on_eos="turn" if policy.train_on_eos == "all" else policy.train_on_eos)


def mark_side(prompt: list[Message], response: list[Message], policy: LossPolicy) -> list[Message]:
    """``prompt + response`` with their ``train`` flags: no prompt message trained, every assistant turn of the
    response trained, its tool results not (a message's own ``training`` flag is not read for a response)."""
    flagged = [{**m, "train": False} for m in prompt] + [{**m, "train": m["role"] == "assistant"} for m in response]
    return policy.mark(flagged)


@dataclass(frozen=True)
class MaskedResponse:
    """A response after its prompt: the sequence ``prompt + response`` with the response trained."""

    sequence: MaskedConversation
    boundary: int  # the character where the response's first turn starts its generated part
    prompt_length: int  # tokens wholly before the boundary
    boundary_merges: int  # 1 where a token straddles the boundary (a tokenizer that is not cut)

    @property
    def reasoning_dropped_turns(self) -> int:
        """Response turns whose reasoning the template does not render (trained without it, as SFT's
        ``reasoning_history: drop``)."""
        return sum(t.reasoning_dropped for t in self.sequence.rendered.turns)


@dataclass(frozen=True)
class MaskedPair:
    """A preference pair's two sides, sharing ``prompt_length`` tokens."""

    chosen: MaskedConversation
    rejected: MaskedConversation
    prompt_length: int
    boundary_merges: int  # on how many sides a token straddles the boundary
    reasoning_dropped_turns: int  # of both responses

    def side(self, name: str) -> MaskedConversation:
        return self.chosen if name == "chosen" else self.rejected


def mask_response(prompt: list[Message], response: list[Message], tokenizer, *, tools: list[dict] | None = None,
                  policy: LossPolicy = DEFAULT_POLICY, layout: TemplateLayout | None = None,
                  side: str = "completion") -> MaskedResponse:
    """A prompt and one response (messages as ``mask_conversation`` takes them: the response opens with an assistant
    turn) -> the ``MaskedResponse``, or ``RowRejected`` (what the template or the mask check refuses, its detail
    naming ``side``)."""
    return _responses(prompt, [(side, response)], tokenizer, tools=tools, policy=policy, layout=layout)[0]


def mask_pair(prompt: list[Message], chosen: list[Message], rejected: list[Message], tokenizer, *,
              tools: list[dict] | None = None, policy: LossPolicy = DEFAULT_POLICY,
              layout: TemplateLayout | None = None) -> MaskedPair:
    """A prompt and two responses (messages as ``mask_conversation`` takes them) -> the ``MaskedPair``, or
    ``RowRejected``: a side the template or the mask check refuses (its reason, the detail naming the side), a
    prompt rendered or tokenized differently on the two sides (``pair_prompt_differs``, ``shared_prompt_length``),
    two sides with the same ids (``pair_identical``). Both sides are tokenized in one call."""
    c, r = _responses(prompt, [("chosen", chosen), ("rejected", rejected)], tokenizer, tools=tools, policy=policy,
                      layout=layout)
    if c.sequence.input_ids == r.sequence.input_ids:
        raise RowRejected(DropReason.PAIR_IDENTICAL, "chosen and rejected render to the same tokens")
    prompt_length, merges = shared_prompt_length(c, r)
    return MaskedPair(c.sequence, r.sequence, prompt_length, merges,
                      c.reasoning_dropped_turns + r.reasoning_dropped_turns)


def _responses(prompt: list[Message], responses: list[tuple[str, list[Message]]], tokenizer, *, tools, policy,
               layout) -> list[MaskedResponse]:
    side_policy = pair_policy(policy)
    examples = []
    prompt = engine_messages(prompt)
    for side, response in responses:
        response = engine_messages(response)
        try:
            examples.append(render_example(mark_side(prompt, response, side_policy), tokenizer, tools=tools,
                                           policy=side_policy, layout=layout))
        except RowRejected as rej:
            raise RowRejected(rej.reason, f"{side}: {rej.detail} (messages counted over prompt + response)",
                              traceback=rej.traceback) from None
    # the responses share the prompt through the earlier of their starts: a side whose turn writes more of the
    # generation prompt's text (the empty block it pre-fills, where the other side's turn has reasoning) starts
    # later, and is cut there too, so that both sides' prompt tokens are the same
    starts = [next(t.start for t in ex.rendered.turns if t.index == len(prompt)) for ex in examples]
    boundary = min(starts)
    examples = [ex if start == boundary else replace(ex, rendered=ex.rendered._replace(extra_cuts=(boundary,)))
                for ex, start in zip(examples, starts)]
    out = []
    for ex, masked in zip(examples, finish_examples(examples, tokenizer)):
        if isinstance(masked, RowRejected):
            raise masked
        whole, starting = masked.offsets.tokens_before(boundary, len(ex.rendered.text))
        out.append(MaskedResponse(masked, boundary, whole, starting - whole))
    return out


def shared_prompt_length(chosen: MaskedResponse, rejected: MaskedResponse) -> tuple[int, int]:
    """The prompt both sides share -> ``(prompt_length, boundary_merges)``, or ``pair_prompt_differs``.

    Each side's boundary is a cut of its render (no token crosses it where the tokenizer is cut). The renders
    must be the same text before it. ``prompt_length`` is the fewer of the two sides' tokens wholly before it;
    those ids must be the same on both sides. After them, each side may have at most one more token starting in
    the prompt (only where the tokenizer is not cut): the boundary token, which either straddles the boundary (the
    tokenizer merged the prompt's end with the response's start; counted in ``boundary_merges``) or ends at it
    where the other side merged it. It starts in the prompt, so the first-character rule leaves it untrained on
    both sides.
    """
    a, b = (s.sequence.text[:s.boundary] for s in (chosen, rejected))
    if a != b:
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"the template renders the prompt differently for chosen "
                          f"and rejected (first difference at char {k}: {a[k:k + 20]!r} vs {b[k:k + 20]!r})")
    prompt_length = min(chosen.prompt_length, rejected.prompt_length)
    ids_c, ids_r = chosen.sequence.input_ids, rejected.sequence.input_ids
    if ids_c[:prompt_length] != ids_r[:prompt_length]:
        k = next(i for i, (x, y) in enumerate(zip(ids_c, ids_r)) if x != y)
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"the prompt tokenizes differently for chosen and rejected "
                          f"(token {k} of the {prompt_length} before the boundary differs)")
    unshared = [s.prompt_length + s.boundary_merges - prompt_length for s in (chosen, rejected)]
    if max(unshared) > 1:
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"the prompt's last tokens differ between chosen and "
                          f"rejected beyond one boundary token (tokens starting in the prompt after the shared "
                          f"{prompt_length}: {unshared[0]} and {unshared[1]})")
    return prompt_length, chosen.boundary_merges + rejected.boundary_merges
