"""What a chat template writes around an assistant turn, discovered by rendering a few probe conversations.

    >>> probe_layout(tok)              # Qwen3
    TemplateLayout(assistant_header='<|im_start|>assistant\\n', turn_openers=('<|im_start|>assistant\\n',),
                   end_markers=('<|im_end|>',), think_open='<think>', think_close='</think>',
                   think_separator='\\n\\n', answer_open='', reasoning_key='reasoning_content', leads=(),
                   turn_start='<|im_start|>', tool_arguments_as_string=False, last_turn_unmarked=False, trailer='',
                   prompt_tail='', prompt_by_row=False, layout_class='header_from_generation_prompt', unknown=(),
                   declared=())

The generated part of a turn is what the model writes after the prompt the
template gives it at inference. Three layout classes place that prompt's end
differently, and one rule finds it for all: the prompt of a probe turn is the
longest common prefix of ``render(conversation, add_generation_prompt=True)``
and ``render(conversation + [answer])``.

- a header from the generation prompt (ChatML, Llama 3, Gemma, harmony): what
  ``add_generation_prompt`` appends, written by every assistant turn itself;
- a header written at the end of the previous turn (Phi-3: ``<|assistant|>``
  closes each user turn, the generation prompt appends nothing);
- no header (Mistral / Llama 2 ``[INST]``: the answer follows ``[/INST]``).

For the last two the ``turn_openers`` are the prompt-side text after a user
(and, where the template has tools, a tool result) message. What the generation
prompt writes after the header (a reasoning opener ``<think>\n``, a pre-filled
empty block, a preamble) is its ``prompt_tail``: prompt, never trained (every
render's generation prompt is prompt); ``prompt_by_row`` says that text depends
on the conversation (a ``/no_think`` flag), so each turn's is rendered. Reasoning
delimiters, an answer marker written before the content (``<|START_RESPONSE|>``,
harmony's final channel), the message key the template reads reasoning from,
and the end markers (a turn may close with several: a response end then an
end-of-turn token; harmony ends with ``<|end|>``, ``<|return|>`` or ``<|call|>``)
are read off the same probes, never assumed. The layout rendering uses is
``layout_declaration.template_layout``: probed once per tokenizer and template
(cached), the parts ``model.template_layout`` declares laid over the probed ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from jinja2 import TemplateError

from qlora_train.masking.apply_template import call_template
from qlora_train.masking.messages import THINK_CLOSE, THINK_OPEN, WHITESPACE

log = logging.getLogger(__name__)

# what rendering a chat template raises for conversations it does not take (jinja's raise_exception and undefined
# fields, any other exception of its code as TemplateRaised (call_template), transformers' checks); anything
# else is a bug and stays loud
TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # keys templates read reasoning from
LAYOUT_CLASSES = (
    "header_from_generation_prompt",  # ChatML, Llama 3, Gemma, harmony: the generation prompt writes the header
    "header_in_user_turn",  # Phi-3, DeepSeek V3: the user turn ends with the assistant's header
    "no_header",  # Mistral, Llama 2: the answer follows [/INST]
    "header_after_every_render",  # Meta's first Llama 3 template: the header is appended after every render (a
    # trailer; a generation prompt may extend it with one more marker)
    "unknown",  # the probe found nothing that opens an answer: every row takes prefix renders
)
_USER, _USER2 = "qlora-train probe question", "qlora-train probe follow-up"
_ANSWER, _ANSWER2 = "qlora-train probe answer", "qlora-train probe reply"
_REASONING = "qlora-train probe reasoning"
_TOOL_RESULT, _ARG = "qlora-train probe result", "qlora-train probe value"
_SYSTEM = "qlora-train probe system"
_CALL_ID = "qlora0001"  # 9 alphanumerics: what Mistral templates require of tool call ids
# the tool schema every probe renders with tools (the calls it probes name "qlora_probe")
_PROBE_TOOL = {"type": "function", "function": {
    "name": "qlora_train_probe_tool", "description": "qlora-train probe tool",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


@dataclass(frozen=True)
class TemplateLayout:
    """What a chat template writes around an assistant turn (see the module doc)."""

    assistant_header: str  # what the generation prompt appends ('' when the header is written by the previous turn)
    turn_openers: tuple[str, ...]  # prompt-side text that ends where a turn's generated part begins
    end_markers: tuple[str, ...]  # what a turn's generated part may end with, most common first
    think_open: str = THINK_OPEN
    think_close: str = THINK_CLOSE
    think_separator: str = ""  # whitespace the template writes between the block's close and the answer ('\n\n'):
    # the template's; the content's own leading whitespace after it is the answer's, trained with it
    answer_open: str = ""  # generated marker between the reasoning block and the content ('' for most)
    reasoning_key: str | None = "reasoning_content"  # None: no probe found the reasoning rendered
    leads: tuple[str, ...] = ()  # other template text generated before the content (DeepSeek after tool output)
    turn_start: str = ""  # the piece that opens a user turn (``<|im_start|>``): never inside a generated part
    tool_arguments_as_string: bool = False  # the template writes arguments as given and needs a JSON string
    last_turn_unmarked: bool = False  # the last turn ends with the text (GLM-4: turns end where the next begins)
    trailer: str = ""  # text every render ends with, generation prompt or not, that the generation prompt extends
    # (Llama 3's first template's header): never trained, never inside an end marker
    prompt_tail: str = ""  # what the generation prompt writes after the header (a reasoning opener '<think>\n', a
    # pre-filled empty reasoning block, a channel tag, a preamble): prompt, never trained; a turn's generated part
    # starts after as much of it as the turn writes
    prompt_by_row: bool = False  # the generation prompt's own text depends on the conversation (a '/no_think' flag
    # in a system or user message): each trained turn's is read off the render of its own generation prompt
    layout_class: str = LAYOUT_CLASSES[0]
    unknown: tuple[str, ...] = ()  # facts no probe could find (rows the layout cannot verify take prefix renders)
    # parts model.template_layout sets to other than the probe found: rows they do not verify are refused
    declared: tuple[str, ...] = field(default=(), compare=False)

    @property
    def end_of_turn(self) -> str:
        """The end marker of an ordinary turn ('' when the template writes none)."""
        return self.end_markers[0] if self.end_markers else ""

    @cached_property
    def before_content(self) -> tuple[str, ...]:
        """Generated markers that may stand between the reasoning block and the content."""
        return tuple(m for m in (self.answer_open, *self.leads) if m)

    @cached_property
    def not_before_end(self) -> tuple[str, ...]:
        """Text that cannot stand between a turn's content and its end marker: another turn opens there."""
        start = (self.turn_start,) if self.turn_start and self.turn_start not in self.end_markers else ()
        return self.anchors + start

    @cached_property
    def anchors(self) -> tuple[str, ...]:
        """Texts that may open a turn's generated part: untrained content must not contain them."""
        return tuple(dict.fromkeys(a for a in (self.assistant_header, *self.turn_openers) if a))


