"""A raw batch's readable rows: set aside, processed together, merged back in batch order.

Raw rows arrive as ``row`` (JSON text), ``location`` and ``load_error`` columns; a
row that could not be read (its ``load_error`` set, or JSON that does not parse) is
carried through unprocessed (counted as ``unparseable_json`` at the end). Every batch
function (``handlers``, ``dataset``) works the same way: parse the readable rows
(``parse_readable``), process them in one call, then put the results back where
their rows were (``merge_back``).

    >>> merge_back(4, [0, 2], ["a", "c"], fill=lambda i: f"row {i} unread")
    ['a', 'row 1 unread', 'c', 'row 3 unread']
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def parse_readable(batch: dict[str, list]) -> tuple[list[int], list[Any], dict[int, str]]:
    """The batch's rows parsed from their JSON text: (indices of the rows that parse, the parsed rows,
    ``{index: why}`` for every other row: its ``load_error``, or the line's JSON error).

    A JSON line is parsed here, once, not when it is read (``sources`` stores the line as it is)."""
    ok, rows, errors = [], [], {}
    for i, (text, err) in enumerate(zip(batch["row"], batch["load_error"])):
        if err:
            errors[i] = err
            continue
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError as exc:
            errors[i] = f"unparseable JSON line: {exc.msg}"
            continue
        ok.append(i)
    return ok, rows, errors


def merge_back(n: int, done: Sequence[int], results: Sequence[T], fill: Callable[[int], T]) -> list[T]:
    """The ``results`` of rows ``done`` (one each, same order) back among all ``n`` rows; row ``i`` of the
    others gets ``fill(i)``."""
    if len(done) != len(results):
        raise ValueError(f"{len(results)} results for {len(done)} rows")
    slot = dict(zip(done, results))
    return [slot[i] if i in slot else fill(i) for i in range(n)]
