"""The fast path checked against the rule on one conversation: both masks made, compared token by token.

The fast path (``render.render_conversation``, ``verified_by="layout"``) finds each trained turn with the probed
or declared layout; the rule (``prefix.render_by_prefixes``) finds it with per-turn prefix renders. Where both
decide, they must give the same ``input_ids`` and ``labels``: each render is finished as every example is
(``example.finish_examples``: the one encode step, the projection, ``make_labels``). The pipeline runs this on a
sample of the user's own rows (``data.rule_check``, docs/masking.md#the-rule-checked-at-run-time).

    >>> messages = DEFAULT_POLICY.mark([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
    >>> check_with_rule(messages, render_conversation(messages, tok), tok).outcome
    'agree'

Outcomes:

- ``agree``: the same ids and labels (a row the layout could not verify was verified by the rule itself: agrees);
- ``undecided``: the rule cannot decide the row: it trains a message other than an assistant turn (``data.mask``)
  or the end markers of untrained ones (``train_on_eos: all``),
  the template is not prefix-stable on it (the whole conversation
  writes a turn differently from its own prefix render: Qwen3 drops an earlier turn's reasoning block), the render
  through a turn writes the turns before it differently from the generation prompt's render (Mistral moves the
  system prompt), or a prefix does not render. Each trained turn's answer (its generated text after any reasoning
  block, through its end marker) is still compared with what the render through that turn alone writes for it
  (``_answers_check``): a fast path that trains past the turn's end (an end marker running into the next turn's
  opener) disagrees there;
- ``disagree``: ids or labels differ, an answer differs, or the rule refuses for another reason a row the fast
  path kept. ``detail`` names the first differing token (or character) and both trained texts, shortened.

The rule reads the layout's trailer and end markers only inside the render through a turn and right after it, its
openers and prompt tail only where that render parts from the turn's generation prompt inside an earlier message
(``prefix.generated_part``); where answers are compared, the end markers that may differ between a
last and an earlier turn are the probe's, never a declared one (``probed_end_markers``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from qlora_train.masking.example import RenderedExample, finish_examples
from qlora_train.masking.images import expand_images, image_rule
from qlora_train.masking.layout import TemplateLayout, probe_key
from qlora_train.masking.layout_declaration import resolve_layout, template_layout
from qlora_train.masking.messages import WHITESPACE, DropReason, Message, RowRejected, message_images
from qlora_train.masking.policy import DEFAULT_POLICY, LossPolicy, is_trained
from qlora_train.masking.prefix import PrefixRenderer, common_prefix_length, prefix_turn, render_by_prefixes
from qlora_train.masking.render import render_conversation  # noqa: F401 (the doctest)
from qlora_train.masking.rendered import RenderedConversation, TurnSpan, trained_spans
from qlora_train.masking.tokenize import IGNORE_INDEX

AGREE, UNDECIDED, DISAGREE = "agree", "undecided", "disagree"
NOT_PREFIX_STABLE = "not prefix-stable"  # what ``prefix_turn`` says where the rule cannot decide
_SHOWN = 60  # characters of each trained text a disagreement's detail shows


class Masked(NamedTuple):
    """One path's tokens: what training would get from it (before truncation)."""

    input_ids: list[int]
    labels: list[int]


class RuleCheck(NamedTuple):
    outcome: str  # AGREE, UNDECIDED or DISAGREE
    detail: str = ""  # DISAGREE: where the masks differ and both trained texts; UNDECIDED: why
    fast: Masked | None = None  # DISAGREE: the layout's tokens and the rule's (shown by --debug-samples); where the
    rule: Masked | None = None  # rule cannot decide the row, its tokens of the render through the differing turn


def masked_tokens(rendered: list[RenderedConversation], tokenizer) -> list[Masked]:
    """Renders -> their ids and labels, finished as every example is (``example.finish_examples``)."""
    out = []
    for m in finish_examples([RenderedExample([], None, r) for r in rendered], tokenizer):
        if isinstance(m, RowRejected):
            raise m
        out.append(Masked(m.input_ids, m.labels))
    return out