def _render(tokenizer, messages, *, tools=None, gen=False) -> str:
    return call_template(tokenizer.apply_chat_template, messages, tools=tools, tokenize=False,
                         add_generation_prompt=gen)


def _try(tokenizer, messages, **kw) -> str | None:
    try:
        return _render(tokenizer, messages, **kw)
    except TEMPLATE_ERRORS:  # a probe the template refuses (roles, tools) or raises on: that fact stays unknown
        return None


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _added(tokenizer) -> list[str]:
    return sorted((t for t in tokenizer.get_added_vocab() if t), key=len, reverse=True)


def pieces(text: str, added: list[str]) -> list[str]:
    """Text -> added tokens, whitespace runs and runs of other characters, in order.

    >>> pieces("<|end|>\\n<|user|>hi", ["<|end|>", "<|user|>"])
    ['<|end|>', '\\n', '<|user|>', 'hi']
    """
    out, i = [], 0
    while i < len(text):
        tok = next((t for t in added if text.startswith(t, i)), None)
        if tok is not None:
            out.append(tok)
            i += len(tok)
            continue
        j = i + 1
        ws = text[i] in WHITESPACE
        while j < len(text) and (text[j] in WHITESPACE) == ws and not any(text.startswith(t, j) for t in added):
            j += 1
        out.append(text[i:j])
        i = j
    return out


def _last_piece(text: str, added: list[str]) -> str:
    parts = [p for p in pieces(text, added) if p.strip(WHITESPACE)]
    return parts[-1] if parts else ""


def _first_piece(text: str, added: list[str]) -> str:
    parts = [p for p in pieces(text, added) if p.strip(WHITESPACE)]
    return parts[0] if parts else ""


_MARKER_SHAPE = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")  # '<|observation|>', '[TOOL_RESULTS]'


def _split_at_markers(piece: str) -> list[str]:
    """A plain-text piece split as added tokens would split it: its bracketed markers and the runs between
    (``user<|role_end|>`` -> ``['user', '<|role_end|>']``)."""
    out, at = [], 0
    for m in _MARKER_SHAPE.finditer(piece):
        out += [x for x in (piece[at:m.start()], m.group(0)) if x]
        at = m.end()
    return out + ([piece[at:]] if piece[at:] else [])


def _opening_marker(text: str, added: list[str]) -> str:
    """The piece ``text`` opens with, plain-text markers split off (``<|start|>`` of ``<|start|>user<|message|>``)."""
    first = _first_piece(text, added)
    return first if first in added else next(iter(_split_at_markers(first)), first)


def _closing_marker(text: str, added: list[str]) -> str:
    """The piece ``text`` ends with, plain-text markers split off (``<|call|>`` of ``"}<|call|>``)."""
    last = _last_piece(text, added)
    return last if last in added else (_split_at_markers(last) or [last])[-1]


def _snap(text: str, n: int, added: list[str], *, at_markers: bool = False) -> int:
    """The last piece boundary of ``text`` at or before ``n`` (a shared prefix may end inside a token); with
    ``at_markers``, plain-text pieces are split at their bracketed markers first (``_marker_pieces``)."""
    at = 0
    for p in (_marker_pieces if at_markers else pieces)(text, added):
        if at + len(p) > n:
            break
        at += len(p)
    return at


