"""Stage 2: render the whole conversation ONCE and mark, per character, what is trained.

    >>> text, mask = build_text_and_masks(
    ...     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tok)
    >>> text  # Qwen3 writes an empty reasoning block in the last assistant turn
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\nyo<|im_end|>\\n'
    >>> "".join(c for c, m in zip(text, mask) if m)
    '<think>\\n\\n</think>\\n\\nyo<|im_end|>'

How spans are found (no prefix re-rendering, no guessed masks):

1. ``layout_declaration.template_layout`` probes the template once (cached): what opens a
   turn's generated part (the generation prompt's header, or the prompt-side
   text after a user / tool message for templates without one), the reasoning
   block's delimiters and key, an answer marker, and the end markers.
2. The real conversation is rendered once. Walking its messages in order, each
   trained turn is the first opener after the previous turn, then an optional
   reasoning block whose inside must equal the message's ``reasoning_content``
   (or be empty: the template dropped it, which is counted), an optional answer
   marker, the message's content (exactly, up to surrounding whitespace), its
   tool calls (every function name, in order) and the first end marker.
   Untrained messages are located where the template writes them verbatim (or
   JSON-escaped) before the next opener; content the template transforms or
   omits is not needed to bound a trained turn, and must not contain an opener.
3. Anything that does not check out refuses the row (``RowRejected``) instead
   of training it with a guessed mask.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from qlora_train.masking.layout import TEMPLATE_ERRORS, TemplateLayout, prompt_written, role_is_rendered
from qlora_train.masking.layout_declaration import template_layout
from qlora_train.masking.messages import (
    KNOWN_ROLES,
    WHITESPACE,
    DropReason,
    Message,
    RowRejected,
    argument_keys,
    argument_values,
)
from qlora_train.masking.policy import DEFAULT_POLICY, LossPolicy, is_trained
from qlora_train.masking.prefix import render_by_prefixes
from qlora_train.masking.rendered import (
    RenderedConversation,
    TurnSpan,
    answer_start,
    check_spans,
    render_text,
    trained_spans,
)
from qlora_train.masking.row_text import check_row_text, row_text_markers

log = logging.getLogger(__name__)


def _skip_ws(text: str, pos: int) -> int:
    end = len(text)
    while pos < end and text[pos] in WHITESPACE:
        pos += 1
    return pos


def _unverified(i: int, what: str) -> RowRejected:
    return RowRejected(DropReason.MASK_UNVERIFIED, f"messages[{i}]: {what}")


def _first_of(text: str, needles, start: int) -> tuple[int, str]:
    """Earliest occurrence of any needle in ``text[start:]`` (the longest on a tie) -> (position, needle)."""
    if len(needles) == 1:
        return text.find(needles[0], start), needles[0]
    best, found = -1, ""
    for n in needles:
        k = text.find(n, start)
        if k >= 0 and (best < 0 or k < best or (k == best and len(n) > len(found))):
            best, found = k, n
    return best, found


_MAX_OPENERS_TRIED = 8


def _locate_turn(text: str, cursor: int, msg: Message, i: int, layout: TemplateLayout, prompt: str = "",
                 tokenizer=None) -> TurnSpan:
    """The turn of ``messages[i]``: for an assistant, after the first opener (of the next few after ``cursor``)
    from which its generated part verifies, and after as much of ``prompt`` (the generation prompt's text after the
    header) as it writes there; other trained roles start where their content does."""
    if msg["role"] != "assistant":
        content = msg["content"].strip(WHITESPACE)
        if not content:
            raise _unverified(i, f"trained role {msg['role']!r} needs non-empty content")
        start = text.find(content, cursor)
        if start < 0:
            raise _unverified(i, "content not found in the render")
        return _parse_turn(text, start, msg, i, layout)
    first_error = None
    at = cursor
    for _ in range(_MAX_OPENERS_TRIED):
        h, opener = _first_of(text, layout.anchors, at)
        if h < 0:
            break
        try:
            return _parse_turn(text, h + len(opener), msg, i, layout, prompt, tokenizer)
        except RowRejected as rej:  # an opener the template also writes elsewhere (after each tool output)
            first_error = first_error or rej
            at = h + 1
    raise first_error or _unverified(i, f"no assistant turn opener {list(layout.anchors)} after char {cursor}")


def _parse_turn(text: str, start: int, msg: Message, i: int, layout: TemplateLayout, prompt: str = "",
                tokenizer=None) -> TurnSpan:
    """The turn after its header at ``start``: [reasoning block] [answer marker | lead] content, tool calls and
    the end marker, each checked against the message; its generated part starts after as much of ``prompt`` (what
    the generation prompt writes after the header) as the turn writes there, never inside its own texts."""
    turn = _parse_parts(text, start, msg, i, layout)
    if not prompt:
        return turn
    own = turn.reasoning[0] if turn.reasoning else _first_own(text, turn.body_start, msg, turn.end)
    begin = min(start + prompt_written(text, start, prompt, tokenizer), own)
    return turn._replace(start=begin, body_start=max(turn.body_start, begin))


def _first_own(text: str, at: int, msg: Message, end: int) -> int:
    """Where a turn's own text first shows after ``at``: its content, else its first call's name, else its end."""
    content = msg["content"].strip(WHITESPACE)
    for part in ([content] if content else []) + [c["function"]["name"] for c in msg.get("tool_calls") or []]:
        k = text.find(part, at, end)
        if k >= 0:
            return k
    return end


def _parse_parts(text: str, start: int, msg: Message, i: int, layout: TemplateLayout) -> TurnSpan:
    """``_parse_turn``'s walk from the header's end."""
    content = msg["content"].strip(WHITESPACE)
    pos, body_start, reasoning = start, start, None
    expected = (msg.get("reasoning_content") or "").strip(WHITESPACE)
    dropped = bool(expected)
    j = _skip_ws(text, pos)
    if layout.think_open and layout.think_close and text.startswith(layout.think_open, j):
        inner_a = j + len(layout.think_open)
        k = text.find(layout.think_close, inner_a)
        if k < 0 and (not expected or layout.reasoning_key is None) and content and text.startswith(
                content, _skip_ws(text, inner_a)):
            pos = inner_a  # a block the generation prompt opens and the answer never closes: text before it
        elif k < 0:
            raise _unverified(i, "reasoning block opened but not closed in the render")
        else:
            inner = text[inner_a:k].strip(WHITESPACE)
            if inner == expected:
                dropped = False
                if expected:
                    ra = text.index(expected, inner_a, k)
                    reasoning = (ra, ra + len(expected))
            elif inner:
                raise _unverified(i, "rendered reasoning differs from the message's reasoning_content")
            pos = k + len(layout.think_close)
            body_start = answer_start(text, pos, msg["content"], layout)
    elif not layout.think_open and layout.think_close and expected and text.startswith(expected, j):
        k = _skip_ws(text, j + len(expected))  # a block without an opener: the reasoning, then its close
        if text.startswith(layout.think_close, k):  # (``reasoning\n[[ANSWER]]\n``; issue 24's class C)
            dropped, reasoning = False, (j, j + len(expected))
            pos = k + len(layout.think_close)
            body_start = answer_start(text, pos, msg["content"], layout)
    elif layout.think_close and text.startswith(layout.think_close, j):
        pos = j + len(layout.think_close)  # the close of a block its generation prompt opened ('</think>answer')
        body_start = answer_start(text, pos, msg["content"], layout)
    if layout.before_content:
        j = _skip_ws(text, pos)
        for lead in layout.before_content:
            if text.startswith(lead, j):
                pos = j + len(lead)
                break
    if content:
        c = _skip_ws(text, pos)
        if not text.startswith(content, c):
            raise _unverified(i, "content does not follow the turn opener / reasoning block in the render")
        pos = c + len(content)
    calls = msg.get("tool_calls") or []
    markers = layout.end_markers
    if not markers:
        if calls:
            raise _unverified(i, "tool calls cannot be bounded: the template writes no end-of-turn marker")
        return TurnSpan(i, start, pos, body_start, reasoning, None, dropped)
    for call in calls:
        args = call["function"].get("arguments")
        written = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        if any(m in written for m in markers):
            raise _unverified(i, "tool call arguments contain the end-of-turn marker")
    e, marker = _first_of(text, markers, pos)
    if e < 0 and layout.last_turn_unmarked and not text[pos:].strip(WHITESPACE):
        return TurnSpan(i, start, pos, body_start, reasoning, None, dropped)  # the last turn: nothing closes it
    if e < 0:
        raise _unverified(i, f"end-of-turn marker {list(markers)} not found")
    between = text[pos:e]
    if between and any(a in between for a in layout.not_before_end):
        raise _unverified(i, "another turn opens before this turn's end-of-turn marker")
    if calls:
        at = 0
        for call in calls:
            name = call["function"]["name"]
            at = between.find(name, at)
            if at < 0:
                raise _unverified(i, f"tool call {name!r} not rendered (the template writes fewer calls)")
            at += len(name)
            # its values and their names after it: a turn that holds the name and values by chance (row text of
            # another message that is no turn) is not taken for the call
            missing = next((v for v in argument_values(call) if v not in between[at:]), None)
            if missing is not None:
                raise _unverified(i, f"tool call {name!r}: argument {missing!r} not written in its turn")
            missing = next((k for k in argument_keys(call) if k not in between[at:]), None)
            if missing is not None:
                raise _unverified(i, f"tool call {name!r}: argument name {missing!r} not written in its turn")
    elif between.strip(WHITESPACE):
        raise _unverified(i, "unexpected text between content and end-of-turn marker")
    return TurnSpan(i, start, e + len(marker), body_start, reasoning, e, dropped)


def _prompt_tail(messages: list[Message], i: int, tokenizer, tools, layout: TemplateLayout) -> str:
    """What the generation prompt writes after the header before turn ``i`` (prompt, never trained): the layout's
    ``prompt_tail``, or, where it depends on the conversation (``prompt_by_row``: a ``/no_think`` flag), what this
    turn's own generation prompt writes after the last opener in it."""
    if not layout.prompt_by_row:
        return layout.prompt_tail
    try:
        prompt = render_text(messages[:i], tokenizer, tools=tools, add_generation_prompt=True, layout=layout)
    except TEMPLATE_ERRORS as exc:
        raise _unverified(i, f"the generation prompt before this turn does not render ({type(exc).__name__})") from None
    k, opener = max(((prompt.rfind(a), a) for a in layout.anchors), default=(-1, ""))
    if k < 0:
        raise _unverified(i, "the generation prompt before this turn writes no opener the layout knows")
    return prompt[k + len(opener):]


