"""Stage 3: tokenize the rendered text and project the char mask onto tokens -> labels.

    >>> (ids, offsets), = encode_batch(["question answer"], tok)
    >>> out = make_labels(ids, project_char_mask(offsets, np.array([0] * 8 + [1] * 7, np.uint8)))
    >>> [tok.decode(i) for i in out["input_ids"]], out["labels"] == [-100, out["input_ids"][1]]
    (['question', ' answer'], True)

Labels are made here (``make_labels``) and nowhere else; ``example.finish_examples`` is the one place the
engine composes these steps for a render. Projection rule: a token is trained
when its FIRST character is trained. A token belongs to where it starts, as in
generation, where the model emits tokens from the position where the prompt
ends. Tokens whose characters are part trained, part masked ("straddling") are
rare, because special tokens never merge with text; with the Qwen tokenizer they
are whitespace runs such as the header's "\n" merged with content that starts
with " \n" (masked: it starts in the header) or a reasoning's final "." merged
with the masked "\n" before "</think>" (trained: it starts in the reasoning).
``project_char_mask`` counts them. ``IGNORE_INDEX`` marks tokens without loss.

Offsets come in three kinds with the same rule. ``ByteOffsets`` works them out
from the ids alone, for byte-level BPE such as Qwen's and Llama 3's: each token
stands for a known number of the text's UTF-8 bytes, so a running sum places it
(the tokenizer is asked for no offsets). ``EncodingOffsets`` reads a few offsets
on demand from the tokenizer's encoding, for tokenizers whose offsets are in text
order by construction (``text_order_forms``). ``OffsetArray`` holds every token's
offsets and applies the rule to each token, for any tokenizer.
"""

from __future__ import annotations

import bisect
import json
import logging
import unicodedata
import weakref
from collections.abc import Sequence
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

from qlora_train.masking import fast_bpe
from qlora_train.masking.fast_bpe import FastBPE

log = logging.getLogger(__name__)

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


class ByteOffsets:
    """Offsets of a byte-level BPE's tokens from their ids: token ``t`` is the text's UTF-8 bytes
    ``[bounds[t], bounds[t + 1])`` (``bounds`` the running sum of ``token_byte_lengths``).

    The rule read in bytes: a token's first character is the one holding its first byte, so the tokens
    starting in trained characters ``[a, b)`` are those whose first byte is in ``[B(a), B(b))``, ``B(p)``
    being the byte where character ``p`` starts; a token straddles an edge ``b`` when it holds byte ``B(b)``
    but starts before it. Equal to ``EncodingOffsets`` on the same text (tested), with no call into the
    tokenizer: one ``searchsorted`` per kind of lookup.
    """

    __slots__ = ("bounds", "text", "ascii")

    def __init__(self, bounds: np.ndarray, text: str):
        self.bounds = bounds  # [n + 1], bounds[0] = 0, bounds[n] = the text's bytes
        self.text = text
        self.ascii = text.isascii()

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def _byte(self, pos: int) -> int:
        """Where character ``pos`` starts in the text's UTF-8 bytes (the end for ``pos >= len(text)``)."""
        return min(pos, len(self.text)) if self.ascii else len(self.text[:pos].encode())

    def _bytes(self, positions: list[int]) -> list[int]:
        """``_byte`` of ascending positions, the text encoded once in pieces."""
        if self.ascii:
            return positions
        out, at, b = [], 0, 0
        for p in positions:
            b += len(self.text[at:p].encode())
            at = p
            out.append(b)
        return out

    def _first_starting_at(self, byte: int) -> int:
        """Index of the first token whose first byte is >= ``byte`` (``n`` when none: ``bounds[n]`` is the
        text's last byte position, which no ``_byte`` exceeds)."""
        return int(self.bounds.searchsorted(byte, "left"))

    def count_starting_in(self, a: int, b: int, n_chars: int) -> int:
        """Tokens whose first character is in ``[a, b)``."""
        return self._first_starting_at(self._byte(b)) - self._first_starting_at(self._byte(a))

    def tokens_before(self, pos: int, n_chars: int) -> tuple[int, int]:
        """``(tokens wholly before pos, tokens starting before pos)``: they differ by one where a token
        straddles ``pos``."""
        byte = self._byte(pos)
        starting = self._first_starting_at(byte)
        return starting - int(starting > 0 and self.bounds[starting] > byte), starting

    def _char_of_byte(self) -> np.ndarray:
        """The character each byte of the text belongs to."""
        if self.ascii:
            return np.arange(len(self.text), dtype=np.int64)
        points = np.frombuffer(self.text.encode("utf-32-le"), dtype=np.uint32)
        widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
        return np.repeat(np.arange(len(points), dtype=np.int64), widths)

    def to_array(self) -> OffsetArray:
        """Every token's ``(start, end)`` in characters, as the tokenizer's offsets give them."""
        char = self._char_of_byte()
        starts, ends = self.bounds[:-1], self.bounds[1:]
        return OffsetArray(np.stack([char[starts], char[ends - 1] + 1], axis=1) if len(self)
                           else np.zeros((0, 2), dtype=np.int64))

    def starts(self) -> np.ndarray:
        return self._char_of_byte()[self.bounds[:-1]]

    def project(self, char_mask: np.ndarray) -> TokenMask:
        edges, n_chars = _edges(char_mask), len(char_mask)
        if not edges:
            return TokenMask([], 0)
        at = self._bytes(edges)
        first = self.bounds.searchsorted(at, "left").tolist()  # numpy's methods: its functions add a wrapper
        runs = [(i, j) for i, j in zip(first[::2], first[1::2]) if i < j]
        holding = (self.bounds.searchsorted(at, "right") - 1).tolist()  # the token holding each edge's byte
        straddling = {t for b, byte, t in zip(edges, at, holding) if 0 < b < n_chars and self.bounds[t] < byte}
        return TokenMask(runs, len(straddling))  # tokens starting before an edge they hold, each counted once


