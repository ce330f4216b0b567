"""Stage 3: tokenize the rendered text and project the char mask onto tokens -> labels.

    >>> out = tokenize_with_char_mask("question answer", [0] * 8 + [1] * 7, tok)
    >>> [tok.decode(i) for i in out["input_ids"]], out["labels"] == [-100, out["input_ids"][1]]
    (['question', ' answer'], True)

Labels are made here and nowhere else. Projection rule: a token is trained
when its FIRST character is trained. A token belongs to where it starts, as in
generation, where the model emits tokens from the position where the prompt
ends. Tokens whose characters are part trained, part masked ("straddling") are
rare, because special tokens never merge with text; with the Qwen tokenizer they
are whitespace runs such as the header's "\n" merged with content that starts
with " \n" (masked: it starts in the header) or a reasoning's final "." merged
with the masked "\n" before "</think>" (trained: it starts in the reasoning).
``project_char_mask`` counts them. ``IGNORE_INDEX`` marks tokens without loss.

Offsets come in two kinds with the same rule. ``EncodingOffsets`` reads a few
offsets on demand from the tokenizer's encoding, for tokenizers whose offsets
are in text order by construction (``text_order_forms``): byte-level BPE such as
Qwen's and Llama 3's. ``OffsetArray`` holds every token's offsets and applies
the rule to each token, for any tokenizer.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

IGNORE_INDEX = -100


class TokenMask(NamedTuple):
    """The char mask projected onto tokens."""

    runs: list[tuple[int, int]]  # token index ranges [i, j) of trained tokens, in order, disjoint
    straddling: int  # tokens partly trained and partly masked (diagnostics)


def _edges(char_mask: np.ndarray) -> list[int]:
    """Run edges of the trained characters, flat: [a0, b0, a1, b1, ...] for runs [a0, b0), [a1, b1), ..."""
    trained = np.asarray(char_mask) > 0
    if len(trained) == 0:
        return []
    edges = (np.flatnonzero(trained[1:] != trained[:-1]) + 1).tolist()
    if trained[0]:
        edges.insert(0, 0)
    if trained[-1]:
        edges.append(len(trained))
    return edges


class OffsetArray:
    """Every token's ``(start, end)`` in an int64 array [n, 2]; the rule applied token by token (any tokenizer)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[int, int]]) -> OffsetArray:
        flat = np.fromiter(chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
        return cls(flat.reshape(-1, 2))

    def __len__(self) -> int:
        return len(self.array)

    def starts(self) -> np.ndarray:
        return self.array[:, 0]

    def count_starting_in(self, a: int, b: int, n_chars: int) -> int:
        """Tokens whose first character is in ``[a, b)``."""
        lo, hi = np.searchsorted(self.array[:, 0], (a, b))
        return int(hi - lo)

    def tokens_before(self, pos: int, n_chars: int) -> tuple[int, int]:
        """``(tokens wholly before pos, tokens starting before pos)``: they differ by one where a token
        straddles ``pos``."""
        starting = int(np.searchsorted(self.array[:, 0], pos, "left"))
        return starting - int(starting > 0 and self.array[starting - 1, 1] > pos), starting

    def project(self, char_mask: np.ndarray) -> TokenMask:
        starts, ends = self.array[:, 0], self.array[:, 1]
        if len(char_mask) == 0:
            return TokenMask([], 0)
        trained = (np.asarray(char_mask)[np.minimum(starts, len(char_mask) - 1)] > 0) & (ends > starts)
        flags = np.concatenate(([False], trained, [False]))
        edges = np.flatnonzero(flags[1:] != flags[:-1]).tolist()
        inner = np.asarray([b for b in _edges(char_mask) if 0 < b < len(char_mask)], dtype=np.int64)
        # a token straddles when some inner edge b has start < b < end
        inside = np.searchsorted(inner, ends, "left") - np.searchsorted(inner, starts, "right")
        return TokenMask(list(zip(edges[::2], edges[1::2])), int(np.count_nonzero(inside > 0)))


class EncodingOffsets:
    """Offsets read on demand from a ``tokenizers.Encoding`` whose offsets are in text order: starts and
    ends non-decreasing and every token at least one character long (``text_order_forms``).

    Then the tokens starting in a run of trained characters ``[a, b)`` are one index range from the first
    token starting at or after ``a`` to the first starting at or after ``b``, and the tokens straddling an
    edge ``b`` are one range from the first token containing ``b``. A few lookups per trained turn find
    them; no per-token work is done in Python.
    """

    __slots__ = ("encoding", "n")

    def __init__(self, encoding):
        self.encoding = encoding
        self.n = len(encoding)

    def __len__(self) -> int:
        return self.n

    def starts(self) -> np.ndarray:
        return np.fromiter((s for s, _ in self.encoding.offsets), dtype=np.int64, count=self.n)

    def count_starting_in(self, a: int, b: int, n_chars: int) -> int:
        """Tokens whose first character is in ``[a, b)``: two lookups, no per-token work."""
        try:
            return self._first_starting_at(b, n_chars) - self._first_starting_at(a, n_chars)
        except _Uncovered:
            return OffsetArray.from_pairs(self.encoding.offsets).count_starting_in(a, b, n_chars)

    def tokens_before(self, pos: int, n_chars: int) -> tuple[int, int]:
        """``(tokens wholly before pos, tokens starting before pos)``: they differ by one where a token
        straddles ``pos``."""
        try:
            starting = self._first_starting_at(pos, n_chars)
        except _Uncovered:
            return OffsetArray.from_pairs(self.encoding.offsets).tokens_before(pos, n_chars)
        return starting - int(starting > 0 and self.encoding.token_to_chars(starting - 1)[1] > pos), starting

    def _first_starting_at(self, pos: int, n_chars: int) -> int:
        """Index of the first token whose start is >= ``pos`` (``n`` when none)."""
        if pos >= n_chars:  # every token starts inside the text
            return self.n
        t = self._first_containing(pos)
        while t < self.n and self.encoding.token_to_chars(t)[0] < pos:  # tokens of a split character share it
            t += 1
        return t

    def _first_containing(self, pos: int) -> int:
        t = self.encoding.char_to_token(pos)
        if t is None:  # the tokenizer dropped the character (a BPE without byte level or unk token)
            raise _Uncovered
        return t

    def project(self, char_mask: np.ndarray) -> TokenMask:
        try:
            return self._project(char_mask)
        except _Uncovered:
            return OffsetArray.from_pairs(self.encoding.offsets).project(char_mask)

    def _project(self, char_mask: np.ndarray) -> TokenMask:
        edges, n_chars, enc = _edges(char_mask), len(char_mask), self.encoding
        runs = []
        for a, b in zip(edges[::2], edges[1::2]):
            i, j = self._first_starting_at(a, n_chars), self._first_starting_at(b, n_chars)
            if i < j:
                runs.append((i, j))
        straddling = covered = 0
        for b in edges:
            if not 0 < b < n_chars:
                continue
            t = self._first_containing(b)
            if enc.token_to_chars(t)[0] < b:  # tokens t .. (first starting at b) contain b
                lo, hi = max(t, covered), self._first_starting_at(b, n_chars)
                if hi > lo:
                    straddling += hi - lo
                    covered = hi
        return TokenMask(runs, straddling)


class _Uncovered(Exception):
    """A character no token contains (``EncodingOffsets`` then reads every offset)."""


Offsets = OffsetArray | EncodingOffsets


def project_char_mask(offsets: Offsets, char_mask: np.ndarray) -> TokenMask:
    """offsets + char_mask[len(text)] -> ``TokenMask``: a token is trained when its first character is.

    A token with no characters (``start == end``) is never trained. A token
    straddles when the mask changes value inside it: some run edge ``b`` has
    ``start < b < end``.
    """
    return offsets.project(char_mask)


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


_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_SPLITTING_PRE_TOKENIZERS = ("Split", "Digits", "Punctuation")


def _spec(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _flatten(spec: dict | None, key: str) -> list[dict]:
    if spec is None:
        return []
    return [s for part in spec[key] for s in _flatten(part, key)] if spec["type"] == "Sequence" else [spec]


def text_order_forms(backend: Tokenizer) -> tuple[str, ...] | None:
    """The Unicode forms a text must already be in for this tokenizer's offsets to be in text order with no
    empty token, or None when its pipeline does not guarantee that (then every offset is read, ``OffsetArray``).

    Guaranteed for a BPE model behind pre-tokenizers that only cut the text into pieces (ByteLevel without
    an added prefix space, Split, Digits, Punctuation; nothing removed), no normalizer or only Unicode
    normalization (the identity on a text already in that form), and no post-processor that trims offsets:
    every token then covers at least one byte of one piece, pieces come in order, and a token of part of a
    character gets that character's offsets. Metaspace, prefix insertion, replacement normalizers and
    offset trimming fall outside. Read from the pipeline's components each call (about 10 µs, once per batch).
    """
    normalizers = _flatten(_spec(backend.normalizer), "normalizers")
    pre = _flatten(_spec(backend.pre_tokenizer), "pretokenizers")
    post = _flatten(_spec(backend.post_processor), "processors")
    if (type(backend.model).__name__ == "BPE"
            and all(n["type"] in _UNICODE_FORMS for n in normalizers)
            and all((p["type"] == "ByteLevel" and not p.get("add_prefix_space"))
                    or (p["type"] in _SPLITTING_PRE_TOKENIZERS and p.get("behavior") != "Removed") for p in pre)
            and all((p["type"] == "ByteLevel" and not p.get("trim_offsets")) or p["type"] == "TemplateProcessing"
                    for p in post)):
        return tuple(n["type"] for n in normalizers)
    return None


def count_tokens(texts: list[str], tokenizer) -> list[int]:
    """Tokens of each text (``add_special_tokens=False``), with no offsets or ids read into Python when the
    Rust backend can be called directly."""
    if not texts:
        return []
    backend = _rust_backend(tokenizer)
    if backend is None:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [len(enc) for enc in encode(texts, add_special_tokens=False)]


def encode_batch(texts: list[str], tokenizer) -> list[tuple[list[int], Offsets]]:
    """One batched fast-tokenizer call -> per text ``(input_ids, offsets)``.

    ``add_special_tokens=False``: the ids are exactly the tokenization of the
    rendered text, so no BOS is added on top of one the template wrote. The
    Rust backend is called directly when that is equivalent (it skips
    transformers' per-encoding conversion to dicts), else the tokenizer itself.
    Offsets stay in the encoding (``EncodingOffsets``) when the tokenizer keeps
    them in text order for this text, else all are read (``OffsetArray``).
    """
    if not texts:
        return []
    backend = _rust_backend(tokenizer)
    if backend is None:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        return [(ids, OffsetArray.from_pairs(offs)) for ids, offs in zip(enc["input_ids"], enc["offset_mapping"])]
    forms = text_order_forms(backend)
    out = []
    for text, enc in zip(texts, backend.encode_batch(texts, add_special_tokens=False)):
        if forms is not None and all(unicodedata.is_normalized(f, text) for f in forms):
            out.append((enc.ids, EncodingOffsets(enc)))
        else:
            out.append((enc.ids, OffsetArray.from_pairs(enc.offsets)))
    return out


def make_labels(
    input_ids: list[int],
    token_mask: TokenMask,
    *,
    max_length: int | None = None,
    truncate_side: str = "left",
) -> dict[str, list[int]]:
    """The one place labels are made: ids + their ``TokenMask`` -> input_ids, attention_mask, labels.

    When ``max_length`` is exceeded, tokens are cut on ``truncate_side``
    (``left`` keeps the last ``max_length`` tokens, ``right`` the first).
    """
    ids = input_ids if isinstance(input_ids, list) else list(input_ids)
    labels = [IGNORE_INDEX] * len(ids)
    for a, b in token_mask.runs:  # a few runs: one or two per trained turn
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
    return make_labels(ids, project_char_mask(offsets, char_mask), max_length=max_length,
                       truncate_side=truncate_side)