def _marker_pieces(text: str, added: list[str]) -> list[str]:
    """``pieces``, plain-text runs split at their bracketed markers as added tokens would split them: the units no
    layout fact may cut through (``<|answerer|><think>`` -> ``['<|answerer|>', '<think>']`` either way)."""
    out = []
    for p in pieces(text, added):
        out += [p] if p in added or not p.strip(WHITESPACE) else _split_at_markers(p)
    return out


def _end_markers(after_mid: str, after_last: str, added: list[str], next_open: str = "",
                 opening: str = "") -> list[str]:
    """What closes a turn, from the text after an earlier answer and after the last one.

    The end is what both share (``<|im_end|>``, ``</s>``, ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``), up to
    ``next_open``, the piece that opens a user turn (a template whose every render ends with an open turn);
    when they share nothing (harmony: ``<|end|>`` mid-conversation, ``<|return|>`` at the end), each one's
    first piece. Markers that are plain text (no added tokens to split at): the shared text less an unfinished
    marker at its end and less what also opens the conversation's first turn (``opening``).
    """
    return [_before(m, next_open) for m in _shared_end(after_mid, after_last, added, opening)]


def _whole_markers(text: str) -> str:
    """``text`` less a marker it ends inside of (``...<|START_OF_TURN_TOKEN|><|`` -> ``...<|START_OF_TURN_TOKEN|>``)."""
    for open_, close in (("<", ">"), ("[", "]")):
        k = text.rfind(open_)
        if k > text.rfind(close):
            text = text[:k]
    return text.strip(WHITESPACE)


def _less_opening(text: str, opening: str) -> str:
    """``text`` less its longest end that also opens the conversation's first turn: that opens the next turn."""
    for k in range(1, len(text)):
        if text[k:].strip(WHITESPACE) and opening.startswith(text[k:]):
            return text[:k].strip(WHITESPACE)
    return text


def _before(marker: str, next_open: str) -> str:
    cut = marker.find(next_open) if next_open else -1
    return marker[:cut].strip(WHITESPACE) if cut > 0 else marker


def _shared_end(after_mid: str, after_last: str, added: list[str], opening: str = "") -> list[str]:
    last = after_last.strip(WHITESPACE)
    shared = after_mid[:_common_prefix(after_mid, after_last)].strip(WHITESPACE)
    if last and shared == last:
        return [last]
    a, b = pieces(after_mid, added), pieces(after_last, added)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    common = "".join(a[:n]).strip(WHITESPACE)
    if common:
        return [common]
    plain = _less_opening(_whole_markers(shared), opening)
    if plain:
        return [plain]
    return [m for m in dict.fromkeys((_first_piece(after_mid, added), _first_piece(after_last, added))) if m]


def _prompt_end(prompted: str, full: str, added: list[str]) -> int:
    """Where the prompt of the probe turn ends in ``full``: the common prefix with the prompted render, moved back
    to a marker boundary of the prompt where the generation prompt writes text the turn does not (a prompt
    ``<|A|><think>`` and a turn ``<|A|></think>..`` share ``<|A|><``: the prompt ends after ``<|A|>``)."""
    n = _common_prefix(prompted, full)
    return len(prompted) if n >= len(prompted) else _snap(prompted, n, added, at_markers=True)


def _cut_open_think(text: str, start: int, end: int, think_open: str) -> int:
    """A generation prompt that opens the reasoning block (Qwen3.5, DeepSeek R1): the header ends before it (what
    the prompt writes from there is its ``prompt_tail``: prompt too, written by some turns and not others)."""
    k = text.find(think_open, start, end) if think_open else -1
    return k if k >= 0 else end


def _reasoning_probe(tokenizer, user, prompted: str, added: list[str], lead: str):
    """(key, think_open, think_close, answer_open, think_separator) from a turn with reasoning, or None when none
    renders it."""
    for key in REASONING_KEYS:
        text = _try(tokenizer, user + [{"role": "assistant", "content": _ANSWER, key: _REASONING}])
        if text is None or _REASONING not in text:
            continue
        r = text.index(_REASONING)
        a = text.find(_ANSWER, r)
        if a < 0:
            continue
        end = _prompt_end(prompted, text, added)
        think_open = text[end:r].strip(WHITESPACE) if end <= r else ""
        if not think_open:  # the generation prompt opened the block: what it writes after its role header
            opened = _opened_by_prompt(prompted[:r])
            think_open = _closing_marker(prompted[:r], added) if opened is None else opened
        between = text[r + len(_REASONING):a].strip(WHITESPACE)
        answer_open = ""
        plain = lead.strip(WHITESPACE)  # an empty block in the plain turn (Qwen3), or its rest (Qwen3.5) goes first
        if think_open and plain.startswith(think_open):
            plain = plain[len(think_open):].strip(WHITESPACE)
        if between and plain.startswith(between):
            plain = plain[len(between):].strip(WHITESPACE)
        if plain and between.endswith(plain):  # a marker before the answer with or without reasoning
            answer_open = plain
            between = between[: len(between) - len(plain)].strip(WHITESPACE)
        before = text[:a]
        return key, think_open, between, answer_open, before[len(before.rstrip(WHITESPACE)):]
    return None