def check_with_rule(messages: list[Message], rendered: RenderedConversation, tokenizer, *,
                    tools: list[dict] | None = None, policy: LossPolicy = DEFAULT_POLICY,
                    layout: TemplateLayout | None = None) -> RuleCheck:
    """Marked messages and the fast path's render of them -> ``RuleCheck`` (see the module doc)."""
    if rendered.verified_by != "layout":
        return RuleCheck(AGREE)  # the layout could not verify it: the rule's prefix renders did, it is the rule
    layout = template_layout(tokenizer) if layout is None else layout
    renders = PrefixRenderer(messages, tokenizer, tools, layout)  # made once, looked at again below
    if any(is_trained(m, i) and m["role"] != "assistant" for i, m in enumerate(messages)):
        return _answers_check(renders, rendered, tokenizer, layout, policy, "a trained message other than an "
                              "assistant turn (data.mask): the rule masks assistant turns only")
    if policy.train_on_eos == "all":  # the markers after untrained messages are the layout's alone
        return _answers_check(renders, rendered, tokenizer, layout, policy, "train_on_eos: all trains the end "
                              "markers of untrained messages, which the rule does not place")
    images = image_rule(tokenizer)
    try:  # (a vision-language model's render is checked before the processor's expansion, then both expanded)
        rule = render_by_prefixes(messages, tokenizer, tools=tools, policy=policy,
                                  text=rendered.text if images is None else None, renders=renders)
        if images is not None:
            rule = expand_images(rule, message_images(messages), images)
    except RowRejected as rej:
        if rej.reason == DropReason.TEMPLATE_ERROR or NOT_PREFIX_STABLE in rej.detail or _prompt_side_moves(
                renders, rendered):
            return _answers_check(renders, rendered, tokenizer, layout, policy, rej.detail)
        return RuleCheck(DISAGREE, f"the rule refuses the row the layout masked ({rej.reason}: {rej.detail}); the "
                         f"layout trains {_trained_text(rendered)}")
    fast, by_rule = masked_tokens([rendered, rule], tokenizer)
    if fast == by_rule:
        return RuleCheck(AGREE)
    if _prompt_side_moves(renders, rendered):  # the prefix renders' verdict stands on a prompt that moved: the
        # rule's spans can take in the moved text (Mistral's last user turn), so only the answers are compared
        return _answers_check(renders, rendered, tokenizer, layout, policy, "the render through a turn writes the "
                              "turns before it differently from its generation prompt")
    return RuleCheck(DISAGREE, _token_difference(fast, by_rule, tokenizer), fast, by_rule)


def _prompt_side_moves(renders: PrefixRenderer, rendered: RenderedConversation) -> bool:
    """Whether the rule cannot place some trained turn's start (``_prompt_moves``)."""
    return any(_prompt_moves(renders, turn.index) for turn in rendered.turns)


def _prompt_moves(renders: PrefixRenderer, i: int) -> bool:
    """Whether the render through turn ``i`` writes the conversation before it differently from the generation
    prompt's render (Mistral moves the system prompt into the last user turn), or a prefix does not render: the
    rule cannot place the turn's start (its prompt and its render share less than the prompt's own
    conversation), as the prefix-render oracle of the tests judges it."""
    try:
        prompt, bare, q = renders.render(i, True), renders.render(i, False), renders.render(i + 1, False)
    except RowRejected:
        return True
    return common_prefix_length(prompt, q) < common_prefix_length(bare, prompt)


def _token_difference(fast: Masked, rule: Masked, tokenizer) -> str:
    """Where two paths' tokens first differ, and the trained text of each."""
    k = next((i for i, (a, b) in enumerate(zip(zip(*fast), zip(*rule))) if a != b),
             min(len(fast.input_ids), len(rule.input_ids)))

    def trained(m: Masked) -> str:
        return _short(tokenizer.decode([t for t, lab in zip(m.input_ids, m.labels) if lab != IGNORE_INDEX]))

    def at(m: Masked) -> str:
        if k >= len(m.input_ids):
            return "(no token)"
        piece = tokenizer.decode([m.input_ids[k]])
        return f"{piece!r} {'trained' if m.labels[k] != IGNORE_INDEX else 'masked'}"

    return (f"token {k} differs: the layout has {at(fast)}, the rule {at(rule)}; the layout trains {trained(fast)}, "
            f"the rule {trained(rule)}")


