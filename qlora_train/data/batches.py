"""A raw batch's readable rows: set aside, processed together, merged back in batch order.

Raw rows arrive as ``row`` (JSON text), ``location`` and ``load_error`` columns; a
row that could not be read (its ``load_error`` set, or JSON that does not parse) is
carried through unprocessed (counted as ``unparseable_json`` at the end). Every batch
function (``handlers``, ``dataset``) works the same way: parse the readable rows
(``parse_readable``), process them in one call, then put the results back where
their rows were (``merge_back``).

    >>> merge_back(4, [0, 2], ["a", "c"], fill=lambda i: f"row {i} unread")
    ['a', 'row 1 unread', 'c', 'row 3 unread']

JSON text from a row (a line, an array element, a string of tool calls) is read by ``read_json``, which
turns everything Python's reader refuses into one ``ValueError`` saying why:

    >>> read_json('{"n": ' + "9" * 5000 + '}')
    Traceback (most recent call last):
    ...
    qlora_train.data.batches.JSONLimitError: an integer of more than 4300 digits
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class JSONLimitError(ValueError):
    """JSON text that Python's reader refuses although it follows the grammar: a huge integer, deep nesting."""


def read_json(text: str) -> Any:
    """JSON text -> its value, or ``ValueError`` with one short line saying why not: the text is not JSON (the
    parser's message and where), or (``JSONLimitError``) it is JSON that Python's reader refuses: an integer of
    more than ``sys.get_int_max_str_digits()`` digits, or nesting deeper than the interpreter's recursion limit.

    >>> read_json('[1, 2.5e999, "x"]')
    [1, inf, 'x']
    >>> read_json('{"a": }')
    Traceback (most recent call last):
    ...
    ValueError: Expecting value at line 1 column 7
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        msg = exc.msg.removesuffix(" at")  # "Invalid control character at"
        raise ValueError(f"{msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # int() of a digit string over the limit: the only other ValueError json.loads raises
        if "integer string conversion" not in str(exc):
            raise
        raise JSONLimitError(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:  # the C scanner's depth guard: raised cleanly, the stack already unwound
        raise JSONLimitError("nested deeper than Python's JSON reader goes (about "
                             f"{sys.getrecursionlimit()} levels)") from None


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
            rows.append(read_json(text))
        except ValueError as exc:
            errors[i] = f"unparseable JSON line: {exc}"
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