def _opened_by_prompt(prompted: str) -> str | None:
    """What a generation prompt writes after its role header (the reasoning opener it leaves open; '' for
    nothing: a preamble the render never writes is no opener), found from the probe's own texts: the user turn's
    header ends with the same text after its role word as the assistant's (``user\n`` / ``assistant\n``,
    ``role="user"<|gt|>`` / ``role="assistant"<|gt|>``). None when the headers do not show it that way."""
    u = prompted.rfind(_USER)
    users = list(re.finditer("user", prompted[:u], re.IGNORECASE))
    assistants = list(re.finditer("assistant", prompted[u + len(_USER):], re.IGNORECASE))
    if u < 0 or not users or not assistants:
        return None
    tail = prompted[users[-1].end():u]  # the user header after its role word
    rest = prompted[u + len(_USER) + assistants[-1].end():]
    return rest[len(tail):].strip(WHITESPACE) if rest.startswith(tail) else None


def _generated_lead(lead: str, think_open: str, think_close: str, answer_open: str) -> str:
    """Template text generated before the content, less a reasoning block and the answer marker."""
    rest = lead.strip(WHITESPACE)
    if think_open and think_close and rest.startswith(think_open) and think_close in rest:
        rest = rest[rest.index(think_close) + len(think_close):].strip(WHITESPACE)
    if answer_open and rest.startswith(answer_open):
        rest = rest[len(answer_open):].strip(WHITESPACE)
    return rest


def _markup_tail(tail: str, added: list[str]) -> str:
    """The opener in the prompt-side text after a probe message: past the probe's own strings (a tool call id
    the template echoes), and, when it ends in added tokens, just those (``[/TOOL_RESULTS]``); as plain text,
    from its first marker when only punctuation stands before it."""
    for probe in (_CALL_ID, "qlora_probe", _ARG):
        k = tail.rfind(probe)
        if k >= 0:
            tail = tail[k + len(probe):]
    parts = pieces(tail, added)
    n = len(parts)
    while n and (parts[n - 1] in added or not parts[n - 1].strip(WHITESPACE)):
        n -= 1
    markup = "".join(parts[n:]).lstrip(WHITESPACE)
    if any(p in added for p in parts[n:]):
        return markup
    tail = tail.lstrip(WHITESPACE)  # plain-text markers: less what closes the probe's text (``"}`` of a JSON result)
    split = _split_at_markers(tail)
    closing = len(split) > 1 and not any(c.isalnum() or c in WHITESPACE for c in split[0])
    return tail[len(split[0]):] if closing else tail


class _CallStyle(NamedTuple):
    """How the template takes a tool call's arguments: a dict, or a JSON string (DeepSeek joins strings)."""

    as_string: bool = False

    def call(self, *names: str) -> dict:
        args = {"x": _ARG}
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": _CALL_ID, "function": {
                "name": n, "arguments": json.dumps(args) if self.as_string else args}} for n in names]}


def _call_style(tokenizer, user: list[dict]) -> _CallStyle | None:
    """The first style in which the template writes a probe tool call; None when it writes none."""
    for style in (_CallStyle(), _CallStyle(True)):
        text = _try(tokenizer, user + [style.call("qlora_probe")], tools=[_PROBE_TOOL])
        if text is not None and _ARG in text:
            return style
    return None


def _openers(tokenizer, user: list[dict], prompted: str, full: str, think_open: str,
             added: list[str], style: _CallStyle | None) -> list[tuple[str, str]]:
    """(opener, lead): the prompt-side text after the user message (and after a tool result) up to where the
    answer's generated part starts, and what that part writes before the answer."""
    out = []
    u = prompted.rindex(_USER) + len(_USER)
    end = _cut_open_think(prompted, u, _prompt_end(prompted, full, added), think_open)
    out.append((_markup_tail(prompted[u:end], added),
                full[end:full.index(_ANSWER, end)] if _ANSWER in full[end:] else ""))
    result = {"role": "tool", "content": _TOOL_RESULT, "tool_call_id": _CALL_ID, "name": "qlora_probe"}
    convo = user + [style.call("qlora_probe"), result] if style else []
    p = _try(tokenizer, convo, tools=[_PROBE_TOOL], gen=True) if style else None
    f = _try(tokenizer, convo + [{"role": "assistant", "content": _ANSWER}], tools=[_PROBE_TOOL]) if style else None
    bare = _try(tokenizer, convo, tools=[_PROBE_TOOL]) if p is not None else None
    if p is not None and f is not None and _TOOL_RESULT in p and _ANSWER in f and not _parts_before_own(p, f, bare):
        t = p.rindex(_TOOL_RESULT) + len(_TOOL_RESULT)
        end = _cut_open_think(p, t, _prompt_end(p, f, added), think_open)
        if end >= t and f.find(_ANSWER, end) >= 0:
            out.append((_markup_tail(p[t:end], added), f[end:f.index(_ANSWER, end)]))
    return [(o, lead) for o, lead in dict.fromkeys(out) if o]


