"""Sources -> processed, filtered train/eval datasets and a report where every row is accounted for.

    >>> train_ds, eval_ds, report = build_datasets(cfg.data, tokenizer)
    >>> report.rows_in == report.rows_kept + sum(report.dropped.values())
    True
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field

import datasets

from qlora_train.config import DataConfig
from qlora_train.data.messages import CONFIGURED_DROPS, BadRowError, DropReason
from qlora_train.data.parse import ParseReport
from qlora_train.data.pipeline import OUTPUT_COLUMNS, empty_output, process_rows
from qlora_train.data.sources import load_sources

log = logging.getLogger(__name__)
MODEL_COLUMNS = ("input_ids", "attention_mask", "labels")


class EmptyDatasetError(Exception):
    """Every row was dropped: nothing to train on."""


@dataclass
class DatasetReport:
    rows_in: int = 0
    rows_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    first_dropped: dict[str, str] = field(default_factory=dict)  # reason -> location and detail of the first
    train_rows: int = 0
    eval_rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    rows_turns_dropped: int = 0
    rows_reasoning_trimmed: int = 0
    rows_token_fallback: dict[str, int] = field(default_factory=dict)
    straddling_tokens: int = 0
    parse: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def lines(self) -> list[str]:
        out = [f"rows in {self.rows_in}, kept {self.rows_kept} (train {self.train_rows}, eval {self.eval_rows})"]
        for reason, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]):
            out.append(f"  dropped {n:>6} {reason}  e.g. {self.first_dropped[reason]}")
        share = self.trained_tokens / self.tokens if self.tokens else 0.0
        out.append(f"tokens {self.tokens}, trained {self.trained_tokens} ({share:.1%})")
        if self.rows_turns_dropped or self.rows_reasoning_trimmed or self.rows_token_fallback:
            out.append(f"truncation: turns dropped in {self.rows_turns_dropped} rows, reasoning trimmed in "
                       f"{self.rows_reasoning_trimmed}, token-level cut in {sum(self.rows_token_fallback.values())}")
        return out


def _process_raw_batch(batch: dict, tokenizer, cfg: DataConfig) -> dict:
    """datasets.map function: JSON-text rows (+ load errors, source) -> OUTPUT_COLUMNS + source."""
    ok = [i for i, err in enumerate(batch["load_error"]) if not err]
    good = process_rows([json.loads(batch["row"][i]) for i in ok], tokenizer, cfg,
                        locations=[batch["location"][i] for i in ok])
    out = {col: [] for col in OUTPUT_COLUMNS}
    j = 0
    for i, err in enumerate(batch["load_error"]):
        if err:  # unreadable line: dropped with its location
            row = empty_output()
            row["drop_reason"], row["drop_detail"] = DropReason.UNPARSEABLE_JSON, f"{batch['location'][i]}: {err}"
        else:
            row = {col: good[col][j] for col in OUTPUT_COLUMNS}
            j += 1
        for col in OUTPUT_COLUMNS:
            out[col].append(row[col])
    out["source"] = list(batch["source"])
    if cfg.on_bad_row == "error":
        stop_at_first_bad_row(out["drop_reason"], out["drop_detail"])
    return out


def stop_at_first_bad_row(reasons: list[str], details: list[str]) -> None:
    """``data.on_bad_row: error``: raise ``BadRowError`` for the first refused row (configured drops excepted)."""
    for reason, detail in zip(reasons, details):
        if reason and reason not in CONFIGURED_DROPS:
            raise BadRowError(f"bad row ({reason}) at {detail} [data.on_bad_row: error; use skip to drop and count "
                              "such rows]")


REPORT_COLUMNS = ("drop_reason", "drop_detail", "num_tokens", "num_trained_tokens", "dropped_turns",
                  "reasoning_trimmed_tokens", "token_fallback", "straddling_tokens", "parse_report")


def summarize_columns(cols: dict[str, list]) -> DatasetReport:
    """Counts over processed rows given as columns (at least ``REPORT_COLUMNS``)."""
    report = DatasetReport(rows_in=len(cols["drop_reason"]))
    dropped: Counter = Counter()
    for reason, detail in zip(cols["drop_reason"], cols["drop_detail"]):
        if reason:
            dropped[reason] += 1
            report.first_dropped.setdefault(reason, detail)
    report.dropped = dict(dropped)
    report.rows_kept = report.rows_in - sum(dropped.values())
    report.tokens = sum(cols["num_tokens"])
    report.trained_tokens = sum(cols["num_trained_tokens"])
    report.rows_turns_dropped = sum(1 for n in cols["dropped_turns"] if n)
    report.rows_reasoning_trimmed = sum(1 for n in cols["reasoning_trimmed_tokens"] if n)
    report.rows_token_fallback = dict(Counter(s for s in cols["token_fallback"] if s))
    report.straddling_tokens = sum(cols["straddling_tokens"])
    parse = ParseReport.total(ParseReport.from_dict(json.loads(p)) for p in cols["parse_report"] if p != "{}")
    report.parse = parse.to_dict()
    return report


def summarize(processed: datasets.Dataset) -> DatasetReport:
    """Counts over the processed (not yet filtered) dataset."""
    return summarize_columns(processed.select_columns(list(REPORT_COLUMNS)).to_dict())


def process_dataset(raw: datasets.Dataset, tokenizer, cfg: DataConfig) -> datasets.Dataset:
    """Raw rows -> every row processed (kept rows have tokens, dropped rows a reason)."""
    return raw.map(
        _process_raw_batch, batched=True, batch_size=cfg.batch_size, num_proc=cfg.num_proc,
        fn_kwargs={"tokenizer": tokenizer, "cfg": cfg}, remove_columns=raw.column_names,
        desc="preprocessing",
    )


def load_and_process(cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Config -> (raw rows, processed rows), aligned row for row (the map keeps order)."""
    raw = load_sources(cfg.datasets, cache_dir=cfg.cache_dir)
    return raw, process_dataset(raw, tokenizer, cfg)


def build_datasets(cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, datasets.Dataset | None, DatasetReport]:
    """Config -> (train, eval or None, report). Raises ``EmptyDatasetError`` if no row survives."""
    _, processed = load_and_process(cfg, tokenizer)
    report = summarize(processed)
    if report.rows_kept == 0:
        reasons = ", ".join(f"{r}: {n}" for r, n in report.dropped.items())
        raise EmptyDatasetError(f"all {report.rows_in} rows were dropped ({reasons}); first: "
                                + "; ".join(report.first_dropped.values()))
    kept = processed.filter(lambda r: [not x for x in r], input_columns=["drop_reason"], batched=True,
                            desc="dropping refused rows")
    kept = kept.select_columns(list(MODEL_COLUMNS))
    eval_ds = None
    if cfg.eval_fraction > 0 and len(kept) >= 2:
        split = kept.train_test_split(test_size=cfg.eval_fraction, seed=cfg.shuffle_seed)
        kept, eval_ds = split["train"], split["test"]
    report.train_rows, report.eval_rows = len(kept), len(eval_ds) if eval_ds is not None else 0
    for reason, n in report.dropped.items():
        log.warning("dropped %d rows: %s (first: %s)", n, reason, report.first_dropped[reason])
    return kept, eval_ds, report
