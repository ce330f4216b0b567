"""Stage 2, the general path: the masking rule applied directly, with per-turn prefix renders.

The rule (docs/masking.md): what the model must learn for assistant turn ``i`` is what it generates at
inference after ``render(messages[:i], add_generation_prompt=True)``: everything that render writes (the header
and whatever the generation prompt adds after it, a pre-filled empty reasoning block or an opener) is prompt. The
generated part is the rest of ``render(messages[:i+1])`` (where it writes only part of the generation prompt's
text, from where they part, out of a marker they part inside), through its end-of-turn marker (or the one the
whole render writes right after it, where a template writes it only when another turn follows), less whitespace
after the last marker and less the text the template appends after every render (``TemplateLayout.trailer``).

``render.render_conversation`` applies that rule the fast way, with the probed
layout and one render. Rows it cannot verify come here: two renders per trained
turn (four where the turn does not write all of its generation prompt's text), used for
layouts the probe cannot describe, markers a probe could not find, and a
declared layout that does not fit a row. A turn verifies when

- the whole conversation's render starts with ``render(messages[:i+1])`` up to
  the turn's end (the template is prefix-stable on it);
- its generated part holds, in order, the message's reasoning (or the template
  dropped it: counted), its content and each tool call's name;
- no earlier message's text that the prompt did not show is inside it (a tool
  result the template writes into the assistant's block is not trained).

    >>> r = render_by_prefixes(LossPolicy().mark([{"role": "user", "content": "hi"},
    ...                                          {"role": "assistant", "content": "yo"}]), tok)
    >>> r.verified_by, "".join(c for c, m in zip(r.text, r.char_mask) if m)
    ('prefix_renders', '<think>\\n\\n</think>\\n\\nyo<|im_end|>')
"""

from __future__ import annotations

import json

import numpy as np

from qlora_train.masking.apply_template import apply_template
from qlora_train.masking.layout import TEMPLATE_ERRORS, TemplateLayout, prompt_written
from qlora_train.masking.layout_declaration import template_layout
from qlora_train.masking.messages import WHITESPACE, DropReason, Message, RowRejected, argument_values, template_content
from qlora_train.masking.policy import DEFAULT_POLICY, LossPolicy, is_trained
from qlora_train.masking.rendered import (
    RenderedConversation,
    TurnSpan,
    answer_start,
    check_spans,
    render_text,
    template_messages,
    trained_spans,
)
from qlora_train.masking.row_text import check_row_text, row_text_markers

_SHIFT = "\x01"  # put before a turn's own texts to see where they start in a render (never trimmed by templates)


def _unverified(i: int, what: str) -> RowRejected:
    return RowRejected(DropReason.MASK_UNVERIFIED, f"messages[{i}]: {what}")


def common_prefix_length(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share from their start (``len(os.path.commonprefix([a, b]))``, which
    compares them a character at a time in Python: a second on two 100 KB renders). Compared in halves, in C."""
    n = min(len(a), len(b))
    if a.startswith(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


_common_prefix = common_prefix_length


class PrefixRenderer:
    """Renders of a conversation's prefixes, each made once (``render(k, gen)``: messages[:k]; kept, so that
    another look at the same prefix costs nothing)."""

    def __init__(self, messages: list[Message], tokenizer, tools, layout: TemplateLayout):
        self.messages = template_messages(messages, layout, parts=False)  # content as text: read by the rule
        self.tokenizer, self.tools = tokenizer, tools
        self.count = 0  # renders made (the path's cost)
        self._made: dict[tuple[int, bool], str] = {}

    def render(self, k: int, gen: bool, last: Message | None = None) -> str:
        if last is None and (k, gen) in self._made:
            return self._made[k, gen]
        text = self._render(k, gen, last)
        if last is None:
            self._made[k, gen] = text
        return text

    def _render(self, k: int, gen: bool, last: Message | None) -> str:
        msgs = self.messages[:k] if last is None else [*self.messages[:k], last]
        msgs = [template_content(m) for m in msgs]
        self.count += 1
        try:
            return apply_template(msgs, self.tokenizer, tools=self.tools, add_generation_prompt=gen)
        except TEMPLATE_ERRORS as exc:
            raise RowRejected(DropReason.TEMPLATE_ERROR, f"rendering messages[:{len(msgs)}]: "
                              f"{type(exc).__name__}: {exc}") from None


def _shifted(msg: Message) -> Message:
    """The message with ``_SHIFT`` before its content and reasoning: where a render starts writing them."""
    out = {**msg, "content": _SHIFT + msg["content"]}
    for key in ("reasoning_content", "thinking", "reasoning"):
        if msg.get(key):
            out[key] = _SHIFT + msg[key]
    return out


def generated_part(renders: PrefixRenderer, i: int, layout: TemplateLayout) -> tuple[str, int, int]:
    """``(q, start, end)``: ``q = render(messages[:i+1])`` and the span of turn ``i``'s generated part in it: from
    where its generation prompt's render ends (everything that render writes is prompt), through its end."""
    prompt = renders.render(i, True)
    q = renders.render(i + 1, False)
    start = _common_prefix(prompt, q)
    if start < len(prompt):  # the turn does not write all its prompt's text: where they part
        own = _common_prefix(renders.render(i, False), prompt)  # where the generation prompt's own text starts
        alt = renders.render(i, False, _shifted(renders.messages[i]))
        first = _common_prefix(q, alt)  # where the turn's own texts start: the prompt never reaches into them
        if start >= own:  # it writes the start of the generation prompt's text (an empty block pre-filled where the
            # turn has reasoning, reasoning dropped from history, a preamble no turn writes): not inside a marker
            start = own + prompt_written(q, own, prompt[own:], renders.tokenizer)
        else:  # they part inside the conversation before the turn (a tool result written differently when last)
            start = _prompt_end_in_turn(q, prompt[own:], start, first, i, layout, renders.tokenizer)
        start = min(start, first)
    end = len(q)
    if layout.trailer and q.endswith(layout.trailer) and end - len(layout.trailer) >= start:
        end -= len(layout.trailer)
    limit = end
    while end > start and q[end - 1] in WHITESPACE:
        end -= 1
    # an end marker that is whitespace itself ('\n' ends each turn of a plain-text template) is not a separator
    # where the part has no other end marker
    marker = "" if _end_marker_at(q, start, end, layout) is not None else next(
        (m for m in layout.end_markers if m and not m.strip(WHITESPACE) and q.startswith(m, end)
         and end + len(m) <= limit), "")
    return q, start, end + len(marker)