def _parts_before_own(prompted: str, full: str, bare: str | None) -> bool:
    """Whether the answer's render parts from the generation prompt's render before the generation prompt's own text
    (a tool result written differently when it is the last message): what follows is no opener, the generation
    prompt's text (the header) opens the answer there too."""
    if bare is None:
        return False
    own = _common_prefix(bare, prompted)
    return own < len(prompted) and _common_prefix(prompted, full) < own


def _call_end(tokenizer, user: list[dict], known: list[str], added: list[str], next_open: str,
              style: _CallStyle | None) -> str | None:
    """What closes a tool-call turn when none of the known markers does.

    harmony closes it with ``<|call|>``; GLM writes nothing after the calls (``</tool_call>`` closes each call,
    not the turn) and the model stops by writing the tool result's opener, ``<|observation|>``. A piece that
    follows every call of a two-call turn closes a call, not the turn. The opener is an added token, or, where
    the markers there are plain text, a whole bracketed marker (``<|observation|>`` as several tokens).
    """
    last = _try(tokenizer, user + [style.call("qlora_probe")], tools=[_PROBE_TOOL]) if style else None
    if last is None:
        return None
    after = last[last.rindex(_ARG) + len(_ARG):]
    after = after[:after.find(next_open)] if next_open and next_open in after else after  # a dangling open turn
    if any(m in after for m in known):
        return None
    two = _try(tokenizer, user + [style.call("qlora_probe", "qlora_probe")], tools=[_PROBE_TOOL])
    end = _closing_marker(after, added)
    closer = None
    if two is not None and two.count(_ARG) == 2 and end in two[two.index(_ARG) + len(_ARG):two.rindex(_ARG)]:
        closer = end  # it follows the first call too: it closes a call
    if end != closer and (end in added or _MARKER_SHAPE.fullmatch(end)):
        return end
    result = {"role": "tool", "content": _TOOL_RESULT, "tool_call_id": _CALL_ID, "name": "qlora_probe"}
    mid = _try(tokenizer, user + [style.call("qlora_probe"), result], tools=[_PROBE_TOOL])
    if mid is None or _TOOL_RESULT not in mid:
        return None
    rest = mid[mid.rindex(_ARG) + len(_ARG):mid.rindex(_TOOL_RESULT)]
    rest = rest[rest.find(closer) + len(closer):] if closer and closer in rest else rest
    opener = _first_piece(rest, added)
    if opener in added:
        return opener
    plain = not any(p in added for p in pieces(rest, added))  # markers that are plain text: a whole one
    return opener if plain and _MARKER_SHAPE.fullmatch(opener) else None


def prompt_written(text: str, at: int, prompt: str, tokenizer) -> int:
    """How much of ``prompt`` (a generation prompt's text after the header) ``text`` writes at ``at``: all of it,
    or the characters they share, moved back out of a marker they part inside (an added token, or a bracketed
    marker as plain text: a prompt ``<think>`` and a turn ``</think>`` share ``<``, which is nothing).

    >>> prompt_written("<think>\\nr</think>", 0, "<think>\\n\\n</think>\\n\\n", tok)
    8
    >>> prompt_written("</think>a", 0, "<think>", tok)
    0
    """
    n = len(prompt) if text.startswith(prompt, at) else _common_prefix(text[at:at + len(prompt)], prompt)
    if n in (0, len(prompt)):
        return n
    spans = [(m.start(), m.end()) for m in _MARKER_SHAPE.finditer(prompt)]
    spans += [(k, k + len(t)) for t in _added_tokens(tokenizer) if t in prompt for k in _occurrences(prompt, t)]
    moved = True
    while moved:
        moved = False
        for a, b in spans:
            if a < n < b:
                n, moved = a, True
    return n


def _occurrences(text: str, part: str) -> list[int]:
    out, k = [], text.find(part)
    while k >= 0:
        out.append(k)
        k = text.find(part, k + 1)
    return out


_ADDED: dict[tuple[str, str], list[str]] = {}


def _added_tokens(tokenizer) -> list[str]:
    """``_added`` once per template and vocabulary."""
    key = probe_key(tokenizer)
    if key not in _ADDED:
        _ADDED[key] = _added(tokenizer)
    return _ADDED[key]


def _template_key(tokenizer) -> str:
    """The tokenizer's template as a cache key (a dict of named templates too: Command R ships several)."""
    template = tokenizer.chat_template or ""
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its size, its vocabulary's key)


