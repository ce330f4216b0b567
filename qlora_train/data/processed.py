"""What a processed row holds, per objective: the one definition of each row type's columns, their types, and who
reads each.

A row type (``RowType``) is what one objective's pipeline writes for each raw row (kept rows have tokens,
refused rows a ``drop_reason``) and ``dataset`` adds to it (where the row came from):

- ``SFT_ROW`` (``data.objective: sft``): an example's ``input_ids`` / ``attention_mask`` / ``labels``, its extra
  examples (``reasoning_history: expand``), truncation's counts (``token_fallback``: the side cut), its images
  (references, not pixels: the collator reads them) and their tokens;
- ``PAIR_ROW`` (``preference``): the two sides' ids and labels and their shared ``prompt_length``;
  ``num_tokens*`` / ``num_trained_tokens`` / ``reasoning_trimmed_tokens`` count both sides together,
  ``dropped_turns`` the prompt exchanges dropped, ``cut_sides`` the sides whose response was cut;
- ``UNPAIRED_ROW`` (``unpaired``, KTO): one sequence (the completion trained), ``prompt_length`` the tokens before
  the completion, its label ``desirable``; ``token_fallback`` is ``right`` where the completion was cut;
- ``PROMPT_ROW`` (``prompt``, GRPO): the prompt's ids (rendered with the generation prompt; nothing trained: the
  completions are sampled in training), its messages and the row's other columns as JSON (the reward functions'
  arguments), and its ``location`` (fed to training, so that a reward that fails names its row).

``ROW_TYPES`` maps ``data.objective`` to its row type: the one place the objective decides what a row holds. Every
other column set is derived from a row type: ``model_columns`` (what the model is fed), ``report_columns`` (what the
dataset report counts), ``stats_columns`` (what ``--stats-only`` reads), ``kept_columns`` (what a kept row carries
past the filter into the eval split, the extra examples, the text blocks and the mixing), ``expanded_columns``.

Types are stated, not inferred: a batch whose token lists are all empty (every row refused, or no row expanded)
would otherwise be typed ``list<null>``, which the next batch's ints cannot be cast to.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import methodcaller
from typing import Any, NamedTuple

MODEL, REPORT, STATS, KEPT, EXPANDED = "model", "report", "stats", "kept", "expanded"  # readers of a column


class Column(NamedTuple):
    name: str
    dtype: str  # Arrow element type: int8, int32, int64, string
    depth: int = 0  # list nesting: 0 a value, 1 a list, 2 a list of lists
    readers: frozenset[str] = frozenset()
    written_by: str = "pipeline"  # or "dataset" (added around the pipeline)
    empty: Any = None  # the value of a refused row (default: [], "" or 0 by type)

    def empty_value(self) -> Any:
        if self.empty is not None:
            return self.empty
        return [] if self.depth else "" if self.dtype == "string" else 0


def _c(name: str, dtype: str, *readers: str, depth: int = 0, written_by: str = "pipeline", empty: Any = None):
    return Column(name, dtype, depth, frozenset(readers), written_by, empty)


_SEQUENCE = (  # one tokenized sequence: an SFT example, or an unpaired row's prompt + completion
    _c("input_ids", "int32", MODEL, KEPT, depth=1),
    _c("attention_mask", "int8", MODEL, KEPT, depth=1),
    _c("labels", "int64", MODEL, KEPT, depth=1),
)
_REFUSAL = (
    _c("drop_reason", "string", REPORT, STATS),  # a DropReason; "" for a kept row
    _c("drop_detail", "string", REPORT, STATS),  # the row's location and why
    _c("error_traceback", "string", REPORT),  # an unexpected exception's traceback (rows.guarded); else ""
)
_COUNTS = (
    _c("num_tokens_before", "int64", STATS),  # before truncation
    _c("num_tokens", "int64", REPORT, STATS, KEPT),
    _c("num_trained_tokens", "int64", REPORT, STATS),
    _c("dropped_turns", "int64", REPORT, STATS),
    _c("reasoning_trimmed_tokens", "int64", REPORT, STATS),
)
_PARSED = (
    _c("parse_report", "string", REPORT, STATS, empty="{}"),  # ParseReport JSON, defaults left out
    _c("content_hash", "string"),  # with data.dedup
)
_WHERE = (
    _c("source", "string", STATS, KEPT, written_by="dataset"),  # index:path of its data.datasets entry
    _c("location", "string", written_by="dataset"),  # file:line
    _c("domain", "string", KEPT, written_by="dataset"),  # data.domain_key's value
)
_IMAGES = (  # a vision-language model's rows (masking.images); a text row's are [] and 0
    _c("images", "string", MODEL, KEPT, depth=1),  # the kept turns' images, in order: absolute paths or data: URIs
    _c("num_images", "int64", REPORT, STATS),
    _c("num_image_tokens", "int64", REPORT, STATS),  # their tokens in input_ids (never trained)
)
_PROMPT_LENGTH = _c("prompt_length", "int64", MODEL, KEPT, STATS)  # tokens before the response(s), never trained


@dataclass(frozen=True)
class RowType:
    """The columns of one objective's processed row, in order."""

    objective: str  # the data.objective it is written for
    fields: tuple[Column, ...]

    def columns(self, reader: str | None = None, *, written_by: str | None = None) -> tuple[str, ...]:
        """Names of the columns ``reader`` reads (all without one), in row order."""
        return tuple(c.name for c in self.fields
                     if (reader is None or reader in c.readers) and (written_by is None or c.written_by == written_by))

    @cached_property
    def output_columns(self) -> tuple[str, ...]:
        """What the pipeline writes."""
        return self.columns(written_by="pipeline")

    @cached_property
    def model_columns(self) -> tuple[str, ...]:
        return self.columns(MODEL)

    @cached_property
    def kept_columns(self) -> tuple[str, ...]:
        return self.columns(KEPT)

    @cached_property
    def report_columns(self) -> tuple[str, ...]:
        return self.columns(REPORT)

    @cached_property
    def stats_columns(self) -> tuple[str, ...]:
        return self.columns(STATS)

    @cached_property
    def expanded_columns(self) -> tuple[str, ...]:
        return self.columns(EXPANDED)

    @cached_property
    def int_list_columns(self) -> tuple[tuple[str, str], ...]:
        """The pipeline's int-list columns and their element types (written as Arrow arrays: ``arrow_lists``)."""
        return tuple((c.name, c.dtype) for c in self.fields
                     if c.written_by == "pipeline" and c.depth == 1 and c.dtype != "string")

    @cached_property
    def _empty(self) -> tuple[dict[str, Any], tuple[str, ...]]:
        values = {c.name: c.empty_value() for c in self.fields if c.written_by == "pipeline"}
        return values, tuple(name for name, value in values.items() if isinstance(value, list))

    def empty(self) -> dict[str, Any]:
        """The pipeline columns of a row before (or without) an example: what a refused row keeps.

        One per row: a copy of the empty values worked out once, each list column a new list (the pipeline appends
        to ``expanded_*``)."""
        values, lists = self._empty
        out = values.copy()
        for name in lists:
            out[name] = []
        return out

    def features(self):
        """The ``datasets.Features`` of a processed dataset of this row type, in row order."""
        import datasets

        def feature(c: Column):
            f = datasets.Value(c.dtype)
            for _ in range(c.depth):
                f = datasets.Sequence(f)
            return f

        return datasets.Features({c.name: feature(c) for c in self.fields})

    @cached_property
    def schema(self):
        """The Arrow schema of ``features``."""
        return self.features().arrow_schema


