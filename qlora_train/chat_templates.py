"""Chat templates shipped with qlora-train, and choosing one for a tokenizer.

Each ``templates/<name>.jinja`` is written by us to reproduce the documented
turn layout of one model family. ``get_chat_template`` sets one on a tokenizer
(or keeps the tokenizer's own) and bakes ``model.chat_template_kwargs`` into it.

Why bake the kwargs into the template text instead of passing them to each
``apply_chat_template`` call: every render then sees them (the data pipeline,
the layout probe, the diagnostics, and any code we do not control), and the
tokenizer saved with the adapter serves by default exactly what training
rendered. Each kwarg becomes a default, set only when the caller does not pass
it, so a server can still override it per request::

    {#- qlora-train chat_template_kwargs: {"enable_thinking": false} -#}
    {%- if enable_thinking is not defined %}{%- set enable_thinking = false %}{%- endif %}
    ...the template...

The first line marks the prelude: applying kwargs to a template that already
has one (a tokenizer saved by qlora-train) replaces it instead of stacking.

``model.template_layout`` (a declared layout, see ``masking/layout_declaration.py``)
travels the same way, for the same reasons (the ``datasets.map`` workers get the
tokenizer pickled; the saved tokenizer serves): a comment that renders nothing,
after the kwargs prelude, read back by the layout probe::

    {# qlora-train template_layout: {"end_markers": ["<|im_end|>"]} #}
    ...the template...
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from qlora_train.errors import ConfigError

TEMPLATE_DIR = Path(__file__).parent / "templates"
ALIASES = {"qwen2": "qwen2.5", "qwen3_5": "qwen3.5", "llama3.1": "llama3", "gemma2": "gemma", "gemma3": "gemma",
           # Qwen2-VL's documented layout is Qwen2.5-VL's (ChatML, the default system prompt, the vision markers)
           "qwen2-vl": "qwen2.5-vl", "qwen2_vl": "qwen2.5-vl", "qwen2_5_vl": "qwen2.5-vl", "qwen3_vl": "qwen3-vl",
           "llava_onevision": "llava-onevision",
           "internvl": "internvl3"}


def shipped_templates() -> list[str]:
    """Names accepted by ``get_chat_template`` besides None / ``tokenizer`` and paths."""
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


@cache
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def resolve_chat_template(chat_template: str | None) -> str | None:
    """Name / path -> template source; None or ``"tokenizer"`` -> None (keep the tokenizer's own)."""
    if chat_template is None or chat_template == "tokenizer":
        return None
    name = ALIASES.get(chat_template, chat_template)
    shipped = TEMPLATE_DIR / f"{name}.jinja"
    if shipped.is_file():
        return _read(shipped)
    path = Path(chat_template)
    if path.suffix == ".jinja":
        if not path.is_file():
            raise FileNotFoundError(f"chat_template file not found: {path}")
        return _read(path)
    raise ValueError(
        f"unknown chat_template {chat_template!r}: use one of {shipped_templates()} or a .jinja path, or None "
        "for the tokenizer's own"
    )


def get_chat_template(tokenizer, chat_template: str | None = None, kwargs: Mapping[str, Any] | None = None,
                      layout: Mapping[str, Any] | None = None):
    """Set the chosen template, with ``kwargs`` baked in as defaults and the declared ``layout`` parts as a
    comment (``with_template_layout``), on ``tokenizer`` (in place) and return it.

    >>> tok = get_chat_template(tok)                  # the tokenizer's own (also: "tokenizer")
    >>> tok = get_chat_template(tok, "qwen3", {"enable_thinking": False})   # shipped template, kwarg baked in

    Raises ``ConfigError`` when the tokenizer has no template and none is named,
    or a kwarg's name or value cannot be written into a template.
    """
    source = resolve_chat_template(chat_template)
    if source is None:
        source = getattr(tokenizer, "chat_template", None)
        if not source:
            raise ConfigError([f"model.chat_template: the tokenizer has no chat template: name one of "
                               f"{shipped_templates()} or a .jinja path"])
    bake = lambda s: with_template_layout(with_template_kwargs(s, kwargs or {}), layout or {})
    if isinstance(source, dict):  # several named templates (e.g. default + tool_use): each gets the defaults
        tokenizer.chat_template = {name: bake(s) for name, s in source.items()}
    else:
        tokenizer.chat_template = bake(source)
    return tokenizer


_MARK = re.compile(r"\{#- qlora-train chat_template_kwargs: (.*) -#\}\n")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONSTANTS = {"true", "false", "none", "True", "False", "None"}  # Jinja cannot assign to them
_PASSED = {"messages", "tools", "documents", "add_generation_prompt"}  # every render sets them: a default never applies


def with_template_kwargs(template: str, kwargs: Mapping[str, Any]) -> str:
    """Template source -> the same with ``kwargs`` as defaults in a marked prelude (see the module doc).

    A prelude already there is replaced; the kwargs it held are kept unless named
    again. No kwargs (and no prelude) -> ``template`` unchanged.

    >>> print(with_template_kwargs("{{ x }}", {"x": 1}))
    {#- qlora-train chat_template_kwargs: {"x": 1} -#}
    {%- if x is not defined %}{%- set x = 1 %}{%- endif %}
    {{ x }}
    """
    baked, body = split_template_kwargs(template)
    merged = {**baked, **kwargs}
    if not merged:
        return template
    lines = [_default_line(key, jinja_literal(value, key)) for key, value in merged.items()]
    marker = json.dumps(merged, ensure_ascii=False).replace("#}", "#\\u007d")  # cannot end the comment early
    return f"{{#- qlora-train chat_template_kwargs: {marker} -#}}\n" + "".join(lines) + body


def _default_line(key: str, literal: str) -> str:
    return f"{{%- if {key} is not defined %}}{{%- set {key} = {literal} %}}{{%- endif %}}\n"


def split_template_kwargs(template: str) -> tuple[dict[str, Any], str]:
    """Template source -> (kwargs of its qlora-train prelude, the template without it); ``({}, template)``
    when it has none."""
    found = _MARK.match(template)
    try:
        baked, end = json.loads(found.group(1)) if found else {}, found.end() if found else 0
        lines = [_default_line(key, jinja_literal(value, key)) for key, value in baked.items()]
    except (ValueError, AttributeError, ConfigError):
        return {}, template  # not a prelude we wrote: leave the template alone
    for line in lines:  # exactly one line per kwarg: a template's own first line is kept
        if not template.startswith(line, end):
            return {}, template
        end += len(line)
    return baked, template[end:]


_LAYOUT_MARK = re.compile(r"\{# qlora-train template_layout: (.*) #\}\n")


def with_template_layout(template: str, layout: Mapping[str, Any]) -> str:
    """Template source -> the same with the declared ``layout`` parts in a comment line after the kwargs
    prelude (see the module doc); the parts a line already there held are kept unless declared again. The
    comment renders nothing: trim_blocks, which every chat template render uses, drops the newline after it.

    >>> print(with_template_layout("{{ x }}", {"end_markers": ["<|im_end|>"]}))
    {# qlora-train template_layout: {"end_markers": ["<|im_end|>"]} #}
    {{ x }}
    """
    baked, rest = split_template_layout(template)
    merged = {**baked, **layout}
    if not merged:
        return template
    _, body = split_template_kwargs(rest)
    prelude = rest[:len(rest) - len(body)]
    line = json.dumps(merged, ensure_ascii=False).replace("#}", "#\\u007d")  # cannot end the comment early
    return f"{prelude}{{# qlora-train template_layout: {line} #}}\n{body}"


def split_template_layout(template: str) -> tuple[dict[str, Any], str]:
    """Template source -> (the layout parts its qlora-train comment declares, the template without it);
    ``({}, template)`` when it has none."""
    _, body = split_template_kwargs(template)
    found = _LAYOUT_MARK.match(body)
    try:
        declared = json.loads(found.group(1)) if found else None
    except ValueError:
        declared = None
    if not isinstance(declared, dict):
        return {}, template  # none, or not a line we wrote: leave the template alone
    at = len(template) - len(body)
    return declared, template[:at] + body[found.end():]


def template_kwargs_problems(kwargs: Mapping[str, Any]) -> list[str]:
    """Problems of ``model.chat_template_kwargs``, one per key, each naming it (empty: usable)."""
    problems = []
    for key, value in kwargs.items():
        try:
            jinja_literal(value, key)
        except ConfigError as err:
            problems += err.problems
    return problems


def jinja_literal(value: Any, key: str) -> str:
    """A YAML value -> the Jinja expression that evaluates to it; ``key`` names it in errors.

    >>> jinja_literal({"effort": "low", "n": [1, 2.5, None, True]}, "k")
    '{"effort": "low", "n": [1, 2.5, none, true]}'
    """
    where = f"model.chat_template_kwargs.{key}"
    if not isinstance(key, str) or not _IDENTIFIER.fullmatch(key) or key in _CONSTANTS:
        raise ConfigError([f"{where}: is not a template variable name (letters, digits and _, not starting "
                           "with a digit; not true/false/none)"])
    if key in _PASSED:
        raise ConfigError([f"{where}: is set by every render, so a default would never apply"])
    return _literal(value, where)


def _literal(value: Any, where: str) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, int) or isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, str):  # JSON string escapes are Jinja string escapes; non-ASCII is kept as is
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v, where) for v in value) + "]"
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return "{" + ", ".join(f"{_literal(k, where)}: {_literal(v, where)}" for k, v in value.items()) + "}"
    raise ConfigError([f"{where}: {value!r} cannot be written into a template (use true/false, null, a number, "
                       "a string, or lists and string-keyed mappings of them)"])
