"""The canonical message type that flows between the dataset stages, and row rejection.

A message is a plain dict (what ``apply_chat_template`` takes)::

    {"role": "assistant", "content": "4", "reasoning_content": "2+2=4",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}], "train": True}

``role``, ``content`` (a str) and ``train`` (a bool) are always present;
``reasoning_content``, ``tool_calls``, ``name``, ``tool_call_id`` and ``images``
(``masking.images``: content then holds an ``IMAGE_SLOT`` per image) only when
the row has them. ``train`` is decided once, by the parse stage
(``LossPolicy.mark``), and only read afterwards.
"""

from __future__ import annotations

import bisect
import json
import re
from traceback import format_exception
from typing import Any, NotRequired, TypedDict

KNOWN_ROLES = ("system", "user", "assistant", "tool")
WHITESPACE = " \t\r\n"  # what a template may write around a part of a message (stripped when parts are compared)
# the inline reasoning block of assistant content in data, and the block a template writes when the probe finds no other
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
IMAGE_SLOT = "\ufffc"  # where an image sits in a message's content (masking.images)


class ImageInfo(TypedDict):
    ref: str  # an absolute path or a data: URI (``data.images``)
    width: int
    height: int


class Message(TypedDict):
    role: str
    content: str
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]
    name: NotRequired[str]
    tool_call_id: NotRequired[str]
    images: NotRequired[list[ImageInfo]]  # one per IMAGE_SLOT in content, in order
    train: bool


def message_images(messages: list[Message]) -> list[ImageInfo]:
    """The images of the messages, in the order the template writes them (message order, slot order)."""
    return [im for m in messages for im in m.get("images", ())]


