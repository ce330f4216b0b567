"""What both paths of stage 2 make and share: a render of the conversation with its verified character mask
(``RenderedConversation``, one ``TurnSpan`` per trained turn), the text they mask (``render_text``: the template's
own render of the messages as it reads them) and the spans a turn trains (``trained_spans``, checked by
``check_spans``). ``render`` (the fast path) and ``prefix`` (the general path) both build on it.

    >>> spans = trained_spans(TurnSpan(index=1, start=10, end=30, body_start=20, reasoning=(12, 17)), "answer_only")
    >>> spans, trained_spans(TurnSpan(1, 10, 30, 20, (12, 17)), "answer_plus_think")
    ([(20, 30)], [(12, 17), (20, 30)])
"""

from __future__ import annotations

import json
from typing import NamedTuple

import numpy as np

from qlora_train.masking.apply_template import apply_template
from qlora_train.masking.layout import TemplateLayout
from qlora_train.masking.layout_declaration import template_layout
from qlora_train.masking.messages import WHITESPACE, DropReason, Message, RowRejected, template_content


class TurnSpan(NamedTuple):
    """Character spans of one trained message in the rendered text."""

    index: int
    start: int  # first generated character (after the prompt side: header, [/INST], ...)
    end: int  # one past the end marker
    body_start: int  # first character after the reasoning block (== start without one)
    reasoning: tuple[int, int] | None  # rendered reasoning text, when rendered
    eot_start: int | None = None  # where the end marker starts (None: the template writes none)
    reasoning_dropped: bool = False  # the message has reasoning the template did not render


class ImageRuns(NamedTuple):
    """Where a render holds images' tokens (``images.expand_images``): the image token, its id, and every run of
    image tokens as (its first character, its length in tokens): one an image, or an image's several where its
    expansion puts markers between them (``ImageRule.expansion_of``: Pixtral's rows). ``tokenize.encode_rendered``
    tokenizes the text with each run as one token and repeats its id: an added token is matched whole before
    anything around it is tokenized, so that is the whole text's tokenization (tested against it), with no
    per-token work for an image."""

    token: str
    token_id: int
    runs: tuple[tuple[int, int], ...]


class RenderedConversation(NamedTuple):
    text: str
    char_mask: np.ndarray  # uint8, one entry per character of text
    message_ends: tuple[int, ...]  # char offset where each message's rendered part ends
    turns: tuple[TurnSpan, ...]
    unrendered: tuple[str, ...] = ()  # roles of untrained messages the template does not write
    verified_by: str = "layout"  # or "prefix_renders": the rule applied with per-turn prefix renders (prefix.py)
    renders: int = 1  # chat-template renders this result cost
    images: ImageRuns | None = None  # a vision-language model's render: its images' tokens (``images.expand_images``)
    extra_cuts: tuple[int, ...] = ()  # more places the text is cut (a preference pair's shared prompt end, ``pair``)

    @property
    def cuts(self) -> tuple[int, ...]:
        """Where the text is cut before it is tokenized (``tokenize.encode_rendered``): where each trained turn's
        generated part begins, so that its first token starts there, as it does at inference after the prompt
        tokenized alone; and where a turn's trained text resumes after a masked reasoning block (``think_loss:
        answer_only``: the answer's first word is trained whatever the block's last characters are). A cut at 0 or
        at the end of the text is no cut."""
        out, mask, n = list(self.extra_cuts), self.char_mask, len(self.text)
        for t in self.turns:
            out.append(t.start)
            for at in (t.reasoning[0] if t.reasoning else t.start, t.body_start):
                if t.start < at < n and mask[at] and not mask[at - 1]:
                    out.append(at)
        return tuple(out)


def template_messages(messages: list[Message], layout: TemplateLayout, *, parts: bool = True) -> list[Message]:
    """Messages as the template reads them: reasoning under the key it reads (``reasoning`` for some), tool
    call arguments as a JSON string for templates that write them as given (DeepSeek), content with images as
    content parts (``template_content``; ``parts=False``: left to the caller, who reads the content as text)."""
    key = layout.reasoning_key
    rename = key is not None and key != "reasoning_content"
    with_parts = parts and any("images" in m for m in messages)
    if not rename and not layout.tool_arguments_as_string and not with_parts:
        return messages
    out = []
    for m in messages:
        if with_parts:
            m = template_content(m)
        if rename and "reasoning_content" in m:
            m = {k: v for k, v in m.items() if k != "reasoning_content"} | {key: m["reasoning_content"]}
        if layout.tool_arguments_as_string and m.get("tool_calls"):
            m = {**m, "tool_calls": [_string_arguments(c) for c in m["tool_calls"]]}
        out.append(m)
    return out


def _string_arguments(call: dict) -> dict:
    args = call["function"].get("arguments")
    if isinstance(args, str):
        return call
    return {**call, "function": {**call["function"], "arguments": json.dumps(args, ensure_ascii=False)}}


def render_text(messages: list[Message], tokenizer, *, tools=None, add_generation_prompt=False,
                layout: TemplateLayout | None = None) -> str:
    """Exactly ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)`` (reasoning under the
    key the template reads; ``layout``: the tokenizer's ``template_layout``, when the caller has it)."""
    layout = template_layout(tokenizer) if layout is None else layout
    return apply_template(template_messages(messages, layout), tokenizer, tools=tools,
                          add_generation_prompt=add_generation_prompt)


def answer_start(text: str, at: int, content: str, layout: TemplateLayout, limit: int | None = None) -> int:
    """Where a turn's answer starts after its reasoning block closes at ``at``: past the separator the template
    writes there (``layout.think_separator``) and other whitespace before the content, but at the content's own
    leading whitespace where the render keeps it: the model writes ``"  hi"``'s spaces, not Qwen3's ``\n\n``.

    >>> layout = template_layout(tok)  # Qwen3: its separator is '\\n\\n'
    >>> answer_start("</think>\\n\\n  hi", 8, "  hi", layout), answer_start("</think>\\n\\nhi", 8, "\\n\\nhi", layout)
    (10, 10)
    """
    limit = len(text) if limit is None else limit
    sep = layout.think_separator
    j = at + len(sep) if sep and text.startswith(sep, at) else at
    c = j
    while c < limit and text[c] in WHITESPACE:
        c += 1
    body = content.strip(WHITESPACE)
    if not body or not text.startswith(body, c):
        return j  # the content is not next (an answer marker, calls: '\n<call>'): the answer starts after the separator
    lead = content[: len(content) - len(content.lstrip(WHITESPACE))]
    k = c
    while k > j and c - k < len(lead) and text[k - 1] == lead[len(lead) - 1 - (c - k)]:
        k -= 1
    return k


def trained_spans(turn: TurnSpan, think_loss: str, *, with_eot: bool = True) -> list[tuple[int, int]]:
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


def check_spans(text: str, spans: list[tuple[int, int]]) -> None:
    """The trained spans are in order, disjoint and inside the text."""
    at = 0
    for a, b in spans:
        if not at <= a <= b <= len(text):
            raise RowRejected(DropReason.MASK_UNVERIFIED, f"trained spans overlap or leave the text at {a}:{b}")
        at = b
