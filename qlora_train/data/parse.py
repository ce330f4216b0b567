"""Stage 1: a raw row of any common schema -> canonical messages + tools + a ParseReport.

    >>> canonicalize_row({"prompt": "2+2?", "response": "<think>add</think>4"}).messages
    [{'role': 'user', 'content': '2+2?', 'train': False},
     {'role': 'assistant', 'content': '4', 'reasoning_content': 'add', 'train': True}]

Pure: the input row is never mutated. Problems that make a row unusable raise
``RowRejected`` with a reason and the offending key or message index.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

from qlora_train.config import DataConfig
from qlora_train.data.batches import JSONLimitError, read_json
from qlora_train.data.drops import DropReason
from qlora_train.data.images import REF_KEYS, image_info, image_ref, shown
from qlora_train.masking import (
    IMAGE_SLOT,
    KNOWN_ROLES,
    THINK_CLOSE,
    THINK_OPEN,
    ImageInfo,
    LossPolicy,
    Message,
    RowRejected,
    RowSpending,
    image_rule,
)

log = logging.getLogger(__name__)

SHAREGPT_ROLES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
    "bot": "assistant", "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
    "function_response": "tool",
}
PROMPT_KEYS = ("prompt", "question", "instruction")
RESPONSE_KEYS = ("response", "completion", "answer", "output", "chosen")
MESSAGE_KEYS = ("messages", "conversations", "conversation")
CHAT_SCHEMAS = ("messages", "sharegpt", "prompt_response", "alpaca")
TEMPLATE_FREE_SCHEMAS = ("segments", "pretokenized", "text")
DEFAULT_PROPERTIES = {"messages": {"role": "role", "content": "content"},
                      "sharegpt": {"role": "from", "content": "value"}}
_warned_roles: set[str] = set()


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


@dataclass
class ParseReport:
    """What canonicalization did to one row; ``+`` adds reports up over a dataset.

    Counts by name are plain dicts (a row builds one report, so it must be cheap to make).
    """

    schema: str = "unknown"
    schemas: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    extracted_think_from_content: int = 0
    unbalanced_think_tags: int = 0
    moved_reasoning_keys: dict[str, int] = field(default_factory=dict)
    dropped_think_messages: int = 0
    think_capped_messages: int = 0
    tools_present: int = 0
    tools_parsed_from_string: int = 0
    unknown_roles: dict[str, int] = field(default_factory=dict)
    system_from_column: int = 0  # rows whose system message is their ``system`` column (with_row_system)
    system_column_conflicts: int = 0  # rows with a system message of their own and a column that differs: not used
    image_rows: int = 0  # rows with images
    images: dict[str, int] = field(default_factory=dict)  # images read, by form (RowImages.FORMS)
    # filled after the render (pipeline): what the chat template did with the row's reasoning and messages
    reasoning_dropped_rows: int = 0  # rows with at least one trained turn whose reasoning the template dropped
    reasoning_dropped_turns: int = 0  # trained turns trained without their reasoning
    reasoning_dropped_tokens: int = 0  # tokens of that reasoning
    reasoning_expanded_turns: int = 0  # turns whose reasoning is trained in an extra example (expand)
    expanded_examples: int = 0  # extra examples made by reasoning_history: expand
    unrendered_messages: dict[str, int] = field(default_factory=dict)  # role -> untrained messages not rendered
    verified_by_prefix_renders: int = 0  # rows the layout could not verify, verified by the rule's prefix renders
    prefix_renders: int = 0  # chat-template renders those rows cost (two per trained turn, three at most)
    # data.rule_check (data/rule_check.py): the row also masked by the rule, and the outcome
    rule_checked_rows: int = 0  # the rule's ids and labels are the same
    rule_unchecked_rows: int = 0  # the rule cannot decide (the template is not prefix-stable on the row)
    rule_disagreements: int = 0  # they differ: the row is refused as mask_disagrees
    # ... and its renders encoded by the fast byte-level encoder and by tokenizers (masking/fast_bpe.py): they
    # differ (the tokenizer is switched back to tokenizers for the rest of the run; the row is kept, as tokenizers
    # encodes it)
    fast_encoder_mismatches: int = 0

    def __add__(self, other: ParseReport) -> ParseReport:
        return ParseReport.total_of_dicts([self.to_dict(), other.to_dict()])

    @classmethod
    def total(cls, reports) -> ParseReport:
        """Sum of many reports (an empty sum has ``schema='none'``)."""
        return cls.total_of_dicts(r.to_dict() for r in reports)

    @classmethod
    def total_of_dicts(cls, dicts) -> ParseReport:
        """The sum of reports given as the dicts ``to_dict`` or the pipeline's JSON hold (absent fields at their
        defaults), added in place: no report object per row. Counts add up; ``schema`` is the one schema all
        share, ``mixed`` when they differ, ``none`` for an empty sum."""
        out, schemas, n = cls(), set(), 0
        for d in dicts:
            n += 1
            schemas.add(d.get("schema", "unknown"))
            for k, v in d.items():
                if k == "schema":
                    continue
                if isinstance(v, dict):
                    counts = getattr(out, k)
                    for key, c in v.items():
                        counts[key] = counts.get(key, 0) + c
                else:
                    setattr(out, k, getattr(out, k) + v)
        out.schema = "none" if not n else schemas.pop() if len(schemas) == 1 else "mixed"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParseReport:
        return cls(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()})


@dataclass
class CanonicalRow:
    messages: list[Message]
    tools: list[dict] | None
    report: ParseReport


def map_fields(row: dict, mappings: dict[str, str]) -> dict:
    """``{canonical field: column}`` -> a new row that also has each column's value under its canonical name.

    >>> map_fields({"question": "q", "answer": "a"}, {"prompt": "question", "response": "answer"})
    {'question': 'q', 'answer': 'a', 'prompt': 'q', 'response': 'a'}
    """
    if not mappings:
        return row
    return {**row, **{canon: row[col] for canon, col in mappings.items() if col in row}}


def detect_schema(row: dict | list, cfg: DataConfig) -> str:
    """Which schema a row follows: one of ``CHAT_SCHEMAS`` / ``TEMPLATE_FREE_SCHEMAS`` or ``unknown``.

    A bare list is a list of messages; then, in order: a non-empty message list
    (ShareGPT when its items have from/value), ``segments``, ``input_ids``
    (pretokenized), instruction + output (alpaca), prompt + response keys, a
    ``text`` string.
    """
    if isinstance(row, list):
        return "messages"
    for key in (cfg.messages_field, *MESSAGE_KEYS):
        value = row.get(key)
        if isinstance(value, list) and value:
            first = value[0] if isinstance(value[0], dict) else {}
            return "sharegpt" if ("from" in first and "value" in first) else "messages"
    if isinstance(row.get("segments"), list):
        return "segments"
    if isinstance(row.get("input_ids"), list):
        return "pretokenized"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if any(k in row for k in PROMPT_KEYS) and any(k in row for k in RESPONSE_KEYS):
        return "prompt_response"
    if isinstance(row.get("text"), str):
        return "text"
    return "unknown"


def resolve_schema(row: dict | list, cfg: DataConfig) -> str:
    """``cfg.dataset_schema`` (``completion`` is ``text``), or the detected schema under ``auto``."""
    if cfg.dataset_schema == "auto":
        return detect_schema(row if isinstance(row, list) else map_fields(row, cfg.field_mappings), cfg)
    return "text" if cfg.dataset_schema == "completion" else cfg.dataset_schema


def content_text(value: Any, where: str) -> str:
    """A text value -> str, the one rule for message content and for every column that holds one text (SFT's
    prompt and response, a pair's prompt, chosen and rejected strings, instruction and input): a string as it is;
    null (or absent) is no content, ``""``; a list of ``{"type": "text"}`` parts joined; a mapping as JSON (a tool
    result object); a finite number as its text (a numeric CSV or Parquet column). Anything else (true/false,
    NaN, a list of other parts) is ``bad_content_type``.

    >>> content_text(None, "m"), content_text(5, "m"), content_text([{"type": "text", "text": "a"}], "m")
    ('', '5', 'a')
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if is_text_parts(value):
        return "".join(str(p.get("text", "")) for p in value)
    if has_image_parts(value):
        raise RowRejected(DropReason.BAD_IMAGE, f"{where}: an image content part where only text is read ("
                          f"{PREFERENCE_IMAGES}; in a chat row only message content holds images)")
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"{where}: content {value!r} is not a finite number")
        return str(value)
    raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"{where}: content of type {type(value).__name__}")


