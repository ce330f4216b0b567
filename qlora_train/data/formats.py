"""Template-free formats: rows that become (text, char mask) or token ids without a chat template.

    >>> segments_text_and_mask({"segments": [{"text": "Q: 2+2\\n", "label": False}, {"text": "A: 4", "label": True}]})
    ('Q: 2+2\\nA: 4', array([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=uint8))
    >>> plain_text_and_mask({"text": "Once"}, eos_token="<|endoftext|>")[0]
    'Once<|endoftext|>'
    >>> pretokenized_ids_and_mask({"input_ids": [5, 6], "labels": [-100, 6]}, vocab_size=10)
    ([5, 6], array([0, 1], dtype=uint8))

The text formats then take the same path as chat rows (tokenize with offsets,
``make_labels``); a pretokenized row is handed to ``make_labels`` as a text of
one character per token (``token_offsets``), so labels are still made in one
place. ``split_into_blocks`` cuts a long plain text into ``max_length`` blocks
instead of dropping its tail.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qlora_train.data.drops import DropReason
from qlora_train.masking import IGNORE_INDEX, RowRejected

TEXT_KEYS = ("text", "completion")


def segments_text_and_mask(row: dict) -> tuple[str, np.ndarray]:
    """``{"segments": [{"text", "label": bool}, …]}`` -> (concatenated text, 1 where ``label`` is true)."""
    segments = row.get("segments")
    if not isinstance(segments, list) or not segments:
        raise RowRejected(DropReason.BAD_ROW, "segments: expected a non-empty list of {text, label}")
    pieces, masks = [], []
    for j, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
            raise RowRejected(DropReason.BAD_ROW, f"segments[{j}]: expected {{text: str, label: bool}}")
        if not isinstance(seg.get("label"), bool):
            raise RowRejected(DropReason.BAD_ROW, f"segments[{j}].label: expected true or false")
        pieces.append(seg["text"])
        masks.append(np.full(len(seg["text"]), seg["label"], dtype=np.uint8))
    return "".join(pieces), np.concatenate(masks)


def plain_text_and_mask(row: dict, *, eos_token: str | None) -> tuple[str, np.ndarray]:
    """``{"text": …}`` (or ``completion``) -> (text + EOS, all ones): every token is trained."""
    key = next((k for k in TEXT_KEYS if isinstance(row.get(k), str)), None)
    if key is None:
        raise RowRejected(DropReason.BAD_ROW, f"text: expected a string under one of {TEXT_KEYS}")
    if not row[key].strip():
        raise RowRejected(DropReason.FILTERED_BY_LENGTH, f"field '{key}' is empty")
    if not eos_token:
        raise ValueError("schema text needs a tokenizer with an eos_token")
    text = row[key] + eos_token
    return text, np.ones(len(text), dtype=np.uint8)


def _int_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise RowRejected(DropReason.BAD_PRETOKENIZED, f"{key}: expected a list of integers")
    return value


def pretokenized_ids_and_mask(row: dict, *, vocab_size: int) -> tuple[list[int], np.ndarray]:
    """``input_ids`` (+ ``labels``, ``attention_mask``) -> (ids, 1 per trained token), validated.

    Without ``labels`` every token is trained. A label must be ``-100`` or the
    id at its position; trailing ``attention_mask`` zeros (padding) are cut;
    anything else refuses the row as ``bad_pretokenized``.
    """
    ids = _int_list(row.get("input_ids"), "input_ids")
    if not ids:
        raise RowRejected(DropReason.BAD_PRETOKENIZED, "input_ids is empty")
    bad = next((j for j, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RowRejected(DropReason.BAD_PRETOKENIZED,
                          f"input_ids[{bad}]={ids[bad]} is outside the vocabulary (size {vocab_size})")
    n = len(ids)
    if row.get("attention_mask") is not None:
        attn = _int_list(row["attention_mask"], "attention_mask")
        if len(attn) != len(ids):
            raise RowRejected(DropReason.BAD_PRETOKENIZED, f"attention_mask has {len(attn)} entries for {len(ids)} ids")
        n = len(attn)
        while n and attn[n - 1] == 0:
            n -= 1
        if any(a != 1 for a in attn[:n]):
            raise RowRejected(DropReason.BAD_PRETOKENIZED, "attention_mask: zeros are only allowed as trailing padding")
    if row.get("labels") is None:
        return ids[:n], np.ones(n, dtype=np.uint8)
    labels = _int_list(row["labels"], "labels")
    if len(labels) != len(ids):
        raise RowRejected(DropReason.BAD_PRETOKENIZED, f"labels has {len(labels)} entries for {len(ids)} ids")
    wrong = next((j for j in range(n) if labels[j] not in (IGNORE_INDEX, ids[j])), None)
    if wrong is not None:
        raise RowRejected(DropReason.BAD_PRETOKENIZED,
                          f"labels[{wrong}]={labels[wrong]} is neither -100 nor input_ids[{wrong}]={ids[wrong]}")
    return ids[:n], (np.asarray(labels[:n]) != IGNORE_INDEX).astype(np.uint8)


def split_into_blocks(example: dict[str, list[int]], max_length: int) -> list[dict[str, list[int]]]:
    """An example longer than ``max_length`` -> consecutive blocks of ``max_length`` tokens (the last shorter).

    >>> [b["input_ids"] for b in split_into_blocks({"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1],
    ...                                             "labels": [1, 2, 3]}, 2)]
    [[1, 2], [3]]
    """
    n = len(example["input_ids"])
    return [{k: v[a: a + max_length] for k, v in example.items()} for a in range(0, n, max_length)]
