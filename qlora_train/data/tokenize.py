"""Stage 4: tokenize the rendered text and project the char mask onto tokens -> labels.

    >>> out = tokenize_with_char_mask(text, char_mask, tok)
    >>> out.keys()
    dict_keys(['input_ids', 'attention_mask', 'labels'])

Labels are made here and nowhere else. Projection rule: a token is trained
when its FIRST character is trained. A token belongs to where it starts, as in
generation, where the model emits tokens from the position where the prompt
ends. Tokens whose characters are part trained, part masked ("straddling") are
rare, because special tokens never merge with text; with the Qwen tokenizer they
are whitespace runs such as the header's "\n" merged with content that starts
with " \n" (masked: it starts in the header) or a reasoning's final "." merged
with the masked "\n" before "</think>" (trained: it starts in the reasoning).
``count_straddling`` counts them. ``IGNORE_INDEX`` marks tokens without loss.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
from tokenizers import Tokenizer

IGNORE_INDEX = -100


def _offsets_array(offsets: list[tuple[int, int]]) -> np.ndarray:
    """[(start, end), ...] -> int64 array [n, 2], without building n small arrays."""
    return np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)


def _rust_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer when calling it directly gives exactly
    what ``tokenizer(texts, add_special_tokens=False)`` gives (no truncation, padding or special-token
    splitting configured on it), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or backend.truncation is not None or backend.padding is not None:
        return None
    if backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend


def encode_batch(texts: list[str], tokenizer) -> list[tuple[list[int], np.ndarray]]:
    """One batched fast-tokenizer call -> per text ``(input_ids, offsets[n, 2])``.

    ``add_special_tokens=False``: the ids are exactly the tokenization of the
    rendered text, so no BOS is added on top of one the template wrote. The
    Rust backend is called directly when that is equivalent (it skips
    transformers' per-encoding conversion to dicts), else the tokenizer itself.
    """
    if not texts:
        return []
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return [(enc.ids, _offsets_array(enc.offsets))
                for enc in backend.encode_batch(texts, add_special_tokens=False)]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    return [(ids, _offsets_array(offs)) for ids, offs in zip(enc["input_ids"], enc["offset_mapping"])]


def trained_token_mask(offsets: np.ndarray, char_mask: np.ndarray) -> np.ndarray:
    """offsets[n, 2] + char_mask[len(text)] -> bool[n]: the token's first character is trained."""
    if len(char_mask) == 0:
        return np.zeros(len(offsets), dtype=bool)
    starts = np.minimum(offsets[:, 0], len(char_mask) - 1)
    return (char_mask[starts] > 0) & (offsets[:, 1] > offsets[:, 0])


def count_straddling(offsets: np.ndarray, char_mask: np.ndarray) -> int:
    """Tokens whose characters are partly trained and partly masked.

    A token straddles when the mask changes value inside it: some boundary b
    (``char_mask[b] != char_mask[b - 1]``) has ``start < b < end``. Boundaries
    are few (two per trained span), so this costs two searches per token
    instead of a pass over every character.
    """
    char_mask = np.asarray(char_mask)
    boundaries = np.flatnonzero(char_mask[1:] != char_mask[:-1]) + 1
    inside = np.searchsorted(boundaries, offsets[:, 1], "left") - np.searchsorted(boundaries, offsets[:, 0], "right")
    return int(np.count_nonzero(inside > 0))


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """bool[n] -> [(start, stop), ...] of its runs of True."""
    if len(mask) == 0:
        return []
    edges = (np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist()
    if mask[0]:
        edges.insert(0, 0)
    if mask[-1]:
        edges.append(len(mask))
    return list(zip(edges[::2], edges[1::2]))


def make_labels(
    input_ids: list[int],
    offsets: np.ndarray,
    char_mask: np.ndarray,
    *,
    max_length: int | None = None,
    truncate_side: str = "left",
) -> dict[str, list[int]]:
    """The one place labels are made: ids + offsets + char mask -> input_ids, attention_mask, labels.

    When ``max_length`` is exceeded, tokens are cut on ``truncate_side``
    (``left`` keeps the last ``max_length`` tokens, ``right`` the first).
    """
    ids = input_ids if isinstance(input_ids, list) else list(input_ids)
    labels = [IGNORE_INDEX] * len(ids)
    for a, b in _runs(trained_token_mask(offsets, char_mask)):  # a few runs: one or two per trained turn
        labels[a:b] = ids[a:b]
    if max_length is not None and len(ids) > max_length:
        cut = slice(len(ids) - max_length, None) if truncate_side == "left" else slice(0, max_length)
        ids, labels = ids[cut], labels[cut]
    assert len(ids) == len(labels), "input_ids and labels must have the same length"
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def tokenize_with_char_mask(
    text: str,
    char_mask,
    tokenizer,
    *,
    max_length: int | None = None,
    truncate_side: str = "left",
) -> dict[str, list[int]]:
    """Rendered text + char mask -> ``input_ids``, ``attention_mask``, ``labels`` (-100 = ignored)."""
    char_mask = np.asarray(char_mask, dtype=np.uint8)
    if len(char_mask) != len(text):
        raise ValueError(f"char_mask has {len(char_mask)} entries for {len(text)} characters")
    (ids, offsets), = encode_batch([text], tokenizer)
    return make_labels(ids, offsets, char_mask, max_length=max_length, truncate_side=truncate_side)
