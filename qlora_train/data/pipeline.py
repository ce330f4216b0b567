"""All stages composed: raw rows -> training examples, or a drop reason per row.

    >>> out = process_rows([{"messages": [...]}], tok, DataConfig(max_length=512))
    >>> out["labels"][0][:4], out["drop_reason"][0]
    ([-100, -100, -100, -100], '')

Works on a batch (a dict of columns as ``datasets.map(batched=True)`` hands it,
or a list of row dicts) so the tokenizer is called once per batch. Every row
comes out: kept rows have tokens, dropped rows have ``drop_reason`` set and
empty token lists, to be counted and then filtered.
"""

from __future__ import annotations

import json
from typing import Any

from qlora_train.config import DataConfig
from qlora_train.data.messages import DropReason, RowRejected
from qlora_train.data.parse import ParseReport, canonicalize_row
from qlora_train.data.render import render_conversation
from qlora_train.data.tokenize import IGNORE_INDEX, count_straddling, encode_batch, make_labels
from qlora_train.data.truncate import Measured, structured_truncate_messages

OUTPUT_COLUMNS = (
    "input_ids", "attention_mask", "labels", "drop_reason", "drop_detail", "num_tokens_before",
    "num_tokens", "num_trained_tokens", "dropped_turns", "reasoning_trimmed_tokens", "token_fallback",
    "straddling_tokens", "parse_report",
)


def _rows(batch: dict[str, list] | list[dict]) -> list[dict]:
    if isinstance(batch, list):
        return batch
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: batch[k][i] for k in keys} for i in range(n)]


_REPORT_DEFAULTS = vars(ParseReport())


def _report_json(report: ParseReport) -> str:
    """A row's ParseReport as JSON, only the fields that differ from the defaults (``ParseReport.from_dict``
    restores the rest): most rows touch two or three fields, so this is a fraction of ``to_dict()``."""
    return json.dumps({k: v for k, v in vars(report).items() if v != _REPORT_DEFAULTS[k]})


def empty_output() -> dict[str, Any]:
    return {
        "input_ids": [], "attention_mask": [], "labels": [], "drop_reason": "", "drop_detail": "",
        "num_tokens_before": 0, "num_tokens": 0, "num_trained_tokens": 0, "dropped_turns": 0,
        "reasoning_trimmed_tokens": 0, "token_fallback": "", "straddling_tokens": 0, "parse_report": "{}",
    }


def process_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None) -> dict[str, list]:
    """A batch of raw rows -> columns ``OUTPUT_COLUMNS`` (one entry per input row).

    ``locations`` name the rows in drop details (default: ``row <index in batch>``).
    """
    rows = _rows(batch)
    where = locations or [f"row {i}" for i in range(len(rows))]
    outs = [empty_output() for _ in rows]
    kw = dict(assistant_roles=tuple(cfg.assistant_roles), think_loss=cfg.think_loss)
    staged: list[tuple[int, Any, Any]] = []  # (row index, canonical row, rendered)
    for i, row in enumerate(rows):
        try:
            canon = canonicalize_row(row, cfg, tokenizer=tokenizer)
            outs[i]["parse_report"] = _report_json(canon.report)
            rendered = render_conversation(canon.messages, tokenizer, tools=canon.tools, **kw)
            staged.append((i, canon, rendered))
        except RowRejected as rej:
            outs[i]["drop_reason"], outs[i]["drop_detail"] = rej.reason, f"{where[i]}: {rej.detail}"
    encoded = encode_batch([r.text for _, _, r in staged], tokenizer)
    for (i, canon, rendered), (ids, offsets) in zip(staged, encoded):
        out = outs[i]
        out["num_tokens_before"] = len(ids)
        char_mask = rendered.char_mask
        try:
            if len(ids) > cfg.max_length:
                tr = structured_truncate_messages(
                    canon.messages, tokenizer, max_length=cfg.max_length, tools=canon.tools,
                    measured=Measured(rendered, ids, offsets), **kw,
                )
                ids, offsets, char_mask = tr.final.input_ids, tr.final.offsets, tr.final.rendered.char_mask
                out["dropped_turns"] = tr.dropped_turns
                out["reasoning_trimmed_tokens"] = tr.reasoning_trimmed_tokens
                if tr.needs_token_fallback:
                    out["token_fallback"] = cfg.truncate_side
        except RowRejected as rej:
            out["drop_reason"], out["drop_detail"] = rej.reason, f"{where[i]}: {rej.detail}"
            continue
        example = make_labels(ids, offsets, char_mask, max_length=cfg.max_length, truncate_side=cfg.truncate_side)
        n_trained = len(example["labels"]) - example["labels"].count(IGNORE_INDEX)
        out["straddling_tokens"] = count_straddling(offsets, char_mask)
        if n_trained == 0:
            out["drop_reason"] = DropReason.NO_TRAINED_TOKEN
            out["drop_detail"] = f"{where[i]}: no trained token left within max_length={cfg.max_length}"
            continue
        out.update(example, num_tokens=len(example["input_ids"]), num_trained_tokens=n_trained)
    return {col: [o[col] for o in outs] for col in OUTPUT_COLUMNS}