def is_text_parts(value: Any) -> bool:
    """A list of ``{"type": "text", "text": …}`` parts (OpenAI's content parts): one text, not messages."""
    return isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value)


IMAGE_PART_TYPES = frozenset({"image", "image_url"})  # OpenAI-style content parts that hold an image
PREFERENCE_IMAGES = ("images are read in a pair's or an unpaired row's prompt only (a prompt column with image "
                     "parts, placeholders or an images column), not in its responses or completion")


def has_image_parts(value: Any) -> bool:
    """A list of content parts of which at least one is an image (``{"type": "image" | "image_url"}``)."""
    return isinstance(value, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in value)


def row_image_column(row: dict, cfg: DataConfig) -> tuple[str, list] | None:
    """The row's images column: the first of ``cfg.image_columns`` with a value -> (its name, its images: a list, or
    one image as a list of one); None when the row has none (absent, null, empty)."""
    for column in cfg.image_columns:
        value = row.get(column)
        if value is None or value == [] or value == "":
            continue
        return column, value if isinstance(value, list) else [value]
    return None


def refuse_row_images(row: dict, cfg: DataConfig) -> None:
    """A row with an images column where none is read (an unpaired row; a pair without a prompt column) is refused
    (``bad_image``)."""
    found = row_image_column(row, cfg)
    if found is not None:
        raise RowRejected(DropReason.BAD_IMAGE, f"column '{found[0]}': {PREFERENCE_IMAGES}")


