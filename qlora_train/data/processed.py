"""What a processed row holds: the one definition of its columns, their types, and who reads each.

``process_rows`` writes the ``pipeline`` columns (one row per raw row: kept
rows have tokens, refused rows a ``drop_reason``); ``dataset`` adds where the
row came from. Every other column set is derived from ``PROCESSED_ROW``:

- ``MODEL_COLUMNS``: what the model is fed (``model_columns(objective)``: an SFT example, or a preference pair's
  two sides and their shared prompt length; attention masks of a pair are all ones, made by the collator);
- ``REPORT_COLUMNS``: what the dataset report counts (``summarize_columns``);
- ``STATS_COLUMNS``: what ``--stats-only`` reads;
- ``KEPT_COLUMNS``: what a kept row carries past the filter into the eval split, the extra examples, the text
  blocks and the mixing (``kept_columns(objective)``: less the other objective's model columns);
- ``EXPANDED_COLUMNS``: a row's extra examples (``reasoning_history: expand``), exploded after the split.

Types are stated, not inferred: a batch whose token lists are all empty (every row refused, or no row expanded)
would otherwise be typed ``list<null>``, which the next batch's ints cannot be cast to.
"""

from __future__ import annotations

import functools
from itertools import chain
from operator import methodcaller
from typing import Any, NamedTuple

MODEL, PAIR, UNPAIRED = "model", "pair", "unpaired"  # the model columns of each data.objective
REPORT, STATS, KEPT, EXPANDED = "report", "stats", "kept", "expanded"
# data.objective -> the reader of the columns the model is fed
FED_BY_OBJECTIVE = {"sft": MODEL, "preference": PAIR, "unpaired": UNPAIRED}


class Column(NamedTuple):
    name: str
    dtype: str  # Arrow element type: int8, int32, int64, string
    depth: int = 0  # list nesting: 0 a value, 1 a list, 2 a list of lists
    readers: frozenset[str] = frozenset()
    written_by: str = "pipeline"  # or "dataset" (added around process_rows)
    empty: Any = None  # the value of a refused row (default: [], "" or 0 by type)

    def empty_value(self) -> Any:
        if self.empty is not None:
            return self.empty
        return [] if self.depth else "" if self.dtype == "string" else 0


def _c(name: str, dtype: str, *readers: str, depth: int = 0, written_by: str = "pipeline", empty: Any = None):
    return Column(name, dtype, depth, frozenset(readers), written_by, empty)


PROCESSED_ROW: tuple[Column, ...] = (
    _c("input_ids", "int32", MODEL, UNPAIRED, KEPT, depth=1),
    _c("attention_mask", "int8", MODEL, UNPAIRED, KEPT, depth=1),
    _c("labels", "int64", MODEL, UNPAIRED, KEPT, depth=1),
    _c("drop_reason", "string", REPORT, STATS),  # a DropReason; "" for a kept row
    _c("drop_detail", "string", REPORT, STATS),  # the row's location and why
    _c("error_traceback", "string", REPORT),  # an unexpected exception's traceback (pipeline.guarded); else ""
    _c("num_tokens_before", "int64", STATS),  # before truncation
    _c("num_tokens", "int64", REPORT, STATS, KEPT),
    _c("num_trained_tokens", "int64", REPORT, STATS),
    _c("dropped_turns", "int64", REPORT, STATS),
    _c("reasoning_trimmed_tokens", "int64", REPORT, STATS),
    _c("token_fallback", "string", REPORT, STATS),  # truncate_side when the token-level cut ran; a pair: cut sides
    _c("straddling_tokens", "int64", REPORT, STATS),
    _c("parse_report", "string", REPORT, STATS, empty="{}"),  # ParseReport JSON, defaults left out
    _c("content_hash", "string"),  # with data.dedup
    _c("expanded_input_ids", "int32", KEPT, EXPANDED, depth=2),
    _c("expanded_labels", "int64", KEPT, EXPANDED, depth=2),
    _c("expanded_tokens", "int64", REPORT, STATS),
    _c("expanded_trained_tokens", "int64", REPORT, STATS),
    _c("tool_schema_tokens", "int64", STATS),  # tokens of the template's tool block; -1: tools, block not found
    # a preference pair (data.objective: preference): its two sides, as build_preference_example makes them; the
    # SFT columns above stay empty, num_tokens* / num_trained_tokens / reasoning_trimmed_tokens count both sides
    # together, dropped_turns the prompt exchanges dropped, token_fallback names the sides cut ("chosen,rejected")
    _c("chosen_input_ids", "int32", PAIR, KEPT, depth=1),
    _c("chosen_labels", "int64", PAIR, KEPT, depth=1),
    _c("rejected_input_ids", "int32", PAIR, KEPT, depth=1),
    _c("rejected_labels", "int64", PAIR, KEPT, depth=1),
    _c("prompt_length", "int64", PAIR, UNPAIRED, KEPT, STATS),  # tokens both sides share before the response
    _c("chosen_tokens", "int64", STATS),  # each side's length (after truncation)
    _c("rejected_tokens", "int64", STATS),
    # an unpaired preference row (data.objective: unpaired, KTO): its one sequence in the SFT columns above (the
    # completion trained), prompt_length the tokens before the completion, and its label: 1 desirable, 0 not
    _c("desirable", "int8", UNPAIRED, KEPT, REPORT, STATS),
    _c("source", "string", STATS, KEPT, written_by="dataset"),  # index:path of its data.datasets entry
    _c("location", "string", written_by="dataset"),  # file:line
    _c("domain", "string", KEPT, written_by="dataset"),  # data.domain_key's value
)


