"""All stages composed: raw rows -> training examples, or a drop reason per row.

    >>> out = process_rows([{"messages": [...]}], tok, DataConfig(max_length=512))
    >>> out["labels"][0][:4], out["drop_reason"][0]
    ([-100, -100, -100, -100], '')

Works on a batch (a dict of columns as ``datasets.map(batched=True)`` hands it,
or a list of row dicts) so the tokenizer is called once per batch. Every row
comes out: kept rows have tokens, dropped rows have ``drop_reason`` set and
empty token lists, to be counted and then filtered.

Chat schemas go parse -> render -> tokenize -> truncate -> ``make_labels``;
``segments`` and ``text`` rows skip the template (``formats``) and join at
tokenize; ``pretokenized`` rows join at ``make_labels``. Plain ``text`` rows
keep all their tokens here (``formats.split_into_blocks`` cuts them later).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import numpy as np

from qlora_train.config import DataConfig
from qlora_train.data.formats import (
    plain_text_and_mask,
    pretokenized_ids_and_mask,
    segments_text_and_mask,
    token_offsets,
)
from qlora_train.data.messages import DropReason, RowRejected
from qlora_train.data.parse import CHAT_SCHEMAS, ParseReport, canonicalize_row, map_fields, resolve_schema
from qlora_train.data.render import render_conversation
from qlora_train.data.tokenize import IGNORE_INDEX, count_straddling, encode_batch, make_labels
from qlora_train.data.truncate import Measured, structured_truncate_messages

OUTPUT_COLUMNS = (
    "input_ids", "attention_mask", "labels", "drop_reason", "drop_detail", "num_tokens_before",
    "num_tokens", "num_trained_tokens", "dropped_turns", "reasoning_trimmed_tokens", "token_fallback",
    "straddling_tokens", "parse_report", "content_hash",
)


def _rows(batch: dict[str, list] | list[dict]) -> list[dict]:
    if isinstance(batch, list):
        return batch
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: batch[k][i] for k in keys} for i in range(n)]


def empty_output() -> dict[str, Any]:
    return {
        "input_ids": [], "attention_mask": [], "labels": [], "drop_reason": "", "drop_detail": "",
        "num_tokens_before": 0, "num_tokens": 0, "num_trained_tokens": 0, "dropped_turns": 0,
        "reasoning_trimmed_tokens": 0, "token_fallback": "", "straddling_tokens": 0, "parse_report": "{}",
        "content_hash": "",
    }


def _hash(obj: Any) -> str:
    """Stable hash of a row's canonical content (``content_hash``, computed only with ``dedup``)."""
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode(), digest_size=16).hexdigest()


def content_chars(messages: list[dict]) -> int:
    """Characters of content and reasoning over all messages (what ``min_chars``/``max_chars`` measure)."""
    return sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in messages)


def _check_length(n_chars: int, cfg: DataConfig) -> None:
    if n_chars < cfg.min_chars or (cfg.max_chars is not None and n_chars > cfg.max_chars):
        raise RowRejected(DropReason.FILTERED_BY_LENGTH,
                          f"{n_chars} characters, outside [{cfg.min_chars}, {cfg.max_chars or 'inf'}]")


def _template_free(row: Any, schema: str, tokenizer, cfg: DataConfig) -> tuple[str | list[int], np.ndarray]:
    """A segments/text row -> (text, char mask); a pretokenized row -> (ids, token mask)."""
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"schema {schema} needs a mapping, got {type(row).__name__}")
    row = map_fields(row, cfg.field_mappings)
    if schema == "pretokenized":
        return pretokenized_ids_and_mask(row, vocab_size=len(tokenizer))
    text, mask = segments_text_and_mask(row) if schema == "segments" else plain_text_and_mask(
        row, eos_token=tokenizer.eos_token)
    _check_length(len(text) - (len(tokenizer.eos_token) if schema == "text" else 0), cfg)
    return text, mask


def process_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None) -> dict[str, list]:
    """A batch of raw rows -> columns ``OUTPUT_COLUMNS`` (one entry per input row).

    ``locations`` name the rows in drop details (default: ``row <index in batch>``).
    """
    rows = _rows(batch)
    where = locations or [f"row {i}" for i in range(len(rows))]
    outs = [empty_output() for _ in rows]
    kw = dict(assistant_roles=tuple(cfg.assistant_roles), think_loss=cfg.think_loss, train_on_eos=cfg.train_on_eos)
    staged: list[tuple[int, Any, Any]] = []  # (row index, canonical row, rendered)
    plain: list[tuple[int, str, np.ndarray, int | None]] = []  # (row index, text, char mask, max length)
    for i, row in enumerate(rows):
        try:
            schema = resolve_schema(row, cfg) if isinstance(row, (dict, list)) else "unknown"
            if schema in CHAT_SCHEMAS or schema == "unknown":
                canon = canonicalize_row(row, cfg, tokenizer=tokenizer)
                outs[i]["parse_report"] = json.dumps(canon.report.to_dict())
                _check_length(content_chars(canon.messages), cfg)
                if cfg.dedup:
                    outs[i]["content_hash"] = _hash([canon.messages, canon.tools])
                rendered = render_conversation(canon.messages, tokenizer, tools=canon.tools, **kw)
                staged.append((i, canon, rendered))
                continue
            outs[i]["parse_report"] = json.dumps(ParseReport(schema, Counter({schema: 1}), rows=1).to_dict())
            text, mask = _template_free(row, schema, tokenizer, cfg)
            if cfg.dedup:
                outs[i]["content_hash"] = _hash([schema, text, mask.tolist()])
            if schema == "pretokenized":
                _finish(outs[i], text, token_offsets(len(text)), mask, cfg, where[i], max_length=cfg.max_length,
                        template_free=True)
            else:  # text rows keep every token: they are cut into blocks, not truncated
                plain.append((i, text, mask, None if schema == "text" else cfg.max_length))
        except RowRejected as rej:
            outs[i]["drop_reason"], outs[i]["drop_detail"] = rej.reason, f"{where[i]}: {rej.detail}"
    encoded = encode_batch([r.text for _, _, r in staged] + [t for _, t, _, _ in plain], tokenizer)
    for (i, _, mask, max_length), (ids, offsets) in zip(plain, encoded[len(staged):]):
        _finish(outs[i], ids, offsets, mask, cfg, where[i], max_length=max_length, template_free=True)
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
        _finish(out, ids, offsets, char_mask, cfg, where[i], max_length=cfg.max_length)
    return {col: [o[col] for o in outs] for col in OUTPUT_COLUMNS}


def _finish(out: dict, ids, offsets, char_mask, cfg: DataConfig, where: str, *, max_length: int | None,
            template_free: bool = False) -> None:
    """ids + offsets + char mask -> the example's columns in ``out`` (or a drop reason)."""
    if template_free:
        out["num_tokens_before"] = len(ids)
        if max_length is not None and len(ids) > max_length:
            out["token_fallback"] = cfg.truncate_side  # no structured truncation without messages
    example = make_labels(ids, offsets, char_mask, max_length=max_length, truncate_side=cfg.truncate_side)
    n_trained = int(np.count_nonzero(np.asarray(example["labels"]) != IGNORE_INDEX))
    out["straddling_tokens"] = count_straddling(offsets, char_mask)
    if n_trained == 0:
        out["drop_reason"] = DropReason.NO_TRAINED_TOKEN
        out["drop_detail"] = f"{where}: no trained token left within max_length={max_length}"
        return
    out.update(example, num_tokens=len(example["input_ids"]), num_trained_tokens=n_trained)