def _part_ref(part: dict) -> Any:
    """An image content part's own reference (None: it takes the next column image, TRL's ``{"type": "image"}``):
    ``image_url`` (``{"url": …}`` or a string), or the first of ``image`` / ``path`` / ``url``."""
    if part.get("type") == "image_url" and part.get("image_url"):
        value = part["image_url"]
        return value.get("url") if isinstance(value, dict) else value
    return next((part[k] for k in ("image", *REF_KEYS) if part.get(k)), None)


class RowImages:
    """One row's images, read as its messages are: an image content part with its own reference (``part``), one
    without (``part_from_column``) and each ``data.image_placeholder`` in message text (``placeholder``) take
    their image, the latter two the next one of the row's images column (``row_image_column``). Each image is
    resolved (relative paths against ``data.image_dir``), read and checked (``data.images.image_info``), and, for a
    tokenizer with an image rule, checked to be one the processor takes; counted by form in the report.
    ``finish`` checks the row as a whole."""

    # each form (counted in ``ParseReport.images``) in the words the dataset report uses
    FORMS = {"part": "named in message content parts",
             "part_from_column": "from the images column, placed by content parts without a reference",
             "placeholder": "from the images column, placed by placeholders in the text"}

    def __init__(self, row: dict, cfg: DataConfig, report: ParseReport, tokenizer=None,
                 spending: RowSpending | None = None):
        self.cfg, self.report, self.tokenizer, self.spending = cfg, report, tokenizer, spending
        found = row_image_column(row, cfg)
        if found is None:  # an images column that is there but empty ([], null, "") holds 0: its placeholders ask
            found = next(((column, []) for column in cfg.image_columns if column in row), None)
        self.column, self.pending = found if found is not None else (None, [])
        self.taken = 0  # column images asked for (more than the column holds: refused by ``finish``)
        self.read_any = False
        self.seen: dict[str, ImageInfo] = {}  # ref -> its info: an image referred to again is not read again
        self.pixels = 0  # of every image referred to so far, each reference counted (the batch decodes each)

    def read(self, value: Any, where: str, form: str) -> ImageInfo:
        """One image of the row, read inside the row's budget: its seconds looked at before and after it (one image
        costs at most ``data.max_image_pixels`` to decode; one referred to again is not read again), its pixels
        added to the row's, which ``data.max_row_image_pixels`` bounds."""
        ref = image_ref(value, self.cfg.image_dir, where, root=self.cfg.image_root)
        if self.spending is not None:
            self.spending.clock()
        info = self.seen.get(ref)
        if info is None:
            info = self.seen[ref] = self._checked(ref, where)
            if self.spending is not None:
                self.spending.clock()
        self.pixels += info["width"] * info["height"]
        if self.pixels > self.cfg.max_row_image_pixels:
            raise RowRejected(DropReason.OVER_BUDGET, f"{where}: the row's images hold {self.pixels:,} pixels > "
                              f"data.max_row_image_pixels={self.cfg.max_row_image_pixels:,}")
        _count(self.report.images, form)
        self.read_any = True
        return info

    def _checked(self, ref: str, where: str) -> ImageInfo:
        info = image_info(ref, max_pixels=self.cfg.max_image_pixels, check=self.cfg.image_check, where=where)
        rule = image_rule(self.tokenizer) if self.tokenizer is not None else None
        if rule is not None:
            try:
                rule.tokens(info["width"], info["height"])
            except RowRejected as rej:
                raise RowRejected(DropReason.BAD_IMAGE, f"{where}: {shown(info['ref'])}: the image processor "
                                  f"refuses it ({rej.detail})") from None
        return info

    def from_column(self, where: str, form: str) -> ImageInfo | None:
        k, self.taken = self.taken, self.taken + 1
        if k >= len(self.pending):
            return None
        return self.read(self.pending[k], f"{where} <- column '{self.column}'[{k}]", form)

    def from_parts(self, parts: list, where: str) -> tuple[str, list[ImageInfo]]:
        """Content parts -> (content with an ``IMAGE_SLOT`` per image, the images)."""
        pieces, images = [], []
        for j, part in enumerate(parts):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                pieces.append(content_text(part.get("text"), at))
            elif kind in IMAGE_PART_TYPES:
                ref = _part_ref(part)
                info = self.read(ref, at, "part") if ref is not None else self.from_column(at, "part_from_column")
                pieces.append(IMAGE_SLOT)
                images += [info] if info is not None else []
            else:
                what = repr(kind) if isinstance(part, dict) else type(part).__name__
                raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"{at}: a content part of type {what}")
        return "".join(pieces), images

    def from_placeholders(self, text: str, where: str) -> tuple[str, list[ImageInfo]]:
        """Text with ``data.image_placeholder`` -> (each placeholder an ``IMAGE_SLOT``, the next column images)."""
        placeholder = self.cfg.image_placeholder
        pieces, images = text.split(placeholder), []
        for k in range(1, len(pieces)):
            info = self.from_column(f"{where} {placeholder} #{k - 1}", "placeholder")
            images += [info] if info is not None else []
        return IMAGE_SLOT.join(pieces), images

    def finish(self, messages: list[Message]) -> None:
        """The row's images as a whole: every column image placed, none asked for beyond them, and in a row with
        images no other ``IMAGE_SLOT`` than the images' own (a literal U+FFFC in the row's text)."""
        if self.taken != len(self.pending):
            places = f"{self.cfg.image_placeholder!r} placeholders and image parts without a reference"
            holds = (f"column '{self.column}' holds {len(self.pending)}" if self.column is not None else
                     f"the row has no images column (data.image_columns: {list(self.cfg.image_columns)})")
            raise RowRejected(DropReason.BAD_IMAGE, f"{self.taken} image(s) asked for ({places}), but {holds}")
        if not self.read_any:
            return
        self.report.image_rows = 1
        for i, m in enumerate(messages):
            slots, n = m["content"].count(IMAGE_SLOT), len(m.get("images", ()))
            if slots > n or IMAGE_SLOT in m.get("reasoning_content", ""):
                raise RowRejected(DropReason.BAD_IMAGE, f"messages[{i}]: the text holds U+FFFC (the object "
                                  "replacement character), which marks where an image sits: not in a row with images")
            if slots < n:
                raise RowRejected(DropReason.BAD_IMAGE, f"messages[{i}]: an image inside the reasoning block "
                                  f"({n} image(s), {slots} in the content)")