Offsets = OffsetArray | EncodingOffsets | ByteOffsets


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


_BYTE_LENGTHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (backend, size, lengths)
_NEVER = 1 << 40  # the length of an id no token has: a text holding it fails the byte count


def token_byte_lengths(tokenizer, backend: Tokenizer) -> np.ndarray | None:
    """How many bytes of the text each token id stands for, for a byte-level BPE; None for other pipelines.

    A token of the model stands for one byte per character of its ByteLevel form (every byte has a token, so
    none falls back to an unknown one); an added token for its content in UTF-8, or more where it takes in
    whitespace around it (``lstrip`` / ``rstrip``). The lengths never exceed the bytes a token covers, so a
    text whose tokens' lengths sum to its own byte count has each token where the sum puts it
    (``encode_batch`` checks that per text). Worked out once per tokenizer and vocabulary size (about 0.1 s
    for 150k tokens)."""
    def make(b: Tokenizer) -> np.ndarray | None:  # from the fast encoder's ranks, where it is in use
        return _byte_lengths(b, None if tokenizer in _SWITCHED_OFF else
                             per_vocabulary(_FAST, tokenizer, b, lambda b: _built(b, saved_model(tokenizer, b))))

    return per_vocabulary(_BYTE_LENGTHS, tokenizer, backend, make)


def per_vocabulary(memo: weakref.WeakKeyDictionary, tokenizer, backend: Tokenizer, make):
    """``make(backend)``, worked out once per tokenizer, backend and vocabulary size (kept in ``memo``)."""
    n = backend.get_vocab_size(with_added_tokens=True)
    kept = memo.get(tokenizer)
    if kept is None or kept[0] is not backend or kept[1] != n:
        kept = memo[tokenizer] = (backend, n, make(backend))
    return kept[2]