def _prompt_end_in_turn(q: str, written: str, parted: int, first: int, i: int, layout: TemplateLayout,
                        tokenizer) -> int:
    """Where turn ``i``'s prompt ends in ``q`` (its render) when ``q`` writes the conversation before it differently
    from the generation prompt's render (they part at ``parted``, before the prompt's own text ``written``): after
    that text where ``q`` writes it whole between the parting point and the turn's own texts (``first``); else after
    the last opener of the layout there, and as much of the prompt's tail as ``q`` writes after it; else refused:
    another message's text is never trained."""
    k = q.rfind(written, parted, first) if written else -1
    if k >= 0:
        return k + len(written)
    found = [(k, a) for a in layout.anchors if (k := q.rfind(a, parted, first)) >= 0]
    if not found:
        raise _unverified(i, f"the render through this turn writes the messages before it differently from its "
                          f"generation prompt (they part at char {parted}) and no turn opener marks where it starts")
    k, opener = max(found)
    at = k + len(opener)
    return at + prompt_written(q, at, layout.prompt_tail, tokenizer) if layout.prompt_tail else at


def _find_in(q: str, needle: str, a: int, b: int) -> tuple[int, int]:
    """Where ``needle`` is written in ``q[a:b]``, verbatim or JSON-escaped -> ``(start, end)`` ((-1, -1): not)."""
    for written in dict.fromkeys((needle, json.dumps(needle, ensure_ascii=False)[1:-1])):
        k = q.find(written, a, b)
        if k >= 0:
            return k, k + len(written)
    return -1, -1


def prefix_turn(renders: PrefixRenderer, text: str, i: int, layout: TemplateLayout, *, trained_before: list[bool]):
    """Turn ``i`` by the rule -> ``TurnSpan`` (in ``text``, the whole render), or ``RowRejected`` saying why."""
    msg = renders.messages[i]
    q, start, end = generated_part(renders, i, layout)
    if not text.startswith(q[:end]):
        k = _common_prefix(text, q)
        raise _unverified(i, f"the template is not prefix-stable on this row: the render of messages[:{i + 1}] "
                          f"and the whole conversation's render differ at char {k}")
    if end <= start:
        raise _unverified(i, "the template writes nothing for this assistant turn")
    expected = msg.get(layout.reasoning_key or "reasoning_content") or msg.get("reasoning_content") or ""
    expected = expected.strip(WHITESPACE)
    r = _find_in(q, expected, start, end) if expected else (-1, -1)
    try:
        reasoning, body_start, own = _own_parts(q, msg, i, start, end, r if r[0] >= 0 else None, layout)
    except RowRejected:
        if r[0] < 0:
            raise  # the reasoning's text found was the answer's own (the template dropped the reasoning)
        reasoning, body_start, own = _own_parts(q, msg, i, start, end, None, layout)
    dropped = bool(expected) and reasoning is None
    end = _through_end_marker(q, max((b for _, b in own), default=body_start), end, layout)
    for j in range(i):  # an earlier message the prompt does not show, written in this turn outside its own texts
        other = renders.messages[j]
        c = other["content"].strip(WHITESPACE)
        # (looked for in the turn's part first: the prompt is the whole conversation before it, and searching it
        # for each earlier message made a row of N exchanges cost N^3)
        if not trained_before[j] and c and _outside(q, c, start, end, own) and q.find(c, 0, start) < 0:
            raise _unverified(i, f"messages[{j}] ({other['role']}) is written inside this turn's generated part "
                              "(the prompt does not show it): it would be trained")
    if _end_marker_at(q, start, end, layout) is None:  # an end marker written only where another turn follows
        end = _end_marker_after(text, end, layout)
    eot = _end_marker_at(text, start, end, layout)
    return TurnSpan(i, start, end, body_start, reasoning, eot, dropped)