def check_user_turns(messages: list[Message], where: str = "messages") -> None:
    """A user turn must say something: one without content (null, absent, ``""`` or only whitespace) is refused as
    ``empty_user_turn``, in chat rows and in a pair's prompt alike (a response to nothing is not an answer)."""
    for i, m in enumerate(messages):
        if m["role"] == "user" and not m["content"].strip():
            raise RowRejected(DropReason.EMPTY_USER_TURN, f"{where}[{i}]: a user turn without content (nothing "
                              "for a response to answer)")


def _tool_calls(value: Any, where: str) -> list[dict]:
    if isinstance(value, str):
        try:
            value = read_json(value)
        except ValueError as exc:
            raise RowRejected(DropReason.BAD_ROW, f"{where}: tool_calls is a string that is not JSON ({exc})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RowRejected(DropReason.BAD_ROW, f"{where}: tool_calls must be a list")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RowRejected(DropReason.BAD_ROW, f"{where}.tool_calls[{j}]: needs a function name")
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = read_json(args)
            except JSONLimitError as exc:  # JSON, but none that Python (or the template) can read
                raise RowRejected(DropReason.BAD_ROW, f"{where}.tool_calls[{j}]: arguments: {exc}") from None
            except ValueError:
                pass  # keep the string as written; templates print strings verbatim
        out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            out["id"] = call["id"]
        calls.append(out)
    return calls


def _split_inline_think(content: str) -> tuple[str | None, str, bool]:
    """'<think>r</think>answer' -> ('r', 'answer', balanced). No tags -> (None, content, True)."""
    if THINK_CLOSE not in content:
        return None, content, THINK_OPEN not in content
    head, _, answer = content.partition(THINK_CLOSE)
    stripped = head.lstrip()
    if stripped.startswith(THINK_OPEN):
        head = stripped[len(THINK_OPEN):]
    elif THINK_OPEN in head:  # text before <think>: not a leading reasoning block
        return None, content, False
    return head.strip("\n"), answer.lstrip("\n"), True


def _fill(fmt: str, instruction: str, inp: str) -> str:
    return fmt.replace("{instruction}", instruction).replace("{input}", inp)


def instruction_prompt(row: dict, cfg: DataConfig) -> str:
    """instruction + optional input -> the user turn text (``format`` / ``no_input_format``)."""
    instruction = content_text(row.get("instruction"), "field 'instruction'")
    inp = content_text(row.get("input"), "field 'input'")
    if inp.strip():
        return _fill(cfg.format, instruction, inp) if cfg.format else f"{instruction}\n\n{inp}"
    fmt = cfg.no_input_format or cfg.format
    return _fill(fmt, instruction, "") if fmt else instruction


def _raw_messages(row: dict, schema: str, cfg: DataConfig) -> list[dict]:
    if schema in ("messages", "sharegpt"):
        for key in (cfg.messages_field, *MESSAGE_KEYS):
            if isinstance(row.get(key), list) and row[key]:
                return row[key]
        raise RowRejected(DropReason.NO_MESSAGES, f"no non-empty list under '{cfg.messages_field}'")
    if schema == "alpaca":
        if "instruction" not in row or "output" not in row:
            raise RowRejected(DropReason.UNKNOWN_SCHEMA,
                              f"alpaca needs 'instruction' and 'output', got {sorted(row)[:8]}")
        prompt, response = instruction_prompt(row, cfg), row["output"]
    else:
        prompt_key = next((k for k in PROMPT_KEYS if k in row), None)
        response_key = next((k for k in RESPONSE_KEYS if k in row), None)
        if prompt_key is None or response_key is None:
            raise RowRejected(DropReason.UNKNOWN_SCHEMA, f"prompt_response needs one of {PROMPT_KEYS} and one of "
                              f"{RESPONSE_KEYS}, got {sorted(row)[:8]}")
        prompt, response = row[prompt_key], row[response_key]
    answer = {"role": "assistant", "content": response}
    answer.update({k: row[k] for k in cfg.reasoning_keys if k in row})  # row-level reasoning belongs to the answer
    return [{"role": "user", "content": prompt}, answer]


SYSTEM_COLUMN = "system"  # a row's system prompt, read for every schema (chat rows, pairs, unpaired rows)


def with_row_system(messages: list[Message], row: dict, cfg: DataConfig, report: ParseReport, *,
                    schema: str = "messages") -> list[Message]:
    """The row's ``system`` column (another column through ``data.field_mappings: {system: …}``) as a system message
    first in ``messages``, unless they have a system message of their own: then theirs is kept, and a column that
    says something else is counted as a conflict (``system_column_conflicts``), never dropped silently. The one
    place the column is read, for chat rows of every schema, a pair's prompt and an unpaired row's prompt. Its
    value is a text (``content_text``: a string, text parts, a number); absent, null or ``""`` is none. The
    message's role is what a ``system`` message of the row is mapped to (``data.roles``).

        >>> row = {"system": "Be brief.", "conversations": []}
        >>> with_row_system([{"role": "user", "content": "Hi"}], row, DataConfig(), ParseReport())
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi'}]
    """
    value = row.get(SYSTEM_COLUMN)
    if value is None or value == "":
        return messages
    text = content_text(value, f"column '{SYSTEM_COLUMN}'")
    own = next((m for m in messages if m["role"] == "system"), None)
    if own is not None:
        if own["content"].strip() != text.strip():
            report.system_column_conflicts += 1
        return messages
    report.system_from_column += 1
    role = _role_aliases(schema, cfg).get("system", "system")
    return [{"role": role, "content": text}, *messages]


def _role_aliases(schema: str, cfg: DataConfig) -> dict[str, str]:
    """Name in the data -> canonical role: ShareGPT's defaults (for sharegpt), then ``cfg.roles``."""
    aliases = dict(SHAREGPT_ROLES) if schema == "sharegpt" else {}
    for canonical, names in cfg.roles.items():
        aliases.update({name.lower(): canonical for name in names})
    return aliases


def _message_override(raw: dict, where: str) -> bool | None:
    """A message's own ``training`` (bool) or ``weight`` (0/1) -> trained or not; None when absent."""
    for key in ("training", "weight"):
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        raise RowRejected(DropReason.BAD_ROW, f"{where}.{key}: expected true/false or 0/1, got {value!r}")
    return None


@dataclass(frozen=True)
class _MessageRules:
    """What ``_message`` needs from the config, worked out once per row."""

    schema: str
    props: dict[str, dict[str, str]]  # style -> {canonical key: key in the data}
    renames: dict[str, dict[str, str]]  # style -> the props whose key differs from the canonical one
    consumed: dict[str, frozenset[str]]  # style -> data keys read by a rename (dropped under their own name)
    aliases: dict[str, str]
    reasoning_keys: tuple[str, ...]
    think_roles: frozenset[str]  # roles whose inline <think> blocks are extracted

    @classmethod
    def of(cls, schema: str, cfg: DataConfig) -> _MessageRules:
        props = {style: {**DEFAULT_PROPERTIES[style], **cfg.message_property_mappings}
                 for style in ("messages", "sharegpt")}
        renames = {style: {c: k for c, k in p.items() if c != k} for style, p in props.items()}
        consumed = {style: frozenset(r.values()) - frozenset(r) for style, r in renames.items()}
        return cls(schema, props, renames, consumed, _role_aliases(schema, cfg), tuple(cfg.reasoning_keys),
                   frozenset(cfg.assistant_roles) if cfg.extract_think_tags else frozenset())


_OPTIONAL_KEYS = frozenset({"training", "weight", "tool_calls", "name", "tool_call_id"})


def _message(raw: Any, i: int, rules: _MessageRules, report: ParseReport, images: RowImages | None) -> Message:
    if not isinstance(raw, dict):
        raise RowRejected(DropReason.BAD_ROW, f"messages[{i}]: expected a mapping, got {type(raw).__name__}")
    style = "sharegpt" if rules.schema == "sharegpt" or ("role" not in raw and "from" in raw) else "messages"
    renames = rules.renames[style]
    if renames:  # a field a mapping consumes is not also kept under its own name (content from 'name')
        mapped = {canon: raw[key] for canon, key in renames.items() if key in raw}
        raw = {**{k: v for k, v in raw.items() if k not in rules.consumed[style]}, **mapped}
    role, content = raw.get("role"), raw.get("content")
    if style == "sharegpt" and "content" not in raw and "value" in raw:
        content = raw["value"]
    key = rules.props[style]["role"]
    if role is not None and not isinstance(role, str):
        raise RowRejected(DropReason.BAD_ROW, f"messages[{i}]: the role (key '{key}') is not a string: "
                          f"{type(role).__name__} {str(role)[:40]}")
    if not role:
        raise RowRejected(DropReason.BAD_ROW, f"messages[{i}]: missing role (key '{key}')")
    if rules.aliases:
        role = rules.aliases.get(role.lower(), role)
    found: list[ImageInfo] = []
    if not isinstance(content, str):
        if images is not None and has_image_parts(content):
            content, found = images.from_parts(content, f"messages[{i}]")
        else:
            content = content_text(content, f"messages[{i}]")
    elif images is not None and images.column is not None and images.cfg.image_placeholder in content:
        content, found = images.from_placeholders(content, f"messages[{i}]")
    msg: Message = {"role": role, "content": content}
    if found:
        msg["images"] = found
    if role not in KNOWN_ROLES:
        _count(report.unknown_roles, role)
        if role not in _warned_roles:
            _warned_roles.add(role)
            log.warning("unknown role %r kept as is (first seen at messages[%d])", role, i)
    for key in rules.reasoning_keys:
        value = raw.get(key)
        if isinstance(value, str) and value.strip():
            msg["reasoning_content"] = value
            _count(report.moved_reasoning_keys, key)
            break
    if not _OPTIONAL_KEYS.isdisjoint(raw):
        override = _message_override(raw, f"messages[{i}]")
        if override is not None:
            msg["train"] = override
        if raw.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(raw["tool_calls"], f"messages[{i}]")
        for key in ("name", "tool_call_id"):
            if isinstance(raw.get(key), str):
                msg[key] = raw[key]
    if role in rules.think_roles:
        reasoning, answer, balanced = _split_inline_think(msg["content"])
        if not balanced:
            report.unbalanced_think_tags += 1
        if reasoning is not None:
            msg["content"] = answer
            report.extracted_think_from_content += 1
            if "reasoning_content" not in msg and reasoning.strip():
                msg["reasoning_content"] = reasoning
    return msg


def row_tools(row: dict, cfg: DataConfig, report: ParseReport) -> list[dict] | None:
    """The row's tools: the first non-empty column of ``cfg.tools_columns`` (a JSON string is parsed)."""
    for column in cfg.tools_columns:
        value = row.get(column)
        if value is None or value == "" or value == []:
            continue
        if isinstance(value, str):
            try:
                value = read_json(value)
            except ValueError as exc:
                raise RowRejected(DropReason.TOOLS_UNPARSEABLE, f"column '{column}': {exc}") from None
            report.tools_parsed_from_string += 1
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            raise RowRejected(DropReason.TOOLS_UNPARSEABLE, f"column '{column}': expected a list of objects")
        report.tools_present += 1
        return value
    return None


def _cap_reasoning(text: str, max_tokens: int, tokenizer) -> str:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if len(enc["input_ids"]) <= max_tokens:
        return text
    return text[: enc["offset_mapping"][max_tokens - 1][1]]


def canonicalize_row(row: dict | list, cfg: DataConfig | None = None, *, tokenizer=None,
                     policy: LossPolicy | None = None, spending: RowSpending | None = None) -> CanonicalRow:
    """Raw row -> ``CanonicalRow(messages, tools, report)``.

    Applies ``field_mappings``, detects the schema (or uses
    ``cfg.dataset_schema``), maps message keys and roles, moves reasoning
    fields into ``reasoning_content``, extracts inline think blocks, applies
    ``think_mode`` / ``think_max_tokens`` (needs ``tokenizer``), finds tools in
    the first matching tools column, reads the row's images (``RowImages``:
    image content parts, ``<image>`` placeholders, the images column; each an
    ``IMAGE_SLOT`` in its message's content and an ``ImageInfo`` in its
    ``images``; checked against ``tokenizer``'s image rule when it has one; each read inside ``spending``, the
    row's budget, when given), puts the row's ``system`` column first unless the conversation has its own
    (``with_row_system``), and marks every message with its ``train``
    flag (``LossPolicy.mark``; ``policy`` defaults to ``LossPolicy.of(cfg)``):
    the one place that decides which messages are trained. A bare list is a
    list of messages.
    """
    cfg = cfg or DataConfig()
    if isinstance(row, list):
        row = {cfg.messages_field: row}
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"row is a {type(row).__name__}, not a mapping")
    row = map_fields(row, cfg.field_mappings)
    schema = resolve_schema(row, cfg)
    report = ParseReport(schema=schema, schemas={schema: 1}, rows=1)
    if schema == "unknown":
        raise RowRejected(DropReason.UNKNOWN_SCHEMA, f"no known schema among keys {sorted(row)[:8]}")
    if schema not in CHAT_SCHEMAS:
        raise RowRejected(DropReason.UNKNOWN_SCHEMA, f"schema {schema!r} is template-free: it has no messages")
    messages = canonical_messages(_raw_messages(row, schema, cfg), cfg, report, schema=schema, tokenizer=tokenizer,
                                  images=RowImages(row, cfg, report, tokenizer, spending))
    messages = with_row_system(messages, row, cfg, report, schema=schema)
    messages = (policy or LossPolicy.of(cfg)).mark(messages)
    trained = [i for i, m in enumerate(messages) if m["train"]]
    if not trained:
        rule = f"mask rules {cfg.mask}" if cfg.mask is not None else f"a role in {list(cfg.assistant_roles)}"
        raise RowRejected(DropReason.NO_ASSISTANT_TURN, f"no trained message ({rule})")
    for i in trained:
        m = messages[i]
        if not m["content"].strip() and not m.get("tool_calls") and not m.get("reasoning_content"):
            raise RowRejected(DropReason.EMPTY_ASSISTANT, f"messages[{i}]: empty {m['role']} turn without tool calls")
    tools = row_tools(row, cfg, report)
    return CanonicalRow(messages=messages, tools=tools, report=report)