def probe_key(tokenizer) -> tuple[str, str]:
    """What a probe's result depends on: the template text and the vocabulary (added tokens, bos/eos, class and
    source), recomputed when the vocabulary's size changes (tokens added)."""
    n = len(tokenizer)
    memo = _VOCABS.get(tokenizer)
    if memo is None or memo[0] != n:
        vocab = json.dumps([sorted(tokenizer.get_added_vocab().items()), tokenizer.bos_token, tokenizer.eos_token,
                            type(tokenizer).__name__, str(tokenizer.name_or_path), n])
        memo = (n, hashlib.blake2b(vocab.encode(), digest_size=16).hexdigest())
        _VOCABS[tokenizer] = memo
    return _template_key(tokenizer), memo[1]


def _unknown_layout(why: str, end_markers: tuple[str, ...] = ()) -> TemplateLayout:
    log.info("chat template probe: %s", why)
    return TemplateLayout(assistant_header="", turn_openers=(), end_markers=end_markers, layout_class="unknown",
                          unknown=("assistant_header", "turn_openers", *(() if end_markers else ("end_markers",))))


def _known_end(mid: str, *user_opens: str) -> str:
    """The end marker of an answer followed by a user turn, from the probe's own texts: what stands between the
    answer and the user turn's known opening text (``<|eot_id|>`` before ``<|start_header_id|>user...``; the
    first that fits of the opening with the bos token, as Llama 2 writes it in every turn, and without), so
    markers that are plain text, several tokens each, are cut where they end ('' when it cannot be told)."""
    for user_open in user_opens:
        if user_open.strip(WHITESPACE) and mid.endswith(user_open):
            return mid[: len(mid) - len(user_open)].strip(WHITESPACE)
    return ""


def _end_before_header(tokenizer, user: list[dict], header: str, lead: str) -> str:
    """The end marker of an answer, from two answers in a row: what stands between them, less the known header and
    lead of the second (for templates whose user turns open with other text first: a default system message)."""
    if not header.strip(WHITESPACE):
        return ""
    two = _try(tokenizer, user + [{"role": "assistant", "content": _ANSWER},
                                  {"role": "assistant", "content": _ANSWER2}])
    if two is None or _ANSWER2 not in two:
        return ""
    between = two[two.index(_ANSWER) + len(_ANSWER):two.index(_ANSWER2)]
    for known in (lead, header):
        if known and between.endswith(known):
            between = between[: len(between) - len(known)]
    return between.strip(WHITESPACE) if between.strip(WHITESPACE) and header.strip(WHITESPACE) not in between else ""


def _trailer(plain: str, prompted: str, full: str, two: str, markers: list[str]) -> str:
    """Text every render ends with, generation prompt or not, that the generation prompt extends: the opener of
    an assistant turn written after every render (Meta's first Llama 3 template appends its whole assistant
    header, the generation prompt adds nothing; others add one more marker, ``<|T|><|BOT|>`` + ``<|R|>``). It is
    what follows an answer's end marker and also ends the renders of a lone user question and of two exchanges,
    where the prompted render is the plain one and the generation prompt's own text after it."""
    if not prompted.startswith(plain):
        return ""
    rest = full[full.index(_ANSWER) + len(_ANSWER):].lstrip(WHITESPACE)
    m = next((m for m in markers if rest.startswith(m)), None)
    if m is None:
        return ""
    t = rest[len(m):].lstrip(WHITESPACE)  # its own whitespace kept: the header's '\n\n' is not generated
    return t if t.strip(WHITESPACE) and plain.endswith(t) and two.endswith(t) else ""


