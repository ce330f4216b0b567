"""Tool calls read from generated text, in the template's own call format, found by rendering known calls.

The model writes a call the way its chat template writes one: ``probe_call_format(tokenizer)`` renders a few
assistant turns with known calls (a name and arguments no real text holds) and reads the format off the text the
template writes for them; ``parse_calls(text, format)`` then reads the calls out of a completion. Three kinds of
call cover the families we test (tests/rl/test_tool_calls.py):

- ``json``: a JSON value after an opener: one call object (``<tool_call>{"name": .., "arguments": {..}}``), a list
  of them (Mistral's ``[TOOL_CALLS][{..}]``, Command R7B's action list), the name and arguments found at their
  keys anywhere inside each element (a ``function`` object inside, as OpenAI's);
- ``name_json``: the name, then JSON arguments (DeepSeek's ``<｜tool▁sep｜>NAME\\n```json\\n{..}``,
  harmony's ``to=functions.NAME<|channel|>commentary json<|message|>{..}``, ``[TOOL_CALLS]NAME[ARGS]{..}``);
- ``name_xml``: the name, then each argument between key and value markers (GLM 4.5's
  ``<tool_call>NAME<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>``).

Each kind is the opener (``prefix``: what opens a call, or the list of calls), what stands between the name and the
arguments (``middle``), and the closer (``suffix``). Whitespace around the pieces is the model's to choose; the
pieces themselves must be written as the template writes them.

A template whose calls the probe cannot read (it writes none, or its own renders do not parse back to the calls it
was given) refuses the run at start (``CallFormatError``, naming the template and ``rl.tool_call_format``, where
the format may be declared with the fields of ``CallFormat``).

    >>> f = CallFormat("json", prefix="<tool_call>", suffix="</tool_call>")
    >>> parse_calls('Let me add.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>', f)
    ParsedCalls(content='Let me add.', calls=({'name': 'add', 'arguments': {'a': 1}},), error=None)
    >>> parse_calls('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', f).error
    "call 1: its JSON does not parse (Expecting ',' delimiter at 36)"
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal, NamedTuple

from qlora_train.errors import QloraError
from qlora_train.masking import TEMPLATE_ERRORS, call_template, template_layout

CallKind = Literal["json", "name_json", "name_xml"]
CALL_KINDS = ("json", "name_json", "name_xml")
NAME = re.compile(r"[A-Za-z_][\w.\-]*")

# the probe's calls: names and values no real text holds
_NAMES = ("qlora_probe_alpha", "qlora_probe_beta")
_VALUES = ("qlora probe value one", "qlora probe value two")
_CONTENT = "qlora probe content"
_USER = [{"role": "user", "content": "qlora probe question"}]


class CallFormatError(QloraError):
    """The template's tool call format cannot be read (or a declared one does not read its renders): exit 2."""

    exit_code = 2


@dataclass(frozen=True)
class CallFormat:
    """How a template writes a tool call (see the module doc); ``rl.tool_call_format`` declares one with these
    fields."""

    kind: CallKind
    prefix: str  # what opens a call (json: the call or the list of calls); '' only for json: the turn starts with it
    suffix: str = ""  # what closes it ('' when nothing does)
    middle: str = ""  # name_json, name_xml: between the name and the arguments
    name_key: str = "name"  # json: the key of the function's name
    arguments_key: str = "arguments"  # json: the key of its arguments (an object, or a JSON string of one)
    key_open: str = ""  # name_xml: before an argument's name
    key_close: str = ""  # name_xml: between an argument's name and its value
    value_close: str = ""  # name_xml: after its value
    arguments_as_string: bool = False  # the template takes arguments as a JSON string (DeepSeek)
    lead: str = ""  # what the template writes before the first call's opener in a turn without content (DeepSeek's
    # calls_begin): not content

    def __post_init__(self):
        if self.kind not in CALL_KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {', '.join(CALL_KINDS)}")
        if self.kind != "json" and not self.prefix.strip():
            raise ValueError(f"prefix: a {self.kind} call needs the text that opens it")
        if self.kind == "name_xml" and not (self.key_open.strip() and self.key_close.strip()
                                            and self.value_close.strip()):
            raise ValueError("name_xml needs key_open, key_close and value_close")

    def as_dict(self) -> dict:
        return asdict(self)