def _find_content(q: str, content: str, a: int, b: int, layout: TemplateLayout) -> tuple[int, int]:
    """A turn's content without calls: the occurrence only its end marker (or nothing) follows, else the last
    (a short answer is also inside template text: 'A' in '[ANSWER]')."""
    found = (-1, -1)
    while True:
        k, k_end = _find_in(q, content, a, b)
        if k < 0:
            return found
        found = (k, k_end)
        tail = q[k_end:b].strip(WHITESPACE)
        if not tail or tail in layout.end_markers:
            return found
        a = k + 1


def _outside(q: str, needle: str, a: int, b: int, own: list[tuple[int, int]]) -> bool:
    """Whether ``needle`` is written in ``q[a:b]`` somewhere not inside one of the ``own`` spans."""
    while True:
        k, k_end = _find_in(q, needle, a, b)
        if k < 0:
            return False
        if not any(x <= k and k_end <= y for x, y in own):
            return True
        a = k + 1


def _own_parts(q: str, msg: Message, i: int, start: int, end: int, reasoning: tuple[int, int] | None,
               layout: TemplateLayout) -> tuple[tuple[int, int] | None, int, list[tuple[int, int]]]:
    """The turn's content and each call's name (its argument values after it), in order after its reasoning ->
    ``(reasoning, body_start, own spans)``: the own spans run from the reasoning (or content) to the end of the
    last call's name (or of the content, where the template writes the calls first: DeepSeek R1's distills)."""
    at = reasoning[1] if reasoning else start
    content = msg["content"].strip(WHITESPACE)
    try:
        own, at = _content(q, msg, i, at, end, layout, calls_after=True)
        names, at = _calls(q, msg, i, at, end)
        own += names
    except RowRejected as rej:
        if not (content and msg.get("tool_calls")):
            raise
        try:  # the calls written before the content
            own, at = _calls(q, msg, i, reasoning[1] if reasoning else start, end)
            written, at = _content(q, msg, i, at, end, layout, calls_after=False)
            own += written
        except RowRejected:
            raise rej from None
    spans = ([reasoning] if reasoning else []) + ([(own[0], at)] if own else [])
    if not reasoning:
        return None, _after_empty_block(q, start, own[0] if own else end, msg, layout), spans
    # the answer starts after the reasoning block's close (when the layout knows it), else where its text does
    close = q.find(layout.think_close, reasoning[1], own[0] if own else end) if layout.think_close else -1
    if close < 0:
        return reasoning, own[0] if own else reasoning[1], spans
    return reasoning, answer_start(q, close + len(layout.think_close), msg["content"], layout, end), spans


def _after_empty_block(q: str, start: int, limit: int, msg: Message, layout: TemplateLayout) -> int:
    """Where the answer starts in a turn without reasoning: after an empty reasoning block the template writes at
    the turn's start (Qwen3's ``<think>\n\n</think>\n\n``, or its close alone where the generation prompt opened
    it: Qwen3.5's ``\n</think>\n\n`` after ``<think>\n``), as the fast path reads it, so ``think_loss:
    answer_only`` masks it on both paths; else ``start``."""
    if not (layout.think_open and layout.think_close):
        return start
    j = start
    while j < limit and q[j] in WHITESPACE:
        j += 1
    if q.startswith(layout.think_open, j):
        k = q.find(layout.think_close, j + len(layout.think_open), limit)
        if k < 0 or q[j + len(layout.think_open):k].strip(WHITESPACE):
            return start
    elif q.startswith(layout.think_close, j):
        k = j
    else:
        return start
    return answer_start(q, k + len(layout.think_close), msg["content"], layout, limit)


