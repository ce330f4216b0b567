"""What every objective's pipeline shares: a batch of raw rows, each row's output columns, its budget, its
refusal, and the filters that read a row's canonical content.

A pipeline (``sft.process_sft_rows``, ``pairs.process_pair_rows``, ``unpaired.process_unpaired_rows``) is a plain
loop over ``Batch.rows``: each row's work entered in its ``Batch.spending`` (``data.row_budget``), its columns
written into ``Batch.outs`` (the objective's ``processed.RowType``), a ``RowRejected`` handed to
``Batch.refuse``; ``Batch.columns`` is what the pipeline returns.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from typing import Any

from qlora_train.config import DataConfig
from qlora_train.data import rule_check
from qlora_train.data.drops import DropReason
from qlora_train.data.parse import ParseReport
from qlora_train.data.processed import RowType
from qlora_train.masking import (
    DISAGREE,
    LossPolicy,
    RowBudget,
    RowRejected,
    RowSpending,
    TemplateLayout,
    template_layout,
)


def guarded(stage, *args, **kwargs):
    """Run one stage for one row: any exception becomes a ``RowRejected`` (``bad_row``), never a crash, with the
    exception's traceback (``RowRejected.traceback``, the row's ``error_traceback``): counted like a bad row, but
    a bug in our code, so ``dataset.check_unexpected_errors`` shows the first one and stops a run where they
    exceed 1% of the rows.

    >>> guarded(int, "x")
    Traceback (most recent call last):
    ...
    qlora_train.masking.messages.RowRejected: bad_row: unexpected ValueError: invalid literal for int() with base ...
    """
    try:
        return stage(*args, **kwargs)
    except RowRejected:
        raise
    except Exception as exc:  # a bug or an input nobody foresaw: counted with its location and traceback
        raise RowRejected.unexpected(exc) from exc


@dataclass
class Batch:
    """A batch of raw rows on its way through one objective's pipeline."""

    rows: list
    row_type: RowType
    outs: list[dict[str, Any]]  # each row's columns, refused rows with their drop_reason
    spending: list[RowSpending]  # each row's, entered around each part of its work
    where: list[str]  # each row's location, for drop details
    positions: Any  # each row's index in its source (data.rule_check)
    texts: list[str] | None  # each row as read (data.rule_check)
    cfg: DataConfig
    policy: LossPolicy
    layout: TemplateLayout  # probed once, before the rows (facts it cannot find stay unknown)

    @classmethod
    def of(cls, batch, row_type: RowType, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None,
           positions: list[int] | None = None, texts: list[str] | None = None) -> Batch:
        """A batch as ``datasets.map(batched=True)`` hands it (a dict of columns) or a list of rows.
        ``locations`` name the rows in drop details (default: ``row <index in batch>``); ``positions`` are their
        indices in their source (default: in the batch) and ``texts`` the rows as read (default: their canonical
        JSON), for ``data.rule_check``."""
        rows = _rows(batch)
        budget = RowBudget(**cfg.row_budget.model_dump())
        return cls(rows, row_type, [row_type.empty() for _ in rows], [RowSpending(budget) for _ in rows],
                   locations or [f"row {i}" for i in range(len(rows))], positions or range(len(rows)), texts, cfg,
                   LossPolicy.of(cfg), template_layout(tokenizer))

    def checked(self, i: int) -> bool:
        """Whether ``data.rule_check`` checks row ``i`` against the rule."""
        text = self.texts[i] if self.texts is not None else partial(rule_check.row_text, self.rows[i])
        return rule_check.selected(self.cfg.rule_check, self.positions[i], text, rule_check.first_rows(self.layout))

    def check_responses(self, i: int, report: ParseReport, prompt: list, responses: dict[str, list],
                        tools: list[dict] | None, tokenizer) -> None:
        """``data.rule_check`` on row ``i``'s responses (a pair's sides, an unpaired row's completion) where it is
        selected: the outcome counted in its report (written to the row), a disagreement refusing it."""
        if not self.checked(i):
            return
        check = guarded(rule_check.check_responses, prompt, responses, tools, tokenizer, policy=self.policy,
                        layout=self.layout, report=report)
        if check is None:  # a side the fast path refuses: fitting the row refuses it with that reason
            return
        rule_check.count(report, check)
        self.outs[i]["parse_report"] = report_json(report)
        if check.outcome == DISAGREE:
            raise rule_check.refusal(check)

    def refuse(self, i: int, rej: RowRejected) -> None:
        out = self.outs[i]
        if rej.reason == DropReason.OVER_BUDGET:  # also after an example of the row was filled
            out.update(self.row_type.empty())
        out.update(drop_reason=rej.reason, drop_detail=storable(f"{self.where[i]}: {rej.detail}"),
                   error_traceback=storable(rej.traceback))

    def each(self, fill) -> None:
        """``fill(i, row)`` for every row inside its budget, a refusal written to its row."""
        for i, row in enumerate(self.rows):
            try:
                with self.spending[i]:
                    fill(i, row)
            except RowRejected as rej:
                self.refuse(i, rej)

    def columns(self) -> dict[str, list]:
        """The rows' columns: the row type's pipeline columns, one entry per input row."""
        return {col: [o[col] for o in self.outs] for col in self.row_type.output_columns}


def storable(text: str) -> str:
    """Text as a string column stores it (UTF-8): a lone surrogate (an undecodable byte of a data file, which a
    refusal's detail quotes from a role, a name or a path) written as its escape, ``\\udcff``; other text as is.

    >>> storable("the prompt ends with a user\\udcff message")
    'the prompt ends with a user\\\\udcff message'
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _rows(batch: dict[str, list] | list[dict]) -> list[dict]:
    if isinstance(batch, list):
        return batch
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: batch[k][i] for k in keys} for i in range(n)]


_REPORT_DEFAULTS = vars(ParseReport())


def report_json(report: ParseReport) -> str:
    """A row's ParseReport as JSON, only the fields that differ from the defaults (``ParseReport.from_dict``
    restores the rest): most rows touch two or three fields, so this is a fraction of ``to_dict()``."""
    return json.dumps({k: v for k, v in vars(report).items() if v != _REPORT_DEFAULTS[k]})


def content_hash(obj: Any) -> str:
    """Stable hash of a row's canonical content (``content_hash``, computed only with ``dedup``). A lone surrogate
    (an undecodable byte in a field the template does not write) is hashed as it is, not refused here."""
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def content_chars(messages: list[dict]) -> int:
    """Characters of content and reasoning over all messages (what ``min_chars``/``max_chars`` measure)."""
    return sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in messages)


def check_length(n_chars: int, cfg: DataConfig) -> None:
    if n_chars < cfg.min_chars or (cfg.max_chars is not None and n_chars > cfg.max_chars):
        raise RowRejected(DropReason.FILTERED_BY_LENGTH,
                          f"{n_chars} characters, outside [{cfg.min_chars}, {cfg.max_chars or 'inf'}]")


def too_long(n: int, cfg: DataConfig) -> RowRejected:
    return RowRejected(DropReason.TOO_LONG, f"{n} tokens > max_length={cfg.max_length} (data.on_too_long: drop)")