class ParsedCalls(NamedTuple):
    """A completion read: the text before its first call (``content``), its calls (``{"name", "arguments"}``), and
    why it is malformed (``error``; None when every call parsed)."""

    content: str
    calls: tuple[dict, ...]
    error: str | None = None


# ------------------------------------------------------------------------------------------------ parsing


def parse_calls(text: str, fmt: CallFormat) -> ParsedCalls:
    """Generated text -> its content before the first call, its calls, or the first malformed call's error."""
    opener = fmt.prefix.strip()
    starts = _call_starts(text, opener) if opener else ([0] if text.lstrip()[:1] in ("{", "[") else [])
    if not starts:
        return ParsedCalls(text, ())
    content = text[:starts[0]].rstrip() if opener else ""
    lead = fmt.lead.strip()
    content = content[:-len(lead)].rstrip() if lead and content.endswith(lead) else content
    calls: list[dict] = []
    closer = fmt.suffix.strip()
    for start in starts:
        at = start + len(opener) if opener else len(text) - len(text.lstrip())
        if closer and text.startswith(closer, _skip_space(text, at)):  # an empty call block: no call
            continue
        reader = {"json": _read_json, "name_json": _read_name_json, "name_xml": _read_name_xml}[fmt.kind]
        try:
            found, at = reader(text, at, fmt)
        except _Malformed as exc:
            return ParsedCalls(content, tuple(calls), f"call {len(calls) + 1}: {exc}")
        if closer:
            at = _skip_space(text, at)
            if not text.startswith(closer, at):
                return ParsedCalls(content, tuple(calls), f"call {len(calls) + 1}: not closed by {closer!r}")
        calls += found
    return ParsedCalls(content, tuple(calls))


class _Malformed(ValueError):
    pass


def _call_starts(text: str, opener: str) -> list[int]:
    return [m.start() for m in re.finditer(re.escape(opener), text)]


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _literal(text: str, at: int, piece: str, what: str) -> int:
    """Past ``piece`` (whitespace around it free) at ``at``, or ``_Malformed``."""
    piece = piece.strip()
    at = _skip_space(text, at)
    if piece and not text.startswith(piece, at):
        raise _Malformed(f"expected {piece!r} {what}, found {text[at:at + 20]!r}")
    return at + len(piece)


def _decode_json(text: str, at: int) -> tuple[Any, int]:
    at = _skip_space(text, at)
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except json.JSONDecodeError as exc:
        raise _Malformed(f"its JSON does not parse ({exc.msg} at {exc.pos - at})") from None