def _eot_after(text: str, cursor: int, nxt: Message | None, layout: TemplateLayout) -> tuple[int, int] | None:
    """The end-of-turn marker closing a message whose content ends at ``cursor``, if the template wrote one
    before the next message (``train_on_eos: all``)."""
    if not layout.end_of_turn:
        return None
    e = text.find(layout.end_of_turn, cursor)
    if e < 0:
        return None
    between = text[cursor:e]
    if any(a in between for a in layout.anchors) or (nxt is not None and nxt["content"].strip()
                                                     and nxt["content"].strip() in between):
        return None  # the marker belongs to a later message (e.g. a system prompt folded into a user turn)
    return e, e + len(layout.end_of_turn)


def _find_untrained(text: str, content: str, cursor: int, limit: int) -> tuple[int, int] | None:
    """Where an untrained message's content is written, verbatim or JSON-escaped, before ``limit``."""
    p = text.find(content, cursor, limit)
    if p >= 0:
        return p, p + len(content)
    escaped = json.dumps(content, ensure_ascii=False)[1:-1]  # only when the verbatim text is not there
    p = text.find(escaped, cursor, limit) if escaped != content else -1
    return (p, p + len(escaped)) if p >= 0 else None


def _not_written(tokenizer, msg: Message, i: int) -> str | None:
    """An untrained message not found in the render: its role when the template never writes that role
    (counted); None when the template writes the role but transformed this content (not needed to bound
    trained turns). A role the project does not know and the template does not write refuses the row."""
    role = msg["role"]
    if role_is_rendered(tokenizer, role):
        return None
    if role not in KNOWN_ROLES:
        raise RowRejected(DropReason.UNRENDERED_ROLE, f"messages[{i}]: role {role!r} is not rendered by the chat "
                          f"template, so the model would never see it: map it in the config with data.roles: "
                          f"{{system: [{role}]}} or {{user: [{role}]}}")
    return role