def probe_layout(tokenizer) -> TemplateLayout:
    """Render probe conversations and read the layout off them (see the module doc).

    Facts no probe can find stay unknown (``TemplateLayout.unknown``): the layout then verifies no row, and the
    render stage applies the rule with prefix renders instead; a probe never stops a run.
    """
    added = _added(tokenizer)
    user = [{"role": "user", "content": _USER}]
    plain = _try(tokenizer, user)
    prompted = _try(tokenizer, user, gen=True)
    full = _try(tokenizer, user + [{"role": "assistant", "content": _ANSWER}])
    if plain is None or prompted is None or full is None:
        return _unknown_layout("the template refuses a conversation of one user question and one answer")
    if _ANSWER not in full or _USER not in prompted or _USER not in plain:
        return _unknown_layout("a user question and an assistant answer do not both appear in the render")
    end = _prompt_end(prompted, full, added)
    answer_at = full.index(_ANSWER, end) if _ANSWER in full[end:] else full.index(_ANSWER)
    lead = full[end:answer_at]  # generated before the content of a turn without reasoning
    reasoning = _reasoning_probe(tokenizer, user, prompted, added, lead)
    key, think_open, think_close, answer_open, separator = reasoning or (None, THINK_OPEN, THINK_CLOSE, "", "")
    shared = _common_prefix(prompted, plain)  # where the generation prompt's text starts: at the end of the plain
    base = shared if shared == len(plain) else max(_snap(prompted, shared, added),  # render, or at a piece
                                                   prompted.rindex(_USER) + len(_USER))  # boundary after the probe
    header = prompted[base:_cut_open_think(prompted, base, end, think_open)] if end > base else ""
    tail = prompted[base + len(header):]  # the generation prompt's text after the header: prompt, never trained
    style = _call_style(tokenizer, user)
    found = _openers(tokenizer, user, prompted, full, think_open, added, style)
    two = _try(tokenizer, user + [{"role": "assistant", "content": _ANSWER}, {"role": "user", "content": _USER2},
                                  {"role": "assistant", "content": _ANSWER2}])
    head, bos = plain[:plain.index(_USER)], tokenizer.bos_token or ""
    user_text = head[len(bos):] if bos and head.startswith(bos) else head  # what opens a user turn
    markers: list[str] = []
    after_last = ""
    if two is not None and _USER2 in two and _ANSWER2 in two:
        a1 = two.index(_ANSWER) + len(_ANSWER)
        mid = two[a1:two.index(_USER2, a1)]
        after_last = two[two.rindex(_ANSWER2) + len(_ANSWER2):]
        user_open = _opening_marker(user_text, added)
        known = _known_end(mid, head, user_text) or _end_before_header(tokenizer, user, header, lead)
        if known and after_last.lstrip(WHITESPACE).startswith(known):
            markers = [known]
        else:
            markers = _end_markers(mid, after_last, added, user_open, user_text)
            if known and known not in markers:
                markers = [known] + [m for m in markers if not m.startswith(known)]
    else:
        user_open = _opening_marker(user_text, added)
    # an end marker found between two answers may run on into the trailer (the second's opener, less what the
    # generation prompt adds): the trailer is looked for after the markers cut where a turn's opening piece starts
    trailer = _trailer(plain, prompted, full, two or "", [_before(m, user_open) for m in markers])
    if trailer:  # the text every render ends with opens every answer, the generation prompt's own text after it
        header = trailer + header
        found = [(header, lead)]
    elif header:  # the header opens every turn; an opener that does not end with it is a turn without one
        found = [(header, lead)] + [(o, lead2) for o, lead2 in found[1:] if not o.endswith(header)]
    # an opener that also opens a user turn (a role-less '<|end_header_id|>\n\n') would find answers anywhere
    found = [(o, lead2) for o, lead2 in found if o.strip(WHITESPACE) and o.strip(WHITESPACE) not in user_text]
    if not found:
        return _unknown_layout("nothing marks where an assistant answer starts (no generation prompt, no text "
                               "between the user message and the answer that only an answer follows)",
                               tuple(markers))
    openers = [o for o, _ in found]
    leads = [g for _, lead2 in found if (g := _generated_lead(lead2, think_open, think_close, answer_open))]
    markers = _not_into_openers(markers, (trailer, *openers))
    call_end = _call_end(tokenizer, user, markers, added, user_open, style)
    if call_end:
        markers = _not_into_openers([*markers, call_end], (trailer, *openers))
    if not markers:
        log.warning("chat template writes no end-of-turn marker after assistant turns: the model will not learn "
                    "to stop")
    return TemplateLayout(assistant_header=header, turn_openers=tuple(openers), end_markers=tuple(markers),
                          think_open=think_open, think_close=think_close, think_separator=separator,
                          answer_open=answer_open,
                          reasoning_key=key, leads=tuple(dict.fromkeys(leads)), turn_start=user_open,
                          tool_arguments_as_string=bool(style and style.as_string),
                          last_turn_unmarked=bool(markers) and not after_last.strip(WHITESPACE), trailer=trailer,
                          prompt_tail=tail, prompt_by_row=_prompt_by_row(tokenizer, plain, prompted),
                          layout_class=_layout_class(header, trailer, openers))


_COMMON_FLAGS = ("/no_think", "/think", "/nothink")  # what hybrid-reasoning families read off a system or user turn
_QUOTED = re.compile(r"""(['"])([^'"\n<>{}%]{1,40})\1""")


def _flags(tokenizer) -> list[str]:
    """Texts that may switch a template's generation prompt when a message holds them: the template's own quoted
    strings that mention thinking (``'/no_think' in system_message``), and the common ones."""
    quoted = {m.group(2) for m in _QUOTED.finditer(_template_key(tokenizer)) if "think" in m.group(2).lower()}
    return sorted(quoted | set(_COMMON_FLAGS))


def _prompt_by_row(tokenizer, plain: str, prompted: str) -> bool:
    """Whether the generation prompt's own text depends on the conversation: rendered after a system message,
    after an exchange, and with each of the template's flags (``_flags``) in a system and in a user message, it
    writes other text than after the probe's one question (SmolLM3's ``/no_think`` pre-fills an empty reasoning
    block). A probe the template refuses shows nothing."""
    own = prompted[len(plain):] if prompted.startswith(plain) else None
    system = {"role": "system", "content": _SYSTEM}
    user = {"role": "user", "content": _USER}
    convos = [[system, user], [user, {"role": "assistant", "content": _ANSWER}, {"role": "user", "content": _USER2}]]
    for flag in _flags(tokenizer):
        convos += [[{**system, "content": f"{_SYSTEM} {flag}"}, user], [{**user, "content": f"{_USER} {flag}"}]]
    for convo in convos:
        bare, gen = _try(tokenizer, convo), _try(tokenizer, convo, gen=True)
        if bare is None or gen is None:
            continue
        if gen.startswith(bare) and own is not None:
            if gen[len(bare):] != own:
                return True
        elif not gen.endswith(prompted[_common_prefix(prompted, plain):]):
            return True
    return False


