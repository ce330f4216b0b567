"""Stage 3: render the whole conversation ONCE and mark, per character, what is trained.

    >>> text, mask = build_text_and_masks(
    ...     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tok)
    >>> text
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nyo<|im_end|>\\n'
    >>> "".join(c for c, m in zip(text, mask) if m)
    'yo<|im_end|>'

How spans are found (no prefix re-rendering, no guessed masks):

1. ``template_layout`` probes the template once (cached) on a fixed two-message
   conversation: the assistant header is what ``add_generation_prompt`` appends
   (cut before an opening ``<think>``), the end-of-turn marker is the added token
   the template writes right after an assistant's content.
2. The real conversation is rendered once. Walking its messages in order, each
   trained turn is the first assistant header after the previous turn, then an
   optional ``<think>…</think>`` block whose inside must equal the message's
   ``reasoning_content``, then the message's content (exactly, up to
   surrounding whitespace), then its tool calls (every function name, in
   order), then the end-of-turn marker. Every non-trained message's content
   must appear in the render, in order, and must not contain the assistant
   header (that would make the alignment ambiguous).
3. Anything that does not check out refuses the row (``RowRejected``) instead
   of training it with a guessed mask.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from qlora_train.data.messages import DropReason, Message, RowRejected

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_PROBE_USER = "qlora-train probe question"
_PROBE_ANSWER = "qlora-train probe answer"
_WS = " \t\r\n"


@dataclass(frozen=True)
class TemplateLayout:
    """What a chat template writes around an assistant turn."""

    assistant_header: str
    end_of_turn: str
    think_open: str = THINK_OPEN
    think_close: str = THINK_CLOSE


class TurnSpan(NamedTuple):
    """Character spans of one trained message in the rendered text."""

    index: int
    start: int  # first generated character (after the role header)
    end: int  # one past the end-of-turn marker
    body_start: int  # first character after the think block (== start without one)
    reasoning: tuple[int, int] | None  # rendered reasoning text, when rendered
    eot_start: int | None = None  # where the end-of-turn marker starts (None: the template writes none)


class RenderedConversation(NamedTuple):
    text: str
    char_mask: np.ndarray  # uint8, one entry per character of text
    message_ends: tuple[int, ...]  # char offset where each message's rendered part ends
    turns: tuple[TurnSpan, ...]


def render_text(messages: list[Message], tokenizer, *, tools=None, add_generation_prompt=False) -> str:
    """Exactly ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)``."""
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


_LAYOUTS: dict[tuple[int, str], TemplateLayout] = {}


def template_layout(tokenizer) -> TemplateLayout:
    """Probe the tokenizer's chat template once: assistant header and end-of-turn marker."""
    key = (id(tokenizer), tokenizer.chat_template or "")
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    user = [{"role": "user", "content": _PROBE_USER}]
    plain = render_text(user, tokenizer)
    prompted = render_text(user, tokenizer, add_generation_prompt=True)
    if not prompted.startswith(plain) or prompted == plain:
        raise ValueError("chat template: add_generation_prompt must append an assistant header to the render")
    header = prompted[len(plain):]
    if THINK_OPEN in header:  # templates that open the reasoning block in the prompt
        header = header[: header.index(THINK_OPEN)]
    full = render_text(user + [{"role": "assistant", "content": _PROBE_ANSWER}], tokenizer)
    after = full[full.rindex(_PROBE_ANSWER) + len(_PROBE_ANSWER):]
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    eot = next((tok for tok in added if tok and after.startswith(tok)), None)
    if eot is None:
        eot = after.split("\n", 1)[0]
    if not eot:
        log.warning("chat template writes no end-of-turn marker after assistant turns: "
                    "the model will not learn to stop")
    layout = TemplateLayout(assistant_header=header, end_of_turn=eot)
    _LAYOUTS[key] = layout
    return layout


def _skip_ws(text: str, pos: int, end: int | None = None) -> int:
    end = len(text) if end is None else end
    while pos < end and text[pos] in _WS:
        pos += 1
    return pos


