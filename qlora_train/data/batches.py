"""A raw batch's readable rows: set aside, processed together, merged back in batch order.

Raw rows arrive as ``row`` (JSON text), ``location`` and ``load_error`` columns; a
line that could not be read has its ``load_error`` set and is carried through
unprocessed (counted as ``unparseable_json`` at the end). Every batch function
(``handlers``, ``dataset``) works the same way: process the readable rows in one
call, then put the results back where their rows were.

    >>> merge_back(4, [0, 2], ["a", "c"], fill=lambda i: f"row {i} unread")
    ['a', 'row 1 unread', 'c', 'row 3 unread']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def readable(batch: dict[str, list]) -> list[int]:
    """Indices of the batch's rows that were read (no ``load_error``), in order."""
    return [i for i, err in enumerate(batch["load_error"]) if not err]


def merge_back(n: int, done: Sequence[int], results: Sequence[T], fill: Callable[[int], T]) -> list[T]:
    """The ``results`` of rows ``done`` (one each, same order) back among all ``n`` rows; row ``i`` of the
    others gets ``fill(i)``."""
    if len(done) != len(results):
        raise ValueError(f"{len(results)} results for {len(done)} rows")
    slot = dict(zip(done, results))
    return [slot[i] if i in slot else fill(i) for i in range(n)]