def canonical_messages(raw: list, cfg: DataConfig, report: ParseReport, *, schema: str = "messages",
                       tokenizer=None, images: RowImages | None = None) -> list[Message]:
    """A row's raw message list -> canonical Messages, not yet marked (no ``train`` flag unless a message's
    own ``training`` / ``weight`` sets one).

    Message keys and roles mapped (``message_property_mappings``, ``roles``, ShareGPT's names under
    ``schema='sharegpt'``), content made text, reasoning keys moved into ``reasoning_content``, inline
    ``<think>`` blocks extracted, tool calls normalised, then ``think_mode`` / ``think_max_tokens`` applied
    (the latter needs ``tokenizer``). What the row's messages and a preference pair's prompt and responses
    (``pairs.canonicalize_pair``) both go through. With ``images`` (a chat row's ``RowImages``), image content
    parts and placeholders become ``IMAGE_SLOT``s and ``images``; without, an image content part is refused
    (``bad_image``: not supported in preference rows yet).

        >>> canonical_messages([{"from": "gpt", "value": "<think>r</think>a"}], DataConfig(), ParseReport(),
        ...                    schema="sharegpt")
        [{'role': 'assistant', 'content': 'a', 'reasoning_content': 'r'}]
    """
    rules = _MessageRules.of(schema, cfg)
    messages = [_message(m, i, rules, report, images) for i, m in enumerate(raw)]
    if images is not None:
        images.finish(messages)
    check_user_turns(messages)
    if cfg.think_mode == "drop":
        for m in messages:
            if m.pop("reasoning_content", None) is not None:
                report.dropped_think_messages += 1
    elif cfg.think_max_tokens > 0:
        if tokenizer is None:
            raise ValueError("think_max_tokens needs a tokenizer")
        for m in messages:
            if "reasoning_content" in m:
                capped = _cap_reasoning(m["reasoning_content"], cfg.think_max_tokens, tokenizer)
                if capped != m["reasoning_content"]:
                    m["reasoning_content"] = capped
                    report.think_capped_messages += 1
    return messages
