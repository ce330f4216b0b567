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

import bisect
import json
import re
from typing import Any

import numpy as np

from qlora_train.config import DataConfig
from qlora_train.data.messages import DropReason, RowRejected
from qlora_train.data.parse import canonicalize_row
from qlora_train.data.render import RenderedConversation, render_conversation, template_layout
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


def empty_output() -> dict[str, Any]:
    return {
        "input_ids": [], "attention_mask": [], "labels": [], "drop_reason": "", "drop_detail": "",
        "num_tokens_before": 0, "num_tokens": 0, "num_trained_tokens": 0, "dropped_turns": 0,
        "reasoning_trimmed_tokens": 0, "token_fallback": "", "straddling_tokens": 0, "parse_report": "{}",
    }


def describe_exception(exc: BaseException, limit: int = 200) -> str:
    """An unexpected exception -> one short line naming its type (rows can hold huge strings)."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:limit] + '…' if len(msg) > limit else msg}"


def guarded(stage, *args, **kwargs):
    """Run one stage for one row: any exception becomes a ``RowRejected`` (``bad_row``), never a crash.

    >>> guarded(int, "x")  # raises RowRejected('bad_row', "ValueError: invalid literal ...")
    """
    try:
        return stage(*args, **kwargs)
    except RowRejected:
        raise
    except Exception as exc:  # a bug or an input nobody foresaw: counted with its location, not fatal
        raise RowRejected(DropReason.BAD_ROW, f"unexpected {describe_exception(exc)}") from exc


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(rendered: RenderedConversation) -> None:
    """Refuse a render holding a lone surrogate (a broken escape or undecodable bytes): no tokenizer can encode it."""
    m = _SURROGATE.search(rendered.text)
    if m is None:
        return
    k = bisect.bisect_left(rendered.message_ends, m.start() + 1)  # first message whose part ends after it
    part = f"messages[{k}]" if k < len(rendered.message_ends) else "tools or template text"
    raise RowRejected(DropReason.INVALID_UNICODE,
                      f"{part}: lone surrogate {m.group()!a} at character {m.start()} of the render")


def _encode_each(texts: list[str], tokenizer) -> list[tuple[list[int], np.ndarray] | RowRejected]:
    """``encode_batch``, falling back to one text at a time so one bad text cannot fail the batch."""
    try:
        return encode_batch(texts, tokenizer)
    except Exception:
        out = []
        for text in texts:
            try:
                out.append(guarded(encode_batch, [text], tokenizer)[0])
            except RowRejected as rej:
                out.append(rej)
        return out


def _example(canon, rendered, ids, offsets, tokenizer, cfg: DataConfig, out: dict) -> None:
    """One rendered + tokenized row -> ``out`` filled with its example (truncated as configured)."""
    kw = dict(assistant_roles=tuple(cfg.assistant_roles), think_loss=cfg.think_loss)
    out["num_tokens_before"] = len(ids)
    char_mask = rendered.char_mask
    if len(ids) > cfg.max_length:
        if cfg.on_too_long == "drop":
            raise RowRejected(DropReason.TOO_LONG, f"{len(ids)} tokens > max_length={cfg.max_length} "
                                                   "(data.on_too_long: drop)")
        tr = structured_truncate_messages(
            canon.messages, tokenizer, max_length=cfg.max_length, tools=canon.tools,
            measured=Measured(rendered, ids, offsets), **kw,
        )
        ids, offsets, char_mask = tr.final.input_ids, tr.final.offsets, tr.final.rendered.char_mask
        out["dropped_turns"] = tr.dropped_turns
        out["reasoning_trimmed_tokens"] = tr.reasoning_trimmed_tokens
        if tr.needs_token_fallback:
            out["token_fallback"] = cfg.truncate_side
    example = make_labels(ids, offsets, char_mask, max_length=cfg.max_length, truncate_side=cfg.truncate_side)
    n_trained = int(np.count_nonzero(np.asarray(example["labels"]) != IGNORE_INDEX))
    out["straddling_tokens"] = count_straddling(offsets, char_mask)
    if n_trained == 0:
        raise RowRejected(DropReason.NO_TRAINED_TOKEN, f"no trained token left within max_length={cfg.max_length}")
    out.update(example, num_tokens=len(example["input_ids"]), num_trained_tokens=n_trained)


def process_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None) -> dict[str, list]:
    """A batch of raw rows -> columns ``OUTPUT_COLUMNS`` (one entry per input row).

    No exception from a row escapes: a stage that refuses a row, or fails on it
    unexpectedly, sets that row's ``drop_reason`` (a ``DropReason``) and
    ``drop_detail`` (its location and why). ``locations`` name the rows in drop
    details (default: ``row <index in batch>``).
    """
    rows = _rows(batch)
    where = locations or [f"row {i}" for i in range(len(rows))]
    outs = [empty_output() for _ in rows]
    kw = dict(assistant_roles=tuple(cfg.assistant_roles), think_loss=cfg.think_loss)
    template_layout(tokenizer)  # a template that cannot be probed is a setup error, not a row's
    staged: list[tuple[int, Any, Any]] = []  # (row index, canonical row, rendered)
    for i, row in enumerate(rows):
        try:
            canon = guarded(canonicalize_row, row, cfg, tokenizer=tokenizer)
            outs[i]["parse_report"] = json.dumps(canon.report.to_dict())
            rendered = guarded(render_conversation, canon.messages, tokenizer, tools=canon.tools, **kw)
            check_unicode(rendered)
            staged.append((i, canon, rendered))
        except RowRejected as rej:
            outs[i]["drop_reason"], outs[i]["drop_detail"] = rej.reason, f"{where[i]}: {rej.detail}"
    encoded = _encode_each([r.text for _, _, r in staged], tokenizer)
    for (i, canon, rendered), enc in zip(staged, encoded):
        try:
            if isinstance(enc, RowRejected):
                raise enc
            guarded(_example, canon, rendered, *enc, tokenizer, cfg, outs[i])
        except RowRejected as rej:
            outs[i]["drop_reason"], outs[i]["drop_detail"] = rej.reason, f"{where[i]}: {rej.detail}"
    return {col: [o[col] for o in outs] for col in OUTPUT_COLUMNS}
