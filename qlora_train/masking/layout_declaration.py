"""``model.template_layout``: a layout declared in the config, laid over the probed one, and the resolved layout
printed as the YAML that declares it.

The probe (``layout.probe_layout``) reads a template's layout off a few renders. A user may declare any part of
it instead (``TemplateLayout``'s fields, whatever they are: this module reads them with ``dataclasses.fields``)::

    model:
      template_layout:
        end_markers: ["<|im_end|>"]        # the rest is probed

A declared part replaces the probed one (``resolve_layout``; ``template_layout``: the resolved layout, cached
per template and vocabulary, the one rendering uses); where the probe fails, the declaration alone is the
layout. Either way every row is verified against the layout exactly as a probed one is: a wrong declaration
refuses rows with the reason (``mask_unverified``), it never trains a guessed mask.

The declaration travels with the tokenizer, baked into its chat template as a comment
(``chat_templates.with_template_layout``), so every process that renders and the tokenizer saved with the
adapter see it; the layout cache and the prepared data's fingerprint, keyed by the template text, follow.

``layout_yaml`` prints the resolved layout (``--stats-only``, ``--debug-samples``) as a block that pastes into a
config, each part marked probed or declared:

    >>> print(layout_yaml(resolve_layout(tok)))   # Qwen3
    # the chat template's layout, as probed and declared (docs/masking.md#seeing-and-declaring-the-layout)
    # class: header_from_generation_prompt
    # to declare or override any part, put template_layout: under the config's model: (every row is verified)
    model:
      template_layout:
        assistant_header: "<|im_start|>assistant\\n"  # probed
        turn_openers: ["<|im_start|>assistant\\n"]    # probed
        end_markers: ["<|im_end|>"]                  # probed
    ...
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from jinja2 import TemplateError

from qlora_train.chat_templates import split_template_layout
from qlora_train.errors import ConfigError
from qlora_train.masking.layout import TemplateLayout, probe_key, probe_layout

log = logging.getLogger(__name__)

KEY = "model.template_layout"


# what the probe says about a layout rather than a part of it: printed in the block's head, never declared
_DESCRIPTIONS = ("layout_class", "unknown", "declared")


def declarable_parts() -> dict[str, Any]:
    """The parts a config may declare: ``TemplateLayout``'s init fields -> their types."""
    hints = typing.get_type_hints(TemplateLayout)
    return {f.name: hints[f.name] for f in dataclasses.fields(TemplateLayout) if f.init and f.name not in _DESCRIPTIONS}


def required_parts() -> list[str]:
    """The parts a layout cannot do without (no default): what a declaration must give where the probe fails."""
    return [f.name for f in dataclasses.fields(TemplateLayout) if f.init and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING and f.name not in _DESCRIPTIONS]


# --- checking a declaration -----------------------------------------------------------------------------------