SFT_ROW = RowType("sft", (
    *_SEQUENCE, *_REFUSAL, *_COUNTS,
    _c("token_fallback", "string", REPORT, STATS),  # truncate_side where the token-level cut ran
    _c("straddling_tokens", "int64", REPORT, STATS),
    *_PARSED,
    _c("expanded_input_ids", "int32", KEPT, EXPANDED, depth=2),
    _c("expanded_labels", "int64", KEPT, EXPANDED, depth=2),
    _c("expanded_tokens", "int64", REPORT, STATS),
    _c("expanded_trained_tokens", "int64", REPORT, STATS),
    _c("tool_schema_tokens", "int64", STATS),  # tokens of the template's tool block; -1: tools, block not found
    *_IMAGES,
    *_WHERE,
))
PAIR_ROW = RowType("preference", (
    _c("chosen_input_ids", "int32", MODEL, KEPT, depth=1),
    _c("chosen_labels", "int64", MODEL, KEPT, depth=1),
    _c("rejected_input_ids", "int32", MODEL, KEPT, depth=1),
    _c("rejected_labels", "int64", MODEL, KEPT, depth=1),
    _PROMPT_LENGTH,  # tokens both sides share before the response
    *_REFUSAL, *_COUNTS,
    _c("cut_sides", "string", REPORT, STATS),  # the sides whose response was cut: "chosen", "rejected" or both
    *_PARSED,
    _c("chosen_tokens", "int64", STATS),  # each side's length (after truncation)
    _c("rejected_tokens", "int64", STATS),
    *_IMAGES,  # the shared prompt's images (each side's tokens hold them: num_image_tokens a side)
    *_WHERE,
))
UNPAIRED_ROW = RowType("unpaired", (
    *_SEQUENCE, _PROMPT_LENGTH,
    _c("desirable", "int8", MODEL, KEPT, REPORT, STATS),  # the row's label: 1 desirable, 0 not
    *_REFUSAL, *_COUNTS,
    _c("token_fallback", "string", REPORT, STATS),  # "right" where the completion was cut
    *_PARSED,
    *_IMAGES,  # the prompt's images (the KL estimate's mismatched row keeps the prompt, so them too)
    *_WHERE,
))
PROMPT_ROW = RowType("prompt", (
    _c("input_ids", "int32", MODEL, KEPT, depth=1),  # the prompt rendered with the generation prompt (none trained)
    _c("prompt", "string", MODEL, KEPT),  # its messages (JSON): the reward functions' `prompts`
    _c("reward_columns", "string", MODEL, KEPT),  # the row's other columns (JSON), passed to them by name
    _c("generation_prompt_tokens", "int64", STATS),  # the last ids, what the generation prompt writes
    *_REFUSAL, *_COUNTS, *_PARSED,
    _c("source", "string", STATS, KEPT, written_by="dataset"),
    _c("location", "string", MODEL, KEPT, written_by="dataset"),  # file:line: a reward's error names the row
    _c("domain", "string", KEPT, written_by="dataset"),
))
ROW_TYPES = {t.objective: t for t in (SFT_ROW, PAIR_ROW, UNPAIRED_ROW, PROMPT_ROW)}  # data.objective -> its row type


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