def _unverified(i: int, what: str) -> RowRejected:
    return RowRejected(DropReason.MASK_UNVERIFIED, f"messages[{i}]: {what}")


def _locate_turn(text: str, cursor: int, msg: Message, i: int, layout: TemplateLayout) -> TurnSpan:
    content = msg["content"].strip()
    if msg["role"] == "assistant":
        h = text.find(layout.assistant_header, cursor)
        if h < 0:
            raise _unverified(i, f"assistant header {layout.assistant_header!r} not found after char {cursor}")
        start = h + len(layout.assistant_header)
    else:  # other trained roles: the turn starts where its content starts
        if not content:
            raise _unverified(i, f"trained role {msg['role']!r} needs non-empty content")
        start = text.find(content, cursor)
        if start < 0:
            raise _unverified(i, "content not found in the render")
    pos, reasoning = start, None
    j = _skip_ws(text, pos)
    if text.startswith(layout.think_open, j):
        inner_a = j + len(layout.think_open)
        k = text.find(layout.think_close, inner_a)
        if k < 0:
            raise _unverified(i, "think block opened but not closed in the render")
        expected = (msg.get("reasoning_content") or "").strip()
        if text[inner_a:k].strip() != expected:
            raise _unverified(i, "rendered reasoning differs from the message's reasoning_content")
        if expected:
            ra = text.index(expected, inner_a, k)
            reasoning = (ra, ra + len(expected))
        pos = k + len(layout.think_close)
    body_start = _skip_ws(text, pos)
    if content:
        if not text.startswith(content, body_start):
            raise _unverified(i, "content does not follow the header/think block in the render")
        pos = body_start + len(content)
    calls = msg.get("tool_calls") or []
    eot = layout.end_of_turn
    if not eot:
        if calls:
            raise _unverified(i, "tool calls cannot be bounded: the template writes no end-of-turn marker")
        return TurnSpan(i, start, pos, body_start, reasoning, None)
    for call in calls:
        args = call["function"].get("arguments")
        if eot in (args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)):
            raise _unverified(i, "tool call arguments contain the end-of-turn marker")
    e = text.find(eot, pos)
    if e < 0:
        raise _unverified(i, f"end-of-turn marker {eot!r} not found")
    between = text[pos:e]
    if calls:
        at = 0
        for call in calls:
            at = between.find(call["function"]["name"], at)
            if at < 0:
                raise _unverified(i, f"tool call {call['function']['name']!r} not rendered")
    elif between.strip(_WS):
        raise _unverified(i, "unexpected text between content and end-of-turn marker")
    return TurnSpan(i, start, e + len(eot), body_start, reasoning, e)


def _trained_spans(turn: TurnSpan, think_loss: str, *, with_eot: bool = True) -> list[tuple[int, int]]:
    if think_loss == "all" or turn.body_start == turn.start:
        spans = [(turn.start, turn.end)]
    elif think_loss == "answer_only":
        spans = [(turn.body_start, turn.end)]
    else:  # answer_plus_think: reasoning text, then the answer; the tags stay masked
        spans = ([turn.reasoning] if turn.reasoning else []) + [(turn.body_start, turn.end)]
    if not with_eot and turn.eot_start is not None:
        a, _ = spans[-1]
        spans = spans[:-1] + ([(a, turn.eot_start)] if turn.eot_start > a else [])
    return spans


def _eot_after(text: str, cursor: int, nxt: Message | None, layout: TemplateLayout) -> tuple[int, int] | None:
    """The end-of-turn marker closing a message whose content ends at ``cursor``, if the template wrote one
    before the next message (``train_on_eos: all``)."""
    if not layout.end_of_turn:
        return None
    e = text.find(layout.end_of_turn, cursor)
    if e < 0:
        return None
    between = text[cursor:e]
    if layout.assistant_header in between or (nxt is not None and nxt["content"].strip()
                                              and nxt["content"].strip() in between):
        return None  # the marker belongs to a later message (e.g. a system prompt folded into a user turn)
    return e, e + len(layout.end_of_turn)