def check_declaration(declared: Mapping[str, Any] | None) -> dict[str, Any]:
    """``model.template_layout`` as written -> its parts with the field's types (YAML lists become tuples).

    Raises ``ConfigError`` with one line per problem, each naming ``model.template_layout.<key>``: an unknown
    part (with the closest known one), a value of the wrong type.

    >>> check_declaration({"end_markers": ["<|im_end|>"], "answer_open": ""})
    {'end_markers': ('<|im_end|>',), 'answer_open': ''}
    >>> check_declaration({"end_marker": ["<|im_end|>"]})
    Traceback (most recent call last):
    ...
    qlora_train.errors.ConfigError: config: model.template_layout.end_marker: unknown key (did you mean 'end_markers'?)
    """
    parts = declarable_parts()
    out, problems = {}, []
    for key, value in (declared or {}).items():
        where = f"{KEY}.{key}"
        if key not in parts:
            close = difflib.get_close_matches(str(key), list(parts), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (the parts: {', '.join(parts)})"
            problems.append(f"{where}: unknown key{hint}")
            continue
        try:
            out[key] = _coerce(value, parts[key])
        except TypeError:
            problems.append(f"{where}: expected {_describe(parts[key])}, got {json.dumps(value, default=repr)}")
    if problems:
        raise ConfigError(problems)
    return out


def _coerce(value: Any, hint: Any) -> Any:
    """``value`` (as YAML gives it) as the type ``hint`` names; ``TypeError`` when it is not one."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _coerce(value, arg)
            except TypeError:
                continue
        raise TypeError
    if origin is Literal:
        if value in args:
            return value
        raise TypeError
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise TypeError
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise TypeError
            return tuple(_coerce(v, a) for v, a in zip(value, args))
        items = [_coerce(v, args[0] if args else Any) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is type(None):
        if value is None:
            return None
        raise TypeError
    if hint is bool or hint is str:
        if isinstance(value, hint):
            return value
        raise TypeError
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise TypeError


def _describe(hint: Any) -> str:
    """A type in the words of a YAML writer: ``tuple[str, ...]`` -> ``a list of strings``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if origin in (tuple, list):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a list of {len(args)}: " + ", ".join(_describe(a) for a in args)
        inner = _describe(args[0]) if args else "values"
        return "a list of " + re.sub(r"^an? ", "", inner) + ("s" if inner.startswith(("a ", "an ")) else "")
    names = {str: "a string", bool: "true or false", int: "an integer", float: "a number", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


# --- resolving: the probe, then the declaration ---------------------------------------------------------------


class ResolvedLayout(NamedTuple):
    """The layout rendering uses, and where each part came from."""

    layout: TemplateLayout
    declared: dict[str, Any]  # the parts the config declared (checked), as the layout holds them
    probed: TemplateLayout | None  # what the probe found; None when it failed
    probe_error: str = ""  # why the probe failed


def template_declaration(tokenizer) -> dict[str, Any]:
    """The layout parts declared in the tokenizer's chat template (``model.template_layout``, baked in by
    ``get_chat_template``), checked; ``{}`` when none are. A dict of named templates: the first that declares."""
    template = tokenizer.chat_template or ""
    for source in template.values() if isinstance(template, dict) else [template]:
        declared, _ = split_template_layout(source)
        if declared:
            return check_declaration(declared)
    return {}


def resolve_layout(tokenizer, probe=probe_layout) -> ResolvedLayout:
    """The probed layout with the declared parts in its place (``dataclasses.replace``).

    Where the probe fails (a template it cannot read), the declaration alone is the layout when it gives every
    part that has no default; else the probe's error stands, with what to declare.
    """
    declared = template_declaration(tokenizer)
    try:
        probed, error = probe(tokenizer), ""
    except (ValueError, TemplateError) as exc:  # what a template the probe cannot read raises
        if not declared:
            raise
        probed, error = None, f"{type(exc).__name__}: {exc}"
    if probed is None:
        missing = [p for p in required_parts() if p not in declared]
        if missing:
            raise ConfigError([f"{KEY}: the probe could not read the chat template ({error}); declare "
                               f"{', '.join(missing)} too, or every part"])
        log.warning("chat template: the layout probe failed (%s); using the declared %s", error, KEY)
        return ResolvedLayout(TemplateLayout(**declared, declared=tuple(declared)), declared, None, error)
    for part, value in declared.items():
        if getattr(probed, part) != value:
            log.info("%s.%s: declared %s (the probe found %s)", KEY, part, _yaml_value(value),
                     _yaml_value(getattr(probed, part)))
    unknown = tuple(part for part in probed.unknown if part not in declared)  # a declared fact is known
    # parts where the declaration is the user's own choice (not the probe's finding pasted back): a contract, so
    # rows it does not fit are refused rather than re-derived by prefix renders (layout.TemplateLayout.declared)
    chosen = tuple(p for p, v in declared.items() if p in probed.unknown or getattr(probed, p) != v)
    return ResolvedLayout(dataclasses.replace(probed, **declared, unknown=unknown, declared=chosen), declared, probed)


_LAYOUTS: dict[tuple[str, str], TemplateLayout] = {}


def template_layout(tokenizer) -> TemplateLayout:
    """The layout rendering uses: the tokenizer's chat template probed once (cached per template and vocabulary),
    the parts declared in ``model.template_layout`` (baked into the template) in place of the probed ones."""
    key = probe_key(tokenizer)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS[key] = resolve_layout(tokenizer, probe_layout).layout
        if layout.unknown:
            log.warning("chat template layout: %s could not be probed; rows the layout cannot verify are verified "
                        "with per-turn prefix renders (slower), and refused where those do not verify either",
                        ", ".join(layout.unknown))
    return layout


def layout_dict(layout: TemplateLayout) -> dict[str, Any]:
    """Every part of a layout as JSON values (tuples as lists): what the prepared data's fingerprint keeps."""
    return json.loads(json.dumps({p: getattr(layout, p) for p in declarable_parts()}))


# --- printing ----------------------------------------------------------------------------------------------------

# characters a YAML reader folds or refuses inside a double-quoted scalar: written as \\u escapes
_NOT_PLAIN = re.compile("[^\t\n\r\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]|[\u2028\u2029\ufeff]")


def _yaml_value(value: Any) -> str:
    """A part's value as YAML flow text that reads back the same (JSON, which YAML reads, with every character
    YAML would fold or refuse escaped)."""
    text = json.dumps(value, ensure_ascii=False)
    return _NOT_PLAIN.sub(lambda m: "".join(f"\\u{u:04x}" for u in _utf16(m.group())), text)


def _utf16(ch: str) -> list[int]:
    b = ch.encode("utf-16-be", "surrogatepass")
    return [int.from_bytes(b[i:i + 2], "big") for i in range(0, len(b), 2)]


def _origin(part: str, resolved: ResolvedLayout) -> str:
    value = getattr(resolved.layout, part)
    if part in resolved.declared:
        if resolved.probed is None:
            return "declared (the probe failed)"
        probed = getattr(resolved.probed, part)
        return "declared" if probed == value else f"declared; the probe found {_yaml_value(probed)}"
    if resolved.probed is None:
        return "default (the probe failed)"
    if part in resolved.probed.unknown:
        return "unknown: the probe could not find it (rows the layout cannot verify take prefix renders)"
    return "probed" if value is not None else "probed: none found"


_COMMENT_COLUMN = 56  # where the comments line up, past shorter lines


def layout_yaml(resolved: ResolvedLayout) -> str:
    """The resolved layout as a YAML block under ``model: template_layout:`` that pastes into a config, each
    part commented with where it came from (probed, declared, the probe's value where a declaration differs)."""
    layout = resolved.layout
    head = "# the chat template's layout, as probed and declared (docs/masking.md#seeing-and-declaring-the-layout)"
    lines = [head, f"# class: {layout.layout_class}" + (f"; could not be probed: {', '.join(layout.unknown)}"
                                                         if layout.unknown else "")]
    if resolved.probe_error:
        error = " ".join(resolved.probe_error.split())
        lines.append(f"# the probe failed ({error}): the declared parts are the layout")
    lines += ["# to declare or override any part, put template_layout: under the config's model: "
              "(every row is verified)", "model:", "  template_layout:"]
    parts = [(f"    {part}: {_yaml_value(getattr(layout, part))}", _origin(part, resolved))
             for part in declarable_parts()]
    width = min(max(len(text) for text, _ in parts), _COMMENT_COLUMN)
    lines += [f"{text:<{width}}  # {origin}" for text, origin in parts]
    return "\n".join(lines) + "\n"