def render_conversation(
    messages: list[Message],
    tokenizer,
    *,
    tools: list[dict] | None = None,
    policy: LossPolicy = DEFAULT_POLICY,
    layout: TemplateLayout | None = None,
) -> RenderedConversation:
    """Marked messages (each with its ``train`` flag) -> one render with a verified per-character training mask.

    Of ``policy`` only ``think_loss`` and ``train_on_eos`` are read: which end-of-turn markers are trained:
    those of trained turns (``turn``), also those closing every other message (``all``), only the last trained
    turn's (``last``), or none (``none``). Which messages are trained was decided when they were marked.
    ``layout``: the tokenizer's ``template_layout``, where the caller has it (a batch looks it up once).
    """
    layout = template_layout(tokenizer) if layout is None else layout
    check_row_text(messages, tools, row_text_markers(tokenizer, layout))  # before any span is looked for
    try:
        text = render_text(messages, tokenizer, tools=tools, layout=layout)
    except TEMPLATE_ERRORS as exc:  # jinja raise_exception, undefined fields, type errors: a row-level reason
        raise RowRejected(DropReason.TEMPLATE_ERROR, f"{type(exc).__name__}: {exc}") from None
    try:
        return _render_with_layout(messages, tokenizer, text, layout, policy, tools)
    except RowRejected as fast:
        if fast.reason != DropReason.MASK_UNVERIFIED:
            raise
        if layout.declared:  # the user's layout is a contract: a row it does not fit is refused, not re-derived
            raise RowRejected(fast.reason, f"{fast.detail} (by the declared model.template_layout)") from None
        try:
            return render_by_prefixes(messages, tokenizer, tools=tools, policy=policy, text=text)
        except RowRejected as slow:
            if slow.reason != DropReason.MASK_UNVERIFIED:
                raise
            detail = slow.detail if slow.detail == fast.detail else f"{slow.detail} (by the layout: {fast.detail})"
            raise RowRejected(slow.reason, detail) from None


