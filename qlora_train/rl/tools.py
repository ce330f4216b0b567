"""Tools an agent rollout may call: ``rl.tools`` imported (``load_tools``), their JSON schemas read from signature
and docstring (transformers' ``get_json_schema``: what the chat template is given as ``tools``), and each call run
under a time and an output-size limit (``call_tool``).

A tool is any importable callable, ``package.module:name``, with type hints and a Google-style docstring (what
``get_json_schema`` reads). A call never stops the run: a tool that raises, runs past ``rl.tool_timeout_s``, is not
one of the tools, or is given arguments its signature does not take returns an error message to the model
(``ToolResult.error`` says which, counted by the rollout); output past ``rl.tool_max_chars`` is cut, said so in
the text the model reads.

    >>> [tool] = load_tools(["qlora_train.rl.calculator:calculate"])
    >>> tool.schema["function"]["name"], list(tool.schema["function"]["parameters"]["properties"])
    ('calculate', ['expression'])
    >>> call_tool({"calculate": tool}, "calculate", {"expression": "12 * (3 + 4)"})
    ToolResult(text='84', error=None)
    >>> call_tool({"calculate": tool}, "calculate", {"expression": "1 / 0"})
    ToolResult(text='error: ZeroDivisionError: division by zero', error='raised')
    >>> call_tool({"calculate": tool}, "search", {}).error
    'unknown_tool'
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from qlora_train.errors import QloraError
from qlora_train.rl.rewards import _import, _one_line

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_CHARS = 2000
TOOL_ERRORS = ("raised", "timeout", "unknown_tool", "bad_arguments")  # what ToolResult.error may say


class ToolError(QloraError):
    """A tool cannot be imported or has no schema: one line naming it (``rl.tools[i]``), exit 2."""

    exit_code = 2


@dataclass(frozen=True)
class Tool:
    """One of ``rl.tools``, imported: its name (the schema's), the callable, its JSON schema."""

    name: str
    function: str  # "package.module:name", as configured
    call: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


class ToolResult(NamedTuple):
    """What a call returned to the model (``text``), and why it is an error message (None when it is not)."""

    text: str
    error: str | None = None


def load_tools(specs: Sequence[str]) -> list[Tool]:
    """``rl.tools`` -> the tools, imported as reward functions are (installed packages or the current directory),
    each schema read by ``get_json_schema``; a name that does not import, is not callable, or whose docstring and
    type hints give no schema is a ``ToolError``."""
    from transformers.utils import get_json_schema

    out: dict[str, Tool] = {}
    for i, spec in enumerate(specs):
        where = f"rl.tools[{i}]"
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ToolError(f"{where}: {spec!r}: expected 'package.module:name', e.g. "
                            "'qlora_train.rl.calculator:calculate'")
        try:
            module = _import(module_name, where)
        except QloraError as exc:
            raise ToolError(str(exc)) from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise ToolError(f"{where}: {module_name} has no function {attr!r}")
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ToolError(f"{where}: {spec}: no JSON schema from its signature and docstring ({_one_line(exc)}); a "
                            "tool needs type hints and a Google-style docstring with an Args: section") from None
        if schema["function"]["name"] in out:
            raise ToolError(f"{where}: a second tool named {schema['function']['name']!r}")
        out[schema["function"]["name"]] = Tool(schema["function"]["name"], spec, fn, schema)
    return list(out.values())


def call_tool(tools: dict[str, Tool], name: str, arguments: dict, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              max_chars: int = DEFAULT_MAX_CHARS) -> ToolResult:
    """One call -> what the model reads back (see the module doc). The tool runs in a daemon thread: one past
    ``timeout_s`` is left to finish on its own (a Python thread cannot be stopped) and its result is dropped."""
    tool = tools.get(name)
    if tool is None:
        return ToolResult(f"error: no tool named {name!r} (tools: {', '.join(tools) or 'none'})", "unknown_tool")
    try:
        inspect.signature(tool.call).bind(**arguments)
    except TypeError as exc:
        return ToolResult(f"error: {name} does not take these arguments: {exc}", "bad_arguments")
    box: dict = {}

    def run():
        try:
            box["value"] = tool.call(**arguments)
        except Exception as exc:  # the tool's failure is the model's to read, never the run's
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"tool {name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ToolResult(f"error: {name} did not return within {timeout_s:g} s", "timeout")
    if "error" in box:
        return ToolResult(f"error: {_one_line(box['error'])}", "raised")
    value = box.get("value")
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    if len(text) > max_chars:
        text = f"{text[:max_chars]}... [cut: {len(text) - max_chars} more characters]"
    return ToolResult(text)