def template_content(message: Message) -> Message:
    """A message as the template reads it: content with image slots -> content parts (``{"type": "text"}`` and
    ``{"type": "image"}``, in order; empty text parts left out); a message without images as it is."""
    if not message.get("images"):
        return message
    parts: list[dict] = []
    for k, piece in enumerate(message["content"].split(IMAGE_SLOT)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return {k: v for k, v in message.items() if k != "images"} | {"content": parts}


def engine_messages(messages: list[dict]) -> list[Message]:
    """Messages as the API takes them (``mask_conversation``, ``mask_pair``, ``mask_response``) -> canonical ones:
    ``content`` a string, ``None`` or absent as ``""``, a list of content parts as the row reader reads them (text
    parts joined; an image part, which must give its ``width`` and ``height`` here, as an ``IMAGE_SLOT`` with its
    ``ImageInfo`` in ``images``: the engine reads no image file, ``qlora_train.data`` does). Anything else is a
    ``RowRejected`` naming the message, never an exception.

    >>> engine_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    [{'role': 'user', 'content': 'ab'}]
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RowRejected(DropReason.BAD_ROW, f"messages[{i}]: not a message with a string role")
        content = m.get("content")
        if isinstance(content, str):
            out.append(m)
            continue
        if content is None:
            out.append({**m, "content": ""})
            continue
        if not isinstance(content, list):
            raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"messages[{i}]: content of type {type(content).__name__} "
                              "(a string or a list of content parts)")
        pieces, images = [], list(m.get("images") or ())
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind in ("image", "image_url") and all(isinstance(part.get(k), int) for k in ("width", "height")):
                ref = part.get("image") or part.get("url") or part.get("path") or ""
                pieces.append(IMAGE_SLOT)
                images.append(ImageInfo(ref=ref if isinstance(ref, str) else "", width=part["width"],
                                        height=part["height"]))
            elif kind in ("image", "image_url"):
                raise RowRejected(DropReason.BAD_IMAGE, f"messages[{i}].content[{j}]: an image part needs its width "
                                  "and height here (the engine reads no image file: qlora_train.data reads rows "
                                  "with images)")
            else:
                what = repr(kind) if isinstance(part, dict) else type(part).__name__
                raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"messages[{i}].content[{j}]: a content part of type "
                                  f"{what} (text and image parts are read)")
        out.append({**m, "content": "".join(pieces), **({"images": images} if images else {})})
    return out


class DropReason:
    """Why the engine refuses a row (``RowRejected.reason``): the template and the mask. The data layer's
    ``data.drops.DropReason`` extends it with the reasons of reading and fitting rows; every refused row is
    counted under exactly one reason of that."""

    TEMPLATE_ERROR = "template_error"
    UNRENDERED_ROLE = "unrendered_role"
    MASK_UNVERIFIED = "mask_unverified"
    MARKER_IN_ROW_TEXT = "marker_in_row_text"  # a role, name, id, tool name, argument key or tool schema holds a marker
    INVALID_UNICODE = "invalid_unicode"
    OVER_BUDGET = "over_budget"  # the row's renders, characters, template steps or seconds over data.row_budget
    BAD_ROW = "bad_row"  # an exception nobody foresaw (RowRejected.unexpected); the data layer's malformed rows too
    BAD_CONTENT_TYPE = "bad_content_type"  # a message's content neither text nor content parts
    # a preference pair (pair.mask_pair)
    PAIR_IDENTICAL = "pair_identical"  # the two sides are the same tokens
    PAIR_PROMPT_DIFFERS = "pair_prompt_differs"  # the prompt rendered or tokenized differently on the two sides
    # a row's images (masking.images, data.images): missing, unreadable, too large, or not where the template puts one
    BAD_IMAGE = "bad_image"


class RowRejected(Exception):
    """A stage refuses a row: ``reason`` is a ``DropReason`` value, ``detail`` says where and why."""

    def __init__(self, reason: str, detail: str, *, traceback: str = ""):
        self.reason = reason
        self.detail = detail
        self.traceback = traceback  # an unexpected exception's, when one caused the refusal (rows.guarded)
        super().__init__(f"{reason}: {detail}")

    @classmethod
    def unexpected(cls, exc: BaseException) -> RowRejected:
        """An exception nobody foresaw, on one row -> its refusal (``bad_row``) with the exception's traceback: a
        bug in our code or an input nobody foresaw, counted like a bad row (``rows.guarded``).

        >>> rej = RowRejected.unexpected(ValueError("x" * 300))
        >>> rej.reason, len(rej.detail), rej.detail[:30]
        ('bad_row', 224, 'unexpected ValueError: xxxxxxx')
        """
        msg = " ".join(str(exc).split())
        msg = msg[:200] + "…" if len(msg) > 200 else msg  # rows can hold huge strings
        return cls(DropReason.BAD_ROW, f"unexpected {type(exc).__name__}: {msg}",
                   traceback="".join(format_exception(exc)))


def _arguments(call: dict) -> dict:
    """A tool call's arguments as a mapping (given as one, or as a JSON string of one); ``{}`` otherwise."""
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return {}
    return args if isinstance(args, dict) else {}


def argument_values(call: dict) -> list[str]:
    """A tool call's scalar argument values as a template writes them (strings as they are, numbers and
    booleans as JSON): what must be inside the call's turn besides its name."""
    return [v if isinstance(v, str) else json.dumps(v) for v in _arguments(call).values()
            if isinstance(v, (str, int, float, bool)) and (not isinstance(v, str) or v.strip())]


def argument_keys(call: dict) -> list[str]:
    """A tool call's argument names: every template writes them beside the values (``{"a": 1}``,
    ``<arg_key>a</arg_key>``, ``a=1``)."""
    return [k for k in _arguments(call) if isinstance(k, str) and k.strip()]


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, message_ends: list[int] | None = None) -> None:
    """Refuse text holding a lone surrogate (a broken escape or undecodable bytes): no tokenizer can encode it.

    ``message_ends`` (a render's) name the message it is in.
    """
    m = _SURROGATE.search(text)
    if m is None:
        return
    if message_ends is None:
        part = "text"
    else:
        k = bisect.bisect_left(message_ends, m.start() + 1)  # first message whose part ends after it
        part = f"messages[{k}]" if k < len(message_ends) else "tools or template text"
    raise RowRejected(DropReason.INVALID_UNICODE,
                      f"{part}: lone surrogate {m.group()!a} at character {m.start()} of the render")