def _content(q: str, msg: Message, i: int, at: int, end: int, layout: TemplateLayout, *, calls_after: bool
             ) -> tuple[list[int], int]:
    """Where the turn's content is written in ``q[at:end]`` -> ``([its start] or [], where it ends)``."""
    content = msg["content"].strip(WHITESPACE)
    if not content:
        return [], at
    c, c_end = _find_content(q, content, at, end, layout) if not (calls_after and msg.get("tool_calls")) else (
        _find_in(q, content, at, end))
    if c < 0:
        raise _unverified(i, "content not found in the turn's generated part (the template changes it)")
    return [c], c_end


def _calls(q: str, msg: Message, i: int, at: int, end: int) -> tuple[list[int], int]:
    """Where each call's name is written in ``q[at:end]``, in order, its argument values after it -> ``(the
    names' starts, the end of the last call's name and values)``: an end marker inside a value is the call's text,
    not the turn's end."""
    own, last = [], at
    for call in msg.get("tool_calls") or []:
        name = call["function"]["name"]
        k = q.find(name, at, end)
        if k < 0:
            raise _unverified(i, f"tool call {name!r} not written in its turn (the template writes fewer calls)")
        own.append(k)
        at = last = k + len(name)
        for value in argument_values(call):
            v, v_end = _find_in(q, value, at, end)
            if v < 0:
                raise _unverified(i, f"tool call {name!r}: argument {value!r} not written in its turn")
            last = max(last, v_end)
    return own, last


def _through_end_marker(q: str, own_end: int, end: int, layout: TemplateLayout) -> int:
    """The part's end: the end of the first known end marker after the turn's own texts, where the render writes
    more after it (Phi-3's eos, written only where the conversation ends: never generated, so never trained);
    else ``end``."""
    found = [(k, k + len(m)) for m in layout.end_markers if m and (k := q.find(m, own_end, end)) >= 0]
    if not found:
        return end
    cut = min(found)[1]
    return cut if q[cut:end].strip(WHITESPACE) else end


def _end_marker_at(q: str, at: int, end: int, layout: TemplateLayout) -> int | None:
    """Where a known end marker closing the part starts (the part ends with it), else None."""
    for m in layout.end_markers:
        if m and q.endswith(m, at, end):
            return end - len(m)
    return None


def _end_marker_after(text: str, end: int, layout: TemplateLayout) -> int:
    """The end of a known end marker the whole render writes right after ``end`` (whitespace between), else
    ``end``: the turn's own marker, written only where another turn follows."""
    at = end
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    for m in layout.end_markers:
        if m and text.startswith(m, at):
            return at + len(m)
    return end


def render_by_prefixes(messages: list[Message], tokenizer, *, tools=None, policy: LossPolicy = DEFAULT_POLICY,
                       text: str | None = None, renders: PrefixRenderer | None = None):
    """Marked messages -> ``RenderedConversation`` by the rule itself (see the module doc); ``text`` is the whole
    render when the caller has it, ``renders`` the prefix renders of ``messages`` made so far (``check`` looks at
    them again). Raises ``RowRejected`` naming the turn that does not verify."""
    layout = template_layout(tokenizer)
    check_row_text(messages, tools, row_text_markers(tokenizer, layout))  # also where called on its own
    if text is None:
        try:
            text = render_text(messages, tokenizer, tools=tools)
        except TEMPLATE_ERRORS as exc:
            raise RowRejected(DropReason.TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}") from None
    renders = PrefixRenderer(messages, tokenizer, tools, layout) if renders is None else renders
    trained = [is_trained(m, i) for i, m in enumerate(messages)]
    last_trained = max((i for i, t in enumerate(trained) if t), default=-1)
    turns, spans, ends, cursor = [], [], [], 0
    for i, msg in enumerate(messages):
        if trained[i]:
            if msg["role"] != "assistant":
                raise _unverified(i, f"a trained {msg['role']!r} message is verified by the layout only")
            turn = prefix_turn(renders, text, i, layout, trained_before=trained)
            turns.append(turn)
            spans += trained_spans(turn, policy.think_loss, with_eot=policy.trains_eot(i, last_trained))
            cursor = turn.end
        elif msg["content"].strip(WHITESPACE):  # an untrained message ends where its text is written, when it is
            k, k_end = _find_in(text, msg["content"].strip(WHITESPACE), cursor, len(text))
            cursor = k_end if k >= 0 else cursor
        ends.append(cursor)
    check_spans(text, spans)
    mask = np.zeros(len(text), dtype=np.uint8)
    for a, b in spans:
        mask[a:b] = 1
    return RenderedConversation(text, mask, tuple(ends), tuple(turns), (), "prefix_renders", renders.count)
