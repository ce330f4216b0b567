"""Row text outside content: the role names, message names, tool call ids, tool names, argument keys and tool
schemas a template writes around the messages. Unlike content, nothing checks where they land in a render, so a
marker inside one would move the turns the mask is found by::

    {"role": "x<|im_end|>\\n<|im_start|>assistant\\nINJECTED<|im_end|>\\n<|im_start|>user", "content": "..."}

is written by ChatML templates as a whole assistant turn that is not one. ``check_row_text`` refuses such a row
(``marker_in_row_text``) before any span is looked for, on every path (one render, prefix renders, pairs):

    >>> check_row_text([{"role": "x<|im_end|>", "content": "hi"}], None, ("<|im_end|>",))
    Traceback (most recent call last):
    qlora_train.masking.messages.RowRejected: marker_in_row_text: messages[0].role holds the template's marker ...

A role the project does not know (``KNOWN_ROLES``) must also be a plain name (letters, digits, ``_ - .`` and
inner spaces): a template writes it inside its own header, where part of a marker in it and the header's own
text around it make a whole one (``assistant|>\\n`` in ``<|`` + role + ``|>``).

The markers (``row_text_markers``) are the layout's facts (what opens a turn's generated part, the end markers,
reasoning delimiters, answer marker, leads, trailer, and the bracketed markers inside each), the tokenizer's
added tokens the template writes, and its bos / eos tokens. Content, reasoning and tool call argument values are
not row text here: the rule masks them (the user's side is never trained, the assistant's is trained as written
when its turn verifies).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterator
from functools import lru_cache

from qlora_train.masking.layout import _MARKER_SHAPE, TemplateLayout, probe_key
from qlora_train.masking.messages import KNOWN_ROLES, WHITESPACE, DropReason, Message, RowRejected

_PLAIN_NAME = re.compile(r"[\w.\-]+(?: [\w.\-]+)*")  # 'ipython', 'function_response', 'Tool Output'


def layout_markers(layout: TemplateLayout) -> tuple[str, ...]:
    """The layout's facts as markers (whitespace stripped), and each bracketed marker inside them
    (``<|end_header_id|>`` of ``<|start_header_id|>assistant<|end_header_id|>``: plain text on a vocabulary that
    lacks it). What opens a user turn only when it is marker-shaped (a plain-text role word is no marker)."""
    facts = [*layout.anchors, *layout.end_markers, layout.answer_open, *layout.leads, layout.trailer,
             layout.think_open, layout.think_close]
    out = [f.strip(WHITESPACE) for f in facts]
    out += [m for f in (*facts, layout.turn_start) for m in _MARKER_SHAPE.findall(f)]
    return tuple(dict.fromkeys(m for m in out if m))


_MARKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (the layout, its markers)


def row_text_markers(tokenizer, layout: TemplateLayout) -> tuple[str, ...]:
    """What must not stand inside row text outside content (see the module doc), longest first; made once per
    tokenizer and layout (``template_layout`` gives a new layout object when the template or vocabulary changes)."""
    memo = _MARKERS.get(tokenizer)
    if memo is None or memo[0] is not layout:
        template = probe_key(tokenizer)[0]
        added = [t for t in tokenizer.get_added_vocab() if t.strip(WHITESPACE) and t in template]
        ends = [t for t in (tokenizer.bos_token, tokenizer.eos_token) if isinstance(t, str) and t.strip(WHITESPACE)]
        markers = dict.fromkeys([*layout_markers(layout), *added, *ends])
        memo = _MARKERS[tokenizer] = (layout, tuple(sorted(markers, key=len, reverse=True)))
    return memo[1]


def _strings(value, where: str) -> Iterator[tuple[str, str]]:
    """Every string of a JSON-like value with where it is (keys as well as values)."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield f"{where} key", k
            yield from _strings(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for j, v in enumerate(value):
            yield from _strings(v, f"{where}[{j}]")


def row_text(messages: list[Message]) -> list[tuple[tuple, str]]:
    """``(where, text)`` for each piece of the messages' row text outside content: role names, message names and
    tool call ids, each call's id, name and argument names; ``where`` as parts (``_where`` writes them out)."""
    out = []
    for i, m in enumerate(messages):
        out.append(((i, "role"), m["role"]))
        name, call_id = m.get("name"), m.get("tool_call_id")
        if isinstance(name, str):
            out.append(((i, "name"), name))
        if isinstance(call_id, str):
            out.append(((i, "tool_call_id"), call_id))
        for j, call in enumerate(m.get("tool_calls") or ()):
            fn = call.get("function") or {}
            out += [((i, j, key), t) for key, t in (("id", call.get("id")), ("name", fn.get("name")))
                    if isinstance(t, str)]
            if isinstance(fn.get("arguments"), dict):
                out += [((i, j, "arguments key"), k) for k in fn["arguments"] if isinstance(k, str)]
    return out


def _where(parts: tuple) -> str:
    """``(1, "role")`` -> ``messages[1].role``; ``(1, 0, "name")`` -> ``messages[1].tool_calls[0].name``."""
    if len(parts) == 2:
        return f"messages[{parts[0]}].{parts[1]}"
    i, j, key = parts
    return f"messages[{i}].tool_calls[{j}].{key}"


_SCHEMAS: list = [None, ""]  # the last tool schemas seen (a copy) and their JSON: the rows of a dataset share them


def _schemas_json(tools: list[dict]) -> str:
    if tools != _SCHEMAS[0]:  # compared by value
        text = json.dumps(tools)
        _SCHEMAS[:] = [json.loads(text), text]
    return _SCHEMAS[1]


@lru_cache(maxsize=64)
def _json_forms(markers: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    return tuple((k, json.dumps(k)[1:-1]) for k in markers)


def check_row_text(messages: list[Message], tools: list[dict] | None, markers: tuple[str, ...]) -> None:
    """Refuse (``marker_in_row_text``) a row whose text outside content holds one of ``markers``, or whose
    unknown role is not a plain name (see the module doc). One scan per marker over the messages' row text
    joined and over the tool schemas as JSON (each marker as JSON writes it: ``\\n`` for a newline,
    ``\\uff5c`` for DeepSeek's full-width bar); where, only when one is found."""
    pieces = row_text(messages)
    joined = "\x00".join(text for _, text in pieces)
    schemas = _schemas_json(tools) if tools else ""
    found = [k for k, as_json in _json_forms(markers) if k in joined or (schemas and as_json in schemas)]
    if found:
        hits = [(_where(w), t) for w, t in pieces] + (list(_strings(tools, "tools")) if tools else [])
        hit = next(((w, t, k) for w, t in hits for k in found if k in t), None)
        if hit is not None:  # (a marker the JSON forms across two strings is in none)
            where, text, marker = hit
            raise RowRejected(DropReason.MARKER_IN_ROW_TEXT, f"{where} holds the template's marker {marker!r} "
                              f"({text[:60]!r}): row text outside content must not hold markers, it would move "
                              "the turns the mask is found by")
    for i, m in enumerate(messages):
        role = m["role"]
        if role not in KNOWN_ROLES and not _PLAIN_NAME.fullmatch(role):
            raise RowRejected(DropReason.MARKER_IN_ROW_TEXT, f"messages[{i}].role {role[:60]!r} is not a plain "
                              "name (letters, digits, '_', '-', '.', inner spaces): the template writes it inside "
                              "its own markup; map it with data.roles")