def _check_spans(text: str, spans: list[tuple[int, int]]) -> None:
    """The trained spans are in order, disjoint and inside the text."""
    at = 0
    for a, b in spans:
        if not at <= a <= b <= len(text):
            raise RowRejected(DropReason.MASK_UNVERIFIED, f"trained spans overlap or leave the text at {a}:{b}")
        at = b


def is_trained(msg: Message, assistant_roles) -> bool:
    """A message is trained when it says so (``train``), else when its role is in ``assistant_roles``."""
    return msg.get("train", msg["role"] in assistant_roles)


def render_conversation(
    messages: list[Message],
    tokenizer,
    *,
    tools: list[dict] | None = None,
    assistant_roles=("assistant",),
    think_loss: str = "all",
    train_on_eos: str = "turn",
) -> RenderedConversation:
    """Messages -> one render with a verified per-character training mask.

    ``train_on_eos``: which end-of-turn markers are trained: those of trained
    turns (``turn``), also those closing every other message (``all``), only
    the last trained turn's (``last``), or none (``none``).
    """
    layout = template_layout(tokenizer)
    try:
        text = render_text(messages, tokenizer, tools=tools)
    except Exception as exc:  # jinja raise_exception, undefined fields, type errors: a row-level reason
        raise RowRejected(DropReason.TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}") from None
    mask = np.zeros(len(text), dtype=np.uint8)
    ends, turns, spans, cursor = [], [], [], 0
    trained = [is_trained(msg, assistant_roles) for msg in messages]
    last_trained = max((i for i, t in enumerate(trained) if t), default=-1)
    for i, msg in enumerate(messages):
        if trained[i]:
            turn = _locate_turn(text, cursor, msg, i, layout)
            turns.append(turn)
            with_eot = train_on_eos in ("turn", "all") or (train_on_eos == "last" and i == last_trained)
            spans += _trained_spans(turn, think_loss, with_eot=with_eot)
            cursor = turn.end
        else:
            if layout.assistant_header in msg["content"]:
                raise _unverified(i, f"{msg['role']} content contains the assistant header text")
            located = None
            if msg["role"] == "assistant":  # an untrained assistant turn: walk past its header and tool calls too
                try:
                    located = _locate_turn(text, cursor, msg, i, layout)
                except RowRejected:
                    located = None
            content = msg["content"].strip()
            if located is not None:
                cursor = located.end
                if train_on_eos == "all" and located.eot_start is not None:
                    spans.append((located.eot_start, located.end))
            elif content:
                p = text.find(content, cursor)
                if p < 0:
                    raise _unverified(i, f"{msg['role']} content not found in the render")
                cursor = p + len(content)
                if train_on_eos == "all":
                    eot = _eot_after(text, cursor, messages[i + 1] if i + 1 < len(messages) else None, layout)
                    if eot is not None:
                        spans.append(eot)
                        cursor = eot[1]
        ends.append(cursor)
    _check_spans(text, spans)
    for a, b in spans:
        mask[a:b] = 1
    return RenderedConversation(text, mask, tuple(ends), tuple(turns))


def build_text_and_masks(
    messages: list[Message],
    tokenizer,
    *,
    tools: list[dict] | None = None,
    assistant_roles=("assistant",),
    think_loss: str = "all",
    train_on_eos: str = "turn",
) -> tuple[str, np.ndarray]:
    """Messages -> ``(text, char_mask)``: the template's render and a 0/1 entry per character.

    Trained (1): for each trained message (``is_trained``: its ``train`` flag,
    else its role in ``assistant_roles``), its reasoning block (per
    ``think_loss``), content, tool calls and end-of-turn marker (per
    ``train_on_eos``). Everything else is 0. Raises ``RowRejected`` when the
    template fails or the spans cannot be verified.
    """
    r = render_conversation(messages, tokenizer, tools=tools, assistant_roles=assistant_roles,
                            think_loss=think_loss, train_on_eos=train_on_eos)
    return r.text, r.char_mask