def _byte_lengths(backend: Tokenizer, fast: FastBPE | str | None = None) -> np.ndarray | None:
    """``token_byte_lengths``' array. With the tokenizer's fast encoder (``fast``, built from the same model), its
    ranks are the model's ByteLevel pieces as bytes, read from there (the same pieces, a fifth of the time);
    otherwise the vocabulary is read and each piece checked."""
    model = backend.model
    pre = _flatten(_spec(backend.pre_tokenizer), "pretokenizers")
    if (type(model).__name__ != "BPE" or model.continuing_subword_prefix or model.end_of_word_suffix
            or not any(p["type"] == "ByteLevel" for p in pre)):
        return None
    added = {i: len(t.content.encode()) for i, t in backend.get_added_tokens_decoder().items()}
    if isinstance(fast, FastBPE):  # every byte has a token (the build checked): each piece's length in bytes
        ranks = fast.encoding._mergeable_ranks
        ids = np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks))
        lengths = np.full(max(int(ids.max()), *added, -1) + 1, _NEVER, dtype=np.int64)
        lengths[ids] = np.fromiter(map(len, ranks), dtype=np.int64, count=len(ranks))
        if any(lengths[i] != _NEVER and lengths[i] != n for i, n in added.items()):
            return None  # an id standing for two lengths
    else:
        vocab = backend.get_vocab(with_added_tokens=False)
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        if not alphabet <= vocab.keys():
            return None  # a byte without a token of its own: the model would fall back to an unknown token
        lengths = np.full(max([*vocab.values(), *added, -1]) + 1, _NEVER, dtype=np.int64)
        for piece, i in vocab.items():
            if alphabet.issuperset(piece):  # the model makes it of ByteLevel characters, one per byte
                if i in added and added[i] != len(piece):
                    return None  # an id standing for two lengths
                lengths[i] = len(piece)
            # any other piece never comes out of the model (DeepSeek V3 keeps its special tokens' text among
            # them): only out of the added tokens, if at all
    for i, n in added.items():
        lengths[i] = n if n else _NEVER
    return lengths


def piece_bounds(text: str, cuts: Sequence[int]) -> list[int]:
    """Where a text's pieces begin and end: ``[0, *cuts inside the text, len(text)]``; a cut at 0 or at the end, or
    twice at one place, is no cut.

    >>> piece_bounds("Q: hi A: yo", [9, 0, 9, 11])
    [0, 9, 11]
    """
    n = len(text)
    return [0, *sorted({c for c in cuts if 0 < c < n}), n]


