"""Custom row handlers: user functions, registered by name, that fix raw rows before canonicalization.

    >>> @register_row_handler("rename_qa")
    ... def rename_qa(row, *, prefix=""):
    ...     return {"prompt": prefix + row["q"], "response": row["a"]}

and in the YAML::

    data:
      handler_modules: [my_project.handlers]   # imported first, so the decorator runs
      datasets:
        - path: data/qa.jsonl
          handlers: [{name: rename_qa, fn_kwargs: {prefix: "Q: "}, remove_columns: [q, a]}]

A handler is applied as a ``datasets`` map over the source's raw rows (so it
runs in the preprocessing processes and is cached; its code is part of the
fingerprint). One row at a time: ``handler(row, **fn_kwargs)`` returns a
mapping whose keys update the row (any other value replaces it). ``batched``:
``handler(columns, **fn_kwargs)`` gets the batch's rows as columns (a key a
row lacks is ``None``) and returns columns; with as many rows as it got, they
update the rows, otherwise they replace them (``None`` values left out). Then
``remove_columns`` keys are removed. Unreadable rows pass through untouched.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

import datasets

from qlora_train.data.batches import merge_back, parse_readable
from qlora_train.errors import ConfigError

_HANDLERS: dict[str, Callable] = {}


def row_json(item) -> str:
    """A row -> JSON text. Lone surrogates (undecodable bytes, broken escapes) are kept as ``\\udcxx`` escapes:
    Arrow cannot store them raw, and the pipeline drops such rows as ``invalid_unicode`` with their location."""
    text = json.dumps(item, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(item, ensure_ascii=True, default=str)
    return text


def register_row_handler(name: str) -> Callable[[Callable], Callable]:
    """Decorator: make ``fn`` available to the YAML as ``handlers: [{name: <name>}]``."""

    def register(fn: Callable) -> Callable:
        known = _HANDLERS.get(name)
        if known is not None and known.__qualname__ != fn.__qualname__:
            raise ValueError(f"row handler {name!r} is already registered by {known.__module__}.{known.__qualname__}")
        _HANDLERS[name] = fn
        return fn

    return register


def get_row_handler(name: str) -> Callable:
    if name not in _HANDLERS:
        known = ", ".join(sorted(_HANDLERS)) or "none"
        raise ConfigError([f"data.datasets[].handlers: row handler {name!r} is not registered (registered: "
                           f"{known}); list the module that registers it in data.handler_modules"])
    return _HANDLERS[name]


def import_handler_modules(modules: list[str]) -> None:
    """Import the modules whose ``register_row_handler`` decorators register handlers."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError([f"data.handler_modules: cannot import {module!r}: {exc}"]) from None


def _updated(row: Any, out: Any, remove: list[str]) -> Any:
    new = {**row, **out} if isinstance(row, dict) and isinstance(out, dict) else out
    if isinstance(new, dict) and remove:
        new = {k: v for k, v in new.items() if k not in remove}
    return new


def _apply(batch: dict, handler: Callable, name: str, fn_kwargs: dict, batched: bool, remove: list[str]) -> dict:
    ok, rows, errors = parse_readable(batch)
    where = [batch["location"][i] for i in ok]
    try:
        if not batched:
            new_rows = [_updated(r, handler(r, **fn_kwargs), remove) for r in rows]
            new_where = where
        else:
            keys = list(dict.fromkeys(k for r in rows if isinstance(r, dict) for k in r))
            columns = {k: [r.get(k) if isinstance(r, dict) else None for r in rows] for k in keys}
            out = handler(columns, **fn_kwargs) if rows else {}
            n = len(next(iter(out.values()))) if out else 0
            if n == len(rows):
                new_rows = [_updated(r, {k: v[j] for k, v in out.items()}, remove) for j, r in enumerate(rows)]
                new_where = where
            else:
                new_rows = [_updated({}, {k: v[j] for k, v in out.items() if v[j] is not None}, remove)
                            for j in range(n)]
                new_where = [f"{where[0] if where else '?'} (row handler {name!r}, output {j})" for j in range(n)]
    except Exception as exc:
        raise RuntimeError(f"row handler {name!r} failed on the batch starting at "
                           f"{where[0] if where else '?'}: {type(exc).__name__}: {exc}") from exc
    n = len(batch["load_error"])
    if len(new_rows) == len(rows):  # keep every row where it was
        return {"row": merge_back(n, ok, [row_json(r) for r in new_rows], lambda i: batch["row"][i]),
                "location": merge_back(n, ok, new_where, lambda i: batch["location"][i]),
                "load_error": [errors.get(i, "") for i in range(n)]}
    # a batched handler that changed the number of rows: the unreadable rows first, then its output
    bad = sorted(errors)
    return {
        "row": [batch["row"][i] for i in bad] + [row_json(r) for r in new_rows],
        "location": [batch["location"][i] for i in bad] + new_where,
        "load_error": [errors[i] for i in bad] + [""] * len(new_rows),
    }


def apply_row_handlers(raw: datasets.Dataset, specs) -> datasets.Dataset:
    """Raw rows (row, location, load_error) -> the same columns after each handler of ``specs`` in order."""
    for spec in specs:
        raw = raw.map(
            _apply, batched=True,
            fn_kwargs={"handler": get_row_handler(spec.name), "name": spec.name, "fn_kwargs": dict(spec.fn_kwargs),
                       "batched": spec.batched, "remove": list(spec.remove_columns)},
            desc=f"row handler {spec.name}",
        )
    return raw