def _arguments(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _Malformed("its arguments are a string that is not JSON") from None
    if not isinstance(value, dict):
        raise _Malformed(f"its arguments are a {type(value).__name__}, not an object")
    return value


def _find_call(value: Any, fmt: CallFormat) -> dict | None:
    """The first object (depth first) holding ``name_key``: the call."""
    if isinstance(value, dict):
        if isinstance(value.get(fmt.name_key), str):
            return value
        inner = (_find_call(v, fmt) for v in value.values())
    elif isinstance(value, list):
        inner = (_find_call(v, fmt) for v in value)
    else:
        return None
    return next((c for c in inner if c is not None), None)


def _read_json(text: str, at: int, fmt: CallFormat) -> tuple[list[dict], int]:
    value, at = _decode_json(text, at)
    values = value if isinstance(value, list) else [value]
    while text[_skip_space(text, at):_skip_space(text, at) + 1] == "{":  # calls back to back (Llama 4's)
        more, at = _decode_json(text, at)
        values.append(more)
    calls = []
    for element in values:
        call = _find_call(element, fmt)
        if call is None:
            raise _Malformed(f"no {fmt.name_key!r} key in {json.dumps(element)[:60]}")
        if not NAME.fullmatch(call[fmt.name_key]):
            raise _Malformed(f"{call[fmt.name_key]!r} is not a function name")
        found = {"name": call[fmt.name_key], "arguments": _arguments(call.get(fmt.arguments_key, {}))}
        if isinstance(call.get("id"), str):  # a call id the model writes (Mistral's): the one its result answers
            found["id"] = call["id"]
        calls.append(found)
    if not calls:
        raise _Malformed("an empty list of calls")
    return calls, at


def _read_name(text: str, at: int) -> tuple[str, int]:
    m = NAME.match(text, _skip_space(text, at))
    if m is None:
        raise _Malformed(f"no function name at {text[at:at + 20]!r}")
    return m.group(0), m.end()


def _read_name_json(text: str, at: int, fmt: CallFormat) -> tuple[list[dict], int]:
    name, at = _read_name(text, at)
    at = _literal(text, at, fmt.middle, "after the name")
    value, at = _decode_json(text, at)
    return [{"name": name, "arguments": _arguments(value)}], at


def _read_name_xml(text: str, at: int, fmt: CallFormat) -> tuple[list[dict], int]:
    name, at = _read_name(text, at)
    at = _literal(text, at, fmt.middle, "after the name")
    arguments: dict[str, Any] = {}
    key_open, key_close, value_close = fmt.key_open.strip(), fmt.key_close.strip(), fmt.value_close.strip()
    while text.startswith(key_open, _skip_space(text, at)):
        at = _skip_space(text, at) + len(key_open)
        end = text.find(key_close, at)
        if end < 0:
            raise _Malformed(f"an argument name not closed by {key_close!r}")
        key, at = text[at:end].strip(), end + len(key_close)
        end = text.find(value_close, at)
        if end < 0:
            raise _Malformed(f"the value of {key!r} not closed by {value_close!r}")
        raw, at = text[at:end], end + len(value_close)
        try:  # as the templates write them: strings as they are, anything else as JSON
            arguments[key] = json.loads(raw)
        except json.JSONDecodeError:
            arguments[key] = raw
    return [{"name": name, "arguments": arguments}], at


# ------------------------------------------------------------------------------------------------ the probe


def _call(name: str, value: str, as_string: bool) -> dict:
    arguments = {"x": value}
    return {"type": "function", "id": f"qlora000{_NAMES.index(name) + 1}",
            "function": {"name": name, "arguments": json.dumps(arguments) if as_string else arguments}}


def _schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": "qlora probe tool", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


def _render(tokenizer, messages, *, gen=False) -> str | None:
    try:
        return call_template(tokenizer.apply_chat_template, messages, tools=[_schema(n) for n in _NAMES],
                             tokenize=False, add_generation_prompt=gen)
    except TEMPLATE_ERRORS:
        return None


def _common_suffix(texts: list[str]) -> str:
    n = len(os.path.commonprefix([t[::-1] for t in texts]))
    return texts[0][len(texts[0]) - n:] if n else ""


def _json_value_around(text: str, at: int, lo: int) -> tuple[int, int, Any] | None:
    """The outermost JSON value starting at or after ``lo`` that spans position ``at``: (start, end, value)."""
    best = None
    for start in range(at, lo - 1, -1):
        if text[start] not in "{[":
            continue
        try:
            value, end = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError:
            continue
        if end > at:
            best = (start, end, value)
    return best


def _holds(value: Any, name: str) -> tuple[str, str] | None:
    """(name key, arguments key) of the object in ``value`` whose value at some key is ``name``."""
    if isinstance(value, dict):
        for key, v in value.items():
            if v == name:
                args = next((k for k, a in value.items() if k != key and (isinstance(a, dict) or (
                    isinstance(a, str) and a.startswith("{")))), None)
                return (key, args) if args else None
        inner = value.values()
    elif isinstance(value, list):
        inner = value
    else:
        return None
    return next((h for h in (_holds(v, name) for v in inner) if h), None)


def _cut_at_end(text: str, end_markers: tuple[str, ...]) -> str:
    cut = min((text.find(m) for m in end_markers if m and m in text), default=len(text))
    return text[:cut]


def probe_call_format(tokenizer) -> CallFormat | None:
    """The template's call format, read off renders of known calls (see the module doc); None when the template
    writes no calls or writes them in a way none of the kinds reads back."""
    layout = template_layout(tokenizer)
    as_string = layout.tool_arguments_as_string
    one = [_call(_NAMES[0], _VALUES[0], as_string)]
    two = [*one, _call(_NAMES[1], _VALUES[1], as_string)]
    prompt = _render(tokenizer, _USER, gen=True)
    renders = {k: _render(tokenizer, _USER + [{"role": "assistant", "content": c, "tool_calls": calls}])
               for k, c, calls in (("one", _CONTENT, one), ("bare", "", one), ("two", _CONTENT, two))}
    if prompt is None or any(r is None or _NAMES[0] not in r for r in renders.values()):
        return None
    start = {k: len(os.path.commonprefix([prompt, r])) for k, r in renders.items()}
    for k, r in renders.items():  # past the content, where the template writes it before the calls
        at = r.find(_CONTENT, start[k])
        if 0 <= at < r.find(_NAMES[0], start[k]):
            start[k] = at + len(_CONTENT)
    fmt = _json_format(renders, start, as_string, layout.end_markers) or _name_format(
        renders, start, as_string, layout.end_markers)
    if fmt is None:
        return None
    return fmt if _reads_back(renders["two"][start["two"]:], fmt) else None


def _json_format(renders, start, as_string, end_markers) -> CallFormat | None:
    spans = {}
    for k, r in renders.items():
        found = _json_value_around(r, r.find(_NAMES[0], start[k]), start[k])
        if found is None or _holds(found[2], _NAMES[0]) is None:
            return None
        spans[k] = found
    name_key, arguments_key = _holds(spans["one"][2], _NAMES[0])
    befores = [renders[k][start[k]:spans[k][0]] for k in renders]
    afters = [_cut_at_end(renders[k][spans[k][1]:], end_markers) for k in ("one", "bare")]
    two, (_, e2, value2) = renders["two"], spans["two"]
    if _holds(value2, _NAMES[1]) is None:  # one value a call: the second call has an opener of its own
        second = _json_value_around(two, two.find(_NAMES[1], e2), e2)
        if second is None:
            return None
        befores.append(two[e2:second[0]])
        afters.append(_cut_at_end(two[second[1]:], end_markers))
    if len(befores) == 4 and not befores[-1].strip():  # calls back to back: nothing opens the second
        befores.pop()
    prefix = _common_suffix(befores)
    suffix = os.path.commonprefix(afters)
    if len(befores) == 4:  # the text between two calls: the closer, then the opener
        suffix = os.path.commonprefix([suffix, befores[-1]])
    opener = _distinct_tail(prefix, renders, start)
    return CallFormat("json", prefix=opener, lead=_lead(befores[:2], opener), suffix=suffix.strip(), name_key=name_key,
                      arguments_key=arguments_key, arguments_as_string=as_string)


def _name_format(renders, start, as_string, end_markers) -> CallFormat | None:
    one = renders["one"]
    at = one.find(_NAMES[0], start["one"])
    after = one[at + len(_NAMES[0]):]
    brace = after.find("{")
    value_at = after.find(_VALUES[0])
    if 0 <= brace < value_at:
        try:
            value, _ = json.JSONDecoder().raw_decode(after, brace)
        except json.JSONDecodeError:
            value = None
        if value == {"x": _VALUES[0]}:
            return _name_json(renders, start, as_string, end_markers, middle=after[:brace])
    key_at = after.find("x")
    if 0 <= key_at < value_at:
        return _name_xml(renders, start, end_markers, after, key_at, value_at)
    return None


def _between_calls(renders, start) -> tuple[list[str], str]:
    """The texts before each first call's name, and the text of the two-call render from the first value's end."""
    befores = [renders[k][start[k]:renders[k].find(_NAMES[0], start[k])] for k in renders]
    two = renders["two"]
    first = two[two.find(_VALUES[0]) + len(_VALUES[0]):]
    return befores, first


def _name_json(renders, start, as_string, end_markers, middle: str) -> CallFormat | None:
    befores, first = _between_calls(renders, start)
    tail = first[first.find("}") + 1:]  # after the first call's arguments
    name2 = tail.find(_NAMES[1])
    one = renders["one"]
    closers = [_cut_at_end(one[one.find("}", one.find(_VALUES[0])) + 1:], end_markers)]
    if name2 >= 0:  # (a template that writes one call per message, harmony, has no text between two)
        befores.append(tail[:name2])
        closers.append(tail[:name2])
    prefix = _distinct_tail(_common_suffix(befores), renders, start)
    suffix = os.path.commonprefix(closers)
    return CallFormat("name_json", prefix=prefix, lead=_lead(befores[:2], prefix), middle=middle.strip(),
                      suffix=suffix.strip(), arguments_as_string=as_string)


def _name_xml(renders, start, end_markers, after: str, key_at: int, value_at: int) -> CallFormat | None:
    befores, first = _between_calls(renders, start)
    name2 = first.find(_NAMES[1])
    if name2 < 0:
        return None
    befores.append(first[:name2])
    one = renders["one"]
    closing = _cut_at_end(one[one.find(_VALUES[0]) + len(_VALUES[0]):], end_markers)
    prefix = _distinct_tail(_common_suffix(befores), renders, start)
    closed = closing.lstrip()
    value_close = closed[:min((closed.find(c) + 1 for c in ">]" if c in closed), default=len(closed))]
    suffix = os.path.commonprefix([closing, first[:name2]]).lstrip()[len(value_close):]
    between = after[:key_at]  # the name's close and the key's opener: split at the last marker or line
    split = max(between.rfind("\n"), between.rfind(">"))
    middle, key_open = (between[:split + 1], between[split + 1:]) if split >= 0 and between[split + 1:].strip() \
        else ("", between)
    return CallFormat("name_xml", prefix=prefix, lead=_lead(befores[:2], prefix), middle=middle.strip(),
                      suffix=suffix.strip(), key_open=key_open.strip(), key_close=after[key_at + 1:value_at].strip(),
                      value_close=value_close.strip())


def _distinct_tail(prefix: str, renders: dict, start: dict) -> str:
    """The shortest end of ``prefix`` that starts at a marker (``<``, ``[``) and is written once in the one-call
    turn: the opener of a call, without the text a template writes before it for other reasons (an empty
    reasoning block, the content's closer)."""
    prefix = prefix.strip()
    one = renders["one"][start["one"]:]
    for at in sorted((i for i, c in enumerate(prefix) if c in "<[" and prefix[i - 1:i] != c), reverse=True):
        tail = prefix[at:].strip()
        if tail and one.count(tail) == 1:
            return tail
    return prefix


def _lead(befores: list[str], opener: str) -> str:
    """What the template writes before the first call's opener in a turn without content."""
    bare = befores[1].strip()
    return bare[:-len(opener)].strip() if opener and bare.endswith(opener) else ""


def _reads_back(generated: str, fmt: CallFormat) -> bool:
    try:
        parsed = parse_calls(generated, fmt)
    except ValueError:
        return False
    want = [{"name": n, "arguments": {"x": v}} for n, v in zip(_NAMES, _VALUES, strict=True) if n in generated]
    got = [{"name": c["name"], "arguments": c["arguments"]} for c in parsed.calls]
    return parsed.error is None and got == want


def call_format(tokenizer, declared: dict | None = None, *, template_name: str = "the model's") -> CallFormat:
    """The run's call format: the declared one (``rl.tool_call_format``), checked against the template's renders
    of known calls, or the probed one; ``CallFormatError`` when neither reads them."""
    if declared:
        try:
            fmt = CallFormat(**declared)
        except (TypeError, ValueError) as exc:
            raise CallFormatError(f"rl.tool_call_format: {exc}") from None
        layout = template_layout(tokenizer)
        two = [_call(n, v, fmt.arguments_as_string) for n, v in zip(_NAMES, _VALUES, strict=True)]
        prompt = _render(tokenizer, _USER, gen=True)
        render = _render(tokenizer, _USER + [{"role": "assistant", "content": _CONTENT, "tool_calls": two}])
        if prompt is None or render is None:
            raise CallFormatError(f"rl.tool_call_format: {template_name} chat template does not render tool calls")
        generated = _cut_at_end(render[len(os.path.commonprefix([prompt, render])):], layout.end_markers[1:])
        if not _reads_back(generated, fmt):
            raise CallFormatError(f"rl.tool_call_format: the declared format does not read the calls of "
                                  f"{template_name} chat template's own render: {generated[:200]!r}")
        return fmt
    fmt = probe_call_format(tokenizer)
    if fmt is None:
        raise CallFormatError(
            f"rl.tools: cannot read how {template_name} chat template writes a tool call (it writes none, or in a "
            "form none of json, name_json, name_xml reads back); declare it with rl.tool_call_format: {kind, prefix, "
            "suffix, middle, name_key, arguments_key, key_open, key_close, value_close} (docs/rl.md#tools)")
    return fmt