def columns(reader: str | None = None, *, written_by: str | None = None) -> tuple[str, ...]:
    """Names of the columns ``reader`` reads (all without one), in row order."""
    return tuple(c.name for c in PROCESSED_ROW
                 if (reader is None or reader in c.readers) and (written_by is None or c.written_by == written_by))


def model_columns(objective: str = "sft") -> tuple[str, ...]:
    """What the model is fed (``data.objective``): ``input_ids``, ``attention_mask``, ``labels`` of an SFT example;
    ``chosen_*``, ``rejected_*`` and ``prompt_length`` of a preference pair; an unpaired row's (KTO) sequence,
    ``prompt_length`` and ``desirable``."""
    return columns(FED_BY_OBJECTIVE[objective])


def kept_columns(objective: str = "sft") -> tuple[str, ...]:
    """What a kept row carries past the filter: ``KEPT`` columns less the other objectives' model columns."""
    own = set(model_columns(objective))
    other = {c for o in FED_BY_OBJECTIVE if o != objective for c in model_columns(o)} - own
    return tuple(c for c in columns(KEPT) if c not in other)


OUTPUT_COLUMNS = columns(written_by="pipeline")
MODEL_COLUMNS = model_columns("sft")
PAIR_COLUMNS = model_columns("preference")
UNPAIRED_COLUMNS = model_columns("unpaired")
REPORT_COLUMNS = columns(REPORT)
STATS_COLUMNS = columns(STATS)
KEPT_COLUMNS = kept_columns("sft")
EXPANDED_COLUMNS = columns(EXPANDED)


# the pipeline's int-list columns and their element types (written as Arrow arrays: ``arrow_lists``)
INT_LIST_COLUMNS = tuple((c.name, c.dtype) for c in PROCESSED_ROW
                         if c.written_by == "pipeline" and c.depth == 1 and c.dtype != "string")
_EMPTY_VALUES = {c.name: c.empty_value() for c in PROCESSED_ROW if c.written_by == "pipeline"}
_LIST_COLUMNS = tuple(name for name, value in _EMPTY_VALUES.items() if isinstance(value, list))


def empty_output() -> dict[str, Any]:
    """The pipeline columns of a row before (or without) an example: what a refused row keeps.

    One per row: a copy of the empty values worked out once, each list column a new list (the pipeline appends
    to ``expanded_*``)."""
    out = _EMPTY_VALUES.copy()
    for name in _LIST_COLUMNS:
        out[name] = []
    return out


def arrow_lists(values: list[list[int]], dtype: str):
    """A column of int lists -> an Arrow list array of ``dtype`` (a ``Column.dtype``), made from one flat array.

    ``datasets`` writes an Arrow table as it is; a list of Python lists it converts value by value, checking
    each one's type (the processed columns' largest write cost: about 20 µs for a 700-token row's ids). A column
    of ones (``attention_mask``) is checked to be ones and made without reading them."""
    import numpy as np
    import pyarrow as pa

    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(np.fromiter(map(len, values), np.int64, len(values)), out=offsets[1:])
    total = int(offsets[-1])
    if sum(map(methodcaller("count", 1), values)) == total:
        flat = np.ones(total, dtype)
    else:
        flat = np.fromiter(chain.from_iterable(values), dtype, total)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


@functools.cache
def processed_schema():
    """The Arrow schema of ``processed_features``."""
    return processed_features().arrow_schema


def processed_features():
    """The ``datasets.Features`` of a processed dataset, in ``PROCESSED_ROW`` order."""
    import datasets

    def feature(c: Column):
        f = datasets.Value(c.dtype)
        for _ in range(c.depth):
            f = datasets.Sequence(f)
        return f

    return datasets.Features({c.name: feature(c) for c in PROCESSED_ROW})