def _not_into_openers(markers: list[str], openers: tuple[str, ...]) -> list[str]:
    """The end markers, each cut before a turn opener or the trailer it runs into: a probed end marker never
    contains one (what the model writes to stop ends before the next turn opens). Deduplicated, in order."""
    cut = []
    for m in markers:
        for o in (o.strip(WHITESPACE) for o in openers):
            m = _before(m, o) if o else m
        cut.append(m)
    return [m for m in dict.fromkeys(cut) if m]


def _layout_class(header: str, trailer: str, openers: list[str]) -> str:
    """One of LAYOUT_CLASSES: where the prompt of a turn ends (a label for people; the fields decide)."""
    if trailer:
        return "header_after_every_render"
    if header:
        return "header_from_generation_prompt"
    role = any(w in openers[0].lower() for w in ("assistant", "model", "bot", "gpt"))
    return "header_in_user_turn" if role else "no_header"


_ROLE_RENDERED: dict[tuple[str, str, str], bool] = {}


def role_is_rendered(tokenizer, role: str) -> bool:
    """Whether the template writes the content of a ``role`` message at all (probed once per role)."""
    key = (*probe_key(tokenizer), role)
    if key not in _ROLE_RENDERED:
        probe = {"role": role, "content": _SYSTEM}
        user, answer = {"role": "user", "content": _USER}, {"role": "assistant", "content": _ANSWER}
        convos = [[probe, user, answer], [user, answer, probe, {"role": "user", "content": _USER2}, answer]]
        if role == "tool":
            call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": _CALL_ID,
                    "function": {"name": "qlora_probe", "arguments": {"x": _ARG}}}]}
            convos.insert(0, [user, call, {**probe, "tool_call_id": _CALL_ID, "name": "qlora_probe"}, answer])
        texts = (_try(tokenizer, c, tools=[_PROBE_TOOL] if role == "tool" else None) for c in convos)
        _ROLE_RENDERED[key] = any(t is not None and (_SYSTEM in t or json.dumps(_SYSTEM) in t) for t in texts)
    return _ROLE_RENDERED[key]


# --- the tool schemas' block: where a render writes the ``tools`` it was given -------------------------------------

class ToolBlock(NamedTuple):
    """The text a template writes around the tool schemas it is given (``open`` + schemas + ``close``): the
    tokens a row's tools cost are those starting inside that span of its one render."""

    open: str
    close: str

    def span(self, text: str) -> tuple[int, int] | None:
        """Where the block is in a render made with tools (None when it is not found as probed)."""
        a = text.find(self.open)
        if a < 0:
            return None
        b = text.find(self.close, a + len(self.open))
        return None if b < 0 else (a, b + len(self.close))


_TOOL_BLOCKS: dict[tuple[str, str, bool], ToolBlock | None] = {}


def tool_block(tokenizer, with_system: bool = False) -> ToolBlock | None:
    """Probe once (cached per tokenizer, template and ``with_system``) what the template writes for ``tools``
    in a conversation that opens with a system message (``with_system``) or without one (templates write the
    block differently: Qwen opens a system turn for it, or appends it to the system prompt); None when it
    writes no tools, or not as a JSON schema between fixed texts."""
    key = (*probe_key(tokenizer), with_system)
    if key not in _TOOL_BLOCKS:
        _TOOL_BLOCKS[key] = probe_tool_block(tokenizer, with_system)
    return _TOOL_BLOCKS[key]


def probe_tool_block(tokenizer, with_system: bool = False) -> ToolBlock | None:
    user = [{"role": "system", "content": _SYSTEM}] * with_system + [{"role": "user", "content": _USER}]
    without, with_tool = _try(tokenizer, user), _try(tokenizer, user, tools=[_PROBE_TOOL])
    if without is None or with_tool is None or with_tool == without:
        return None
    p = _common_prefix(with_tool, without)
    s = len(os.path.commonprefix([with_tool[p:][::-1], without[p:][::-1]]))
    if p + s != len(without):
        return None  # the tools change other text too (a different system prompt): not one block to count
    block = with_tool[p:len(with_tool) - s]  # what the tools add, in one piece
    name_at = block.find(_PROBE_TOOL["function"]["name"])
    if name_at < 0:
        return None
    start = end = None
    for i in range(name_at, -1, -1):  # the outermost JSON value around the name: the schemas as written
        if block[i] not in "{[":
            continue
        try:
            _, stop = json.JSONDecoder().raw_decode(block, i)
        except ValueError:
            continue
        if stop > name_at:
            start, end = i, stop
    if start is None or not block[:start].strip() or not block[end:].strip():
        return None  # a block that is only the schemas cannot be told from the text around it
    return ToolBlock(block[:start], block[end:])