def _short(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN // 2] + "…" + text[-_SHOWN // 2:])


def _trained_text(rendered: RenderedConversation) -> str:
    return _short("".join(c for c, m in zip(rendered.text, rendered.char_mask) if m))


def _answers_check(renders: PrefixRenderer, rendered: RenderedConversation, tokenizer, layout: TemplateLayout,
                   policy: LossPolicy, why: str) -> RuleCheck:
    """A row the rule cannot decide: each trained turn's answer by the layout against the rule's in the render
    through that turn alone -> DISAGREE naming the first turn whose answer by the layout runs on past the rule's
    (the rule's answer, then more: an end marker running into the next turn's opener), with the layout's tokens
    of the row and the rule's of the render through that turn, that turn alone trained; else UNDECIDED. Answers
    that differ otherwise are not decided by this comparison (the render through a turn alone may write it as
    a last turn: its reasoning shown, an empty block's close, Phi-3.5's eos after its end marker).

    An answer may end with another end marker where the conversation goes on (gpt-oss: ``<|return|>`` last,
    ``<|end|>`` before another turn; GLM: the next turn's ``<|user|>``): answers that differ only there agree.
    Those markers are the probe's (``probed_end_markers``), never a declared one: a declared marker is what is
    being checked."""
    messages = renders.messages
    trained = [is_trained(m, i) for i, m in enumerate(messages)]
    markers = probed_end_markers(renders.tokenizer, layout)
    for turn in rendered.turns:
        if messages[turn.index]["role"] != "assistant" or _prompt_moves(renders, turn.index):
            continue
        try:
            q = renders.render(turn.index + 1, False)
            own = prefix_turn(renders, q, turn.index, layout, trained_before=trained)  # q is its own whole render
        except RowRejected:
            continue  # the rule cannot place this turn even alone: nothing to compare
        fast, rule = _answer(rendered.text, turn, layout), _answer(q, own, layout)
        if fast == rule or _less_marker(fast, markers) == _less_marker(rule, markers) or not (
                len(fast) > len(rule) and fast.startswith(rule)):
            continue  # only a layout that trains past where the rule ends the turn is known wrong here
        k = next((j for j, (a, b) in enumerate(zip(fast, rule)) if a != b), min(len(fast), len(rule)))
        mask = np.zeros(len(q), dtype=np.uint8)
        for a, b in trained_spans(own, policy.think_loss):
            mask[a:b] = 1
        alone = RenderedConversation(q, mask, (), (own,), (), "prefix_renders")
        return RuleCheck(DISAGREE, f"messages[{turn.index}]: the turn's answer differs at char {k}: the layout "
                         f"trains {_short(fast)}, the render through this turn alone ends it {_short(rule)}",
                         *masked_tokens([rendered, alone], tokenizer))
    return RuleCheck(UNDECIDED, why)


def _less_marker(answer: str, markers: tuple[str, ...]) -> str:
    for m in markers:
        if m and answer.endswith(m):
            return answer[:-len(m)].rstrip(WHITESPACE)
    return answer


_PROBED: dict[tuple[str, str], tuple[str, ...]] = {}


def probed_end_markers(tokenizer, layout: TemplateLayout) -> tuple[str, ...]:
    """The end markers the probe found, whatever ``model.template_layout`` declares (the layout's where nothing is
    declared or the probe fails); probed once per template and vocabulary."""
    if not layout.declared:
        return layout.end_markers
    key = probe_key(tokenizer)
    if key not in _PROBED:
        probed = resolve_layout(tokenizer).probed
        _PROBED[key] = probed.end_markers if probed is not None else layout.end_markers
    return _PROBED[key]


def _answer(text: str, turn: TurnSpan, layout: TemplateLayout) -> str:
    """A turn's generated text after its reasoning block (which a template may render differently in the whole
    conversation and in the render through the turn: dropped, or opened by the generation prompt and never
    closed), through its end marker."""
    a = max(turn.start, turn.body_start)  # after a block the walk read (one the generation prompt opened too)
    while a < turn.end and text[a] in WHITESPACE:
        a += 1
    if layout.think_open and layout.think_close and text.startswith(layout.think_open, a):
        close = text.find(layout.think_close, a, turn.end)
        a = close + len(layout.think_close) if close >= 0 else a + len(layout.think_open)
    return text[a:turn.end].strip(WHITESPACE)