def _render_with_layout(messages: list[Message], tokenizer, text: str, layout: TemplateLayout,
                        policy: LossPolicy, tools: list[dict] | None = None) -> RenderedConversation:
    """The fast path: the one render's spans found with the probed layout (see the module doc)."""
    mask = np.zeros(len(text), dtype=np.uint8)
    ends, turns, spans, unrendered, cursor = [], [], [], [], 0
    anchors = layout.anchors
    trained = [is_trained(msg, i) for i, msg in enumerate(messages)]
    train_on_eos = policy.train_on_eos
    last_trained = max((i for i, t in enumerate(trained) if t), default=-1)
    if not anchors and last_trained >= 0:
        raise _unverified(last_trained, "the layout knows no text that opens an assistant turn")
    for i, msg in enumerate(messages):
        if trained[i]:
            prompt = _prompt_tail(messages, i, tokenizer, tools, layout) if msg["role"] == "assistant" else ""
            turn = _locate_turn(text, cursor, msg, i, layout, prompt, tokenizer)
            turns.append(turn)
            spans += trained_spans(turn, policy.think_loss, with_eot=policy.trains_eot(i, last_trained))
            cursor = turn.end
            ends.append(cursor)
            continue
        content = msg["content"].strip(WHITESPACE)
        if (anchors[0] in msg["content"]) if len(anchors) == 1 else any(a in msg["content"] for a in anchors):
            raise _unverified(i, f"{msg['role']} content contains the assistant turn opener text")
        located = None
        if msg["role"] == "assistant":  # an untrained assistant turn: walk past its opener and tool calls too
            try:
                located = _locate_turn(text, cursor, msg, i, layout)
            except RowRejected:
                h, opener = _first_of(text, anchors, cursor)
                cursor = h + len(opener) if h >= 0 else cursor  # at least past its opener
        if located is not None:
            cursor = located.end
            if train_on_eos == "all" and located.eot_start is not None:
                spans.append((located.eot_start, located.end))
        elif content and msg["role"] != "assistant":
            limit, _ = _first_of(text, anchors, cursor)  # it is written before the next turn opens
            where = _find_untrained(text, content, cursor, limit if limit >= 0 else len(text))
            if where is None and msg["role"] != "system" and _find_untrained(text, content, cursor, len(text)):
                # (a system prompt may be moved after the turns: Mistral writes it into the last user turn)
                raise _unverified(i, f"{msg['role']} text is written after an assistant turn opener: the opener "
                                  "is not specific to assistant turns")
            if where is None:
                role = _not_written(tokenizer, msg, i)
                if role is not None:
                    unrendered.append(role)
            else:
                cursor = where[1]
                if train_on_eos == "all":
                    eot = _eot_after(text, cursor, messages[i + 1] if i + 1 < len(messages) else None, layout)
                    if eot is not None:
                        spans.append(eot)
                        cursor = eot[1]
        ends.append(cursor)
    check_spans(text, spans)
    for a, b in spans:
        mask[a:b] = 1
    return RenderedConversation(text, mask, tuple(ends), tuple(turns), tuple(unrendered))


def build_text_and_masks(
    messages: list[dict],
    tokenizer,
    *,
    tools: list[dict] | None = None,
    policy: LossPolicy = DEFAULT_POLICY,
) -> tuple[str, np.ndarray]:
    """Messages -> ``(text, char_mask)``: the template's render and a 0/1 entry per character.

    The messages are marked by ``policy`` first (``LossPolicy.mark``: a message's own ``train``, else the role
    rules, then ``last_turn_only``). Trained (1): for each trained message, its reasoning block (per
    ``think_loss``), content, tool calls and end-of-turn marker (per ``train_on_eos``). Everything else is 0.
    Raises ``RowRejected`` when the template fails or the spans cannot be verified.
    """
    r = render_conversation(policy.mark(messages), tokenizer, tools=tools, policy=policy)
    return r.text, r.char_mask