def cuttable(tokenizer) -> bool:
    """Whether a text cut in pieces tokenizes to ids that still spell it: the tokenizer writes nothing before a
    piece of its own (no SentencePiece dummy prefix: ``Metaspace`` prepending, a ``Prepend`` normalizer,
    ByteLevel's ``add_prefix_space``). Tokenizers without a Rust pipeline to read are not cut."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return False
    if any(n["type"] == "Prepend" for n in _flatten(_spec(backend.normalizer), "normalizers")):
        return False
    for p in _flatten(_spec(backend.pre_tokenizer), "pretokenizers"):
        if p["type"] == "ByteLevel" and p.get("add_prefix_space"):
            return False
        if p["type"] == "Metaspace" and (p.get("prepend_scheme", "never") != "never" or p.get("add_prefix_space")):
            return False
    return True


def encode_batch(texts: list[str], tokenizer, cuts: Sequence[Sequence[int]] | None = None, *,
                 encoder: str = "fast") -> list[tuple[list[int], Offsets]]:
    """One batched fast-tokenizer call -> per text ``(input_ids, offsets)``.

    ``cuts[i]``: where text ``i`` is cut before it is tokenized (character positions; ``piece_bounds``). Each
    piece is tokenized on its own and the ids concatenated, so a token never crosses a cut; the offsets are in
    the whole text. All pieces of all texts go into the one call. A rendered conversation is cut where each
    trained turn's generated part begins (``RenderedConversation.cuts``, ``encode_rendered``): at inference the
    prompt is tokenized alone and the model's first token begins the answer, so that is what is trained. A
    tokenizer that writes a prefix before every text it is given (``cuttable``) is not cut.

    ``add_special_tokens=False``: the ids are exactly the tokenization of the
    rendered text (its pieces), so no BOS is added on top of one the template
    wrote. The Rust backend is called directly when that is equivalent (it skips
    transformers' per-encoding conversion to dicts), else the tokenizer itself.
    A byte-level BPE is asked for ids only (``encode_batch_fast``: the offsets
    are a fifth of a short text's tokenizing time) and its offsets worked out from
    them (``ByteOffsets``) when each piece's ids' byte lengths add up to the
    piece's bytes; a text where they do not is encoded again with offsets. Otherwise
    offsets stay in the encoding (``EncodingOffsets``) when the text is one piece
    and the tokenizer keeps them in text order for it, else all are read
    (``OffsetArray``).
    """
    if not texts:
        return []
    if cuts is None or not cuttable(tokenizer):
        bounds = [[0, len(text)] for text in texts]
    else:
        bounds = [piece_bounds(text, c) for text, c in zip(texts, cuts, strict=True)]
    pieces = [text if len(b) == 2 else text[i:j] for text, b in zip(texts, bounds)
              for i, j in zip(b[:-1], b[1:])]
    backend = _rust_backend(tokenizer)
    if backend is None:
        enc = tokenizer(pieces, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
        encoded = list(zip(enc["input_ids"], enc["offset_mapping"]))
        return [_joined(b, encoded[k:k + len(b) - 1]) for b, k in zip(bounds, _firsts(bounds))]
    forms = text_order_forms(backend)
    lengths = token_byte_lengths(tokenizer, backend) if forms is not None else None
    if lengths is None or not hasattr(backend, "encode_batch_fast"):
        encs = backend.encode_batch(pieces, add_special_tokens=False)
        return [_with_offsets(text, encs[k], forms) if len(b) == 2 else
                _joined(b, [(e.ids, e.offsets) for e in encs[k:k + len(b) - 1]])
                for text, b, k in zip(texts, bounds, _firsts(bounds))]
    fast = fast_encoder(tokenizer, backend) if encoder == "fast" else None
    if fast is not None:
        piece_ids = [_fast_ids(fast, piece) for piece in pieces]
    else:
        piece_ids = [e.ids for e in backend.encode_batch_fast(pieces, add_special_tokens=False)]
    out = []
    for text, b, k in zip(texts, bounds, _firsts(bounds)):
        n = len(b) - 1
        offsets = _byte_offsets(text, b, piece_ids[k:k + n], lengths, forms)
        if offsets is not None:
            out.append(offsets)
        elif n == 1:
            out.append(_with_offsets(text, backend.encode(text, add_special_tokens=False), forms))
        else:
            again = backend.encode_batch(pieces[k:k + n], add_special_tokens=False)
            out.append(_joined(b, [(e.ids, e.offsets) for e in again]))
    return out


def _fast_ids(fast: FastBPE, piece: str) -> np.ndarray | None:
    """A piece's ids by the fast encoder (an array); None where it cannot take the text (a character not probed
    alike, a lone surrogate)."""
    if not fast.takes(piece):
        return None
    try:
        return fast.encode_array(piece)
    except UnicodeError:
        return None


_FAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (backend, size, FastBPE | reason)
_SWITCHED_OFF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> differences found


def fast_encoder(tokenizer, backend: Tokenizer) -> FastBPE | None:
    """The tokenizer's tiktoken twin (``fast_bpe.build``), built once per tokenizer and vocabulary size; None where
    its pipeline is not representable (said once in the log) or ``verify_encoder`` found it differ in this run."""
    if tokenizer in _SWITCHED_OFF:
        return None
    built = per_vocabulary(_FAST, tokenizer, backend, lambda b: _built(b, saved_model(tokenizer, b)))
    return built if isinstance(built, FastBPE) else None


_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (backend, size, files | None)


def saved_model(tokenizer, backend: Tokenizer) -> tuple[bytes, bytes] | None:
    """A BPE model's files as ``tokenizers`` saves them (``fast_bpe.model_files``: vocabulary, merges), saved once
    per tokenizer, backend and vocabulary size, as the fast encoder built from them is kept
    (``per_vocabulary``): read by the build and by the tokenizer's identity (``data.identity``) alike. None for
    another model."""
    return per_vocabulary(_SAVED, tokenizer, backend,
                          lambda b: fast_bpe.model_files(b) if type(b.model).__name__ == "BPE" else None)


def _built(backend: Tokenizer, files: tuple[bytes, bytes] | None = None) -> FastBPE | str:
    built = fast_bpe.build(backend, files)
    if isinstance(built, str):
        log.info("tokenizing with tokenizers, not the fast byte-level encoder: %s", built)
    return built


def switch_off_fast_encoder(tokenizer, why: str) -> None:
    """The tokenizer back on ``tokenizers`` for the rest of the run (this process), counted, said once."""
    n = _SWITCHED_OFF.get(tokenizer, 0)
    _SWITCHED_OFF[tokenizer] = n + 1
    if not n:
        log.warning("the fast byte-level encoder differs from tokenizers on a checked row (%s): tokenizing with "
                    "tokenizers for the rest of the run", why)


def keep_tokenizers(tokenizer) -> None:
    """Encode with ``tokenizers`` only, never the fast encoder, for this tokenizer (benchmarks' reference)."""
    _SWITCHED_OFF.setdefault(tokenizer, 0)


def verify_encoder(renders: Sequence[Any], tokenizer) -> str | None:
    """``encode_rendered`` of ``renders`` by the fast encoder against ``tokenizers`` (what ``data.rule_check`` runs
    on its sample): None where they give the same ids and offsets, or the fast encoder is not in use; else what
    differs, and the tokenizer is switched back to ``tokenizers`` (``switch_off_fast_encoder``)."""
    backend = _rust_backend(tokenizer)
    if backend is None or fast_encoder(tokenizer, backend) is None:
        return None
    fast, slow = encode_rendered(renders, tokenizer), encode_rendered(renders, tokenizer, encoder="tokenizers")
    for k, ((ids, offs), (want_ids, want_offs)) in enumerate(zip(fast, slow)):
        if list(ids) != list(want_ids):
            why = f"render {k}: ids differ from token {_first_difference(ids, want_ids)}"
        elif not np.array_equal(_offset_pairs(offs), _offset_pairs(want_offs)):
            why = f"render {k}: offsets differ"
        else:
            continue
        switch_off_fast_encoder(tokenizer, why)
        return why
    return None


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _firsts(bounds: list[list[int]]) -> list[int]:
    """The index of each text's first piece among all texts' pieces."""
    firsts, k = [], 0
    for b in bounds:
        firsts.append(k)
        k += len(b) - 1
    return firsts


def _byte_offsets(text: str, bounds: list[int], encs: list[Sequence[int] | None], lengths: np.ndarray,
                  forms: tuple[str, ...]) -> tuple[list[int], ByteOffsets] | None:
    """A text's pieces' ids (lists, or the fast encoder's arrays) -> its ids and ``ByteOffsets``, or None where a
    piece has none (the encoder could not take it), is not in the Unicode forms the offsets need, or its ids' byte
    lengths do not add up to its bytes."""
    if any(e is None for e in encs):
        return None
    if forms and not all(unicodedata.is_normalized(f, text if len(encs) == 1 else text[i:j])
                         for f in forms for i, j in zip(bounds[:-1], bounds[1:])):
        return None
    ids = np.asarray(encs[0], dtype=np.int64) if len(encs) == 1 else np.concatenate(encs, dtype=np.int64)
    token_bounds = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lengths[ids], out=token_bounds[1:])
    if text.isascii():
        piece_bytes = bounds[1:]
    else:  # each piece's last byte, the text encoded once in pieces
        piece_bytes, at = [], 0
        for i, j in zip(bounds[:-1], bounds[1:]):
            at += len(text[i:j].encode())
            piece_bytes.append(at)
    ends, at = [], 0
    for e in encs:
        at += len(e)
        ends.append(at)
    if token_bounds[ends].tolist() != piece_bytes:
        return None
    return ids.tolist(), ByteOffsets(token_bounds, text)


def _joined(bounds: list[int], encoded: list[tuple[list[int], Sequence[tuple[int, int]]]]
            ) -> tuple[list[int], OffsetArray]:
    """A text's pieces' ``(ids, offsets in the piece)`` -> the text's ids and ``OffsetArray`` (offsets shifted by
    where each piece starts)."""
    if len(encoded) == 1:
        ids, offs = encoded[0]
        return list(ids), OffsetArray.from_pairs(offs)
    arrays = [OffsetArray.from_pairs(offs).array + start for start, (_, offs) in zip(bounds, encoded)]
    return ([i for ids, _ in encoded for i in ids],
            OffsetArray(np.concatenate(arrays) if arrays else np.zeros((0, 2), dtype=np.int64)))


def encode_rendered(renders: Sequence[Any], tokenizer, *, encoder: str = "fast") -> list[tuple[list[int], Offsets]]:
    """Renders -> per render ``(input_ids, offsets)``: the one step that tokenizes what the engine rendered, for
    the fast path, the rule (``check``), pairs and truncation alike, in one ``encode_batch`` call. A render is a
    ``RenderedConversation``, its text cut where each trained turn's generated part begins (its ``cuts``), or a
    template-free text (a ``str``, not cut). A render's images' tokens (``RenderedConversation.images``) are
    tokenized as one token a run and repeated after (``_image_runs_collapsed``, ``_image_runs_expanded``)."""
    texts, cuts = [], []
    for r in renders:
        if isinstance(r, str):
            texts.append(r)
            cuts.append(())
        elif r.images is None:
            texts.append(r.text)
            cuts.append(r.cuts)
        else:
            text, c = _image_runs_collapsed(r.text, r.cuts, r.images)
            texts.append(text)
            cuts.append(c)
    encoded = encode_batch(texts, tokenizer, cuts=cuts, encoder=encoder)
    return [enc if isinstance(r, str) or r.images is None else _image_runs_expanded(*enc, r.images)
            for r, enc in zip(renders, encoded)]


def _image_runs_collapsed(text: str, cuts: Sequence[int], images) -> tuple[str, tuple[int, ...]]:
    """A render with its image runs (``rendered.ImageRuns``) each written once, and its cuts moved with it (a
    cut is never inside a run: runs are in untrained text, cuts where trained turns begin)."""
    width = len(images.token)
    pieces, at = [], 0
    ends, grown = [], [0]
    for s, n in images.runs:
        pieces.append(text[at:s + width])
        at = s + n * width
        ends.append(at)
        grown.append(grown[-1] + (n - 1) * width)
    pieces.append(text[at:])
    return "".join(pieces), tuple(c - grown[bisect.bisect_right(ends, c)] for c in cuts)


def _offset_pairs(offsets: Offsets) -> np.ndarray:
    if isinstance(offsets, OffsetArray):
        return offsets.array
    if isinstance(offsets, ByteOffsets):
        return offsets.to_array().array
    return np.asarray(offsets.encoding.offsets, dtype=np.int64).reshape(-1, 2)


def _image_runs_expanded(ids: list[int], offsets: Offsets, images) -> tuple[list[int], OffsetArray]:
    """The collapsed render's ids and offsets -> the whole render's: each image token repeated to its run's
    length, the copies' offsets one token text apart, every later offset moved by the runs before it."""
    width = len(images.token)
    ids_np = np.asarray(ids, dtype=np.int64)
    at = np.flatnonzero(ids_np == images.token_id)
    if len(at) != len(images.runs):  # the image token is an added token, matched whole: never seen otherwise
        raise ValueError(f"{len(at)} image tokens for {len(images.runs)} image runs")
    pairs = _offset_pairs(offsets)
    counts = np.array([n for _, n in images.runs], dtype=np.int64)
    grown = np.concatenate([[0], np.cumsum((counts - 1) * width)])
    run_ends = pairs[at, 1]  # each run's one token, in the collapsed text
    moved = pairs + grown[np.searchsorted(run_ends, pairs, "right")]
    repeat = np.ones(len(ids_np), dtype=np.int64)
    repeat[at] = counts
    out = np.repeat(moved, repeat, axis=0)
    first = at + grown[:-1] // width  # where each run's copies begin in the expanded ids
    for (start, n), k in zip(images.runs, first.tolist()):
        out[k:k + n, 0] = start + width * np.arange(n)
        out[k:k + n, 1] = out[k:k + n, 0] + width
    return np.repeat(ids_np, repeat).tolist(), OffsetArray(out)


def _with_offsets(text: str, enc, forms: tuple[str, ...] | None) -> tuple[list[int], Offsets]:
    """A text's encoding with offsets -> its ids and the offsets read from it."""
    if forms is not None and all(unicodedata.is_normalized(f, text) for f in forms):
        return enc.ids, EncodingOffsets(enc)
    return enc.ids, OffsetArray.from_pairs(enc.offsets)


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
