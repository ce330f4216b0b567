"""A byte-level BPE's encoder through tiktoken: the ids ``tokenizers`` gives, in about a quarter of its CPU.

    >>> fast = build(tok._tokenizer)  # a FastBPE, or the reason the pipeline is not representable (a str)
    >>> text = "<think>\\nhi</think> 東京 2026"
    >>> fast.takes(text), fast.encode(text) == tok._tokenizer.encode(text, add_special_tokens=False).ids
    (True, True)

Built once per tokenizer from its own pipeline (``tokenizer.json``): the model's merges give the ranks (a token's
rank is its id, which must grow with the merges' order: tiktoken merges the pair whose joined bytes rank lowest,
``tokenizers`` the pair listed first), the pre-tokenizer's one ``Split`` expression is tiktoken's pattern, and the
added tokens are its special tokens (split out of the text before BPE, as ``tokenizers`` does). Only a pipeline
tiktoken runs exactly is built: a BPE without dropout, unknown token, subword prefix or suffix, byte fallback; one
``Split`` (``Isolated``, not inverted) then ``ByteLevel`` without its own expression or an added prefix space; no
normalizer but NFC (the caller encodes only texts already in NFC, where it is the identity); added tokens without
``single_word``, ``lstrip`` or ``rstrip``, none the start of another (tiktoken takes the first of its
alternatives, ``tokenizers`` the longest). Anything else -> the reason, and the tokenizer keeps ``tokenizers``.

What the build cannot check (the two regex engines' Unicode tables, merges listed for every pair tiktoken would
join) is checked on the user's rows: ``data.rule_check`` encodes its sample both ways (``tokenize.verify_encoder``),
and a difference switches the tokenizer back to ``tokenizers`` for the run.
"""

from __future__ import annotations

import json
import re
import tempfile
import unicodedata
from pathlib import Path

import numpy as np
import tiktoken
from tokenizers import Tokenizer, pre_tokenizers


class FastBPE:
    """A tokenizer's tiktoken twin; ``encode(text)`` -> the ids ``tokenizers`` gives without special tokens added,
    for a text it ``takes``."""

    def __init__(self, encoding: tiktoken.Encoding, special: frozenset[str], backend: Tokenizer):
        self.encoding = encoding
        self.special = special  # the added tokens' texts, all split out of the text
        self.backend = backend
        self.nfc = backend.normalizer is not None  # NFC (``build``): only texts already in NFC are encoded
        self.agreed: set[str] = set()  # characters probed: both encoders cut and merge them alike
        self.differs: set[str] = set()  # ... and those where they do not
        self._untrusted = re.compile(r"[^\x00-\x7f]")  # a character not in ``agreed`` (ASCII probed when built)

    def encode(self, text: str) -> list[int]:
        return self.encoding._core_bpe.encode(text, self.special)  # Encoding.encode's checks, skipped: all allowed

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as an array (uint32), written by tiktoken into one buffer: no Python int a token."""
        core = self.encoding._core_bpe
        if hasattr(core, "encode_to_tiktoken_buffer"):
            return np.frombuffer(core.encode_to_tiktoken_buffer(text, self.special), dtype=np.uint32)
        return np.asarray(self.encode(text), dtype=np.uint32)  # pragma: no cover - another tiktoken

    def takes(self, text: str) -> bool:
        """Whether every character of ``text`` was probed (``probe``) and both encoders agreed on it: the two regex
        engines' Unicode tables are of different versions (a letter to one may be a symbol to the other), so a
        character is trusted only once its probe text came out the same. One regex search per text once its
        characters are known."""
        if text.isascii() or self._untrusted.search(text) is None:
            return True
        agree = [self.probe(c) for c in set(self._untrusted.findall(text))]
        self._untrusted = re.compile("[^\\x00-\\x7f" + "".join(map(re.escape, sorted(self.agreed))) + "]")
        return all(agree)

    def probe(self, c: str) -> bool:
        """``c`` next to letters, marks, digits, spaces, newlines, punctuation and symbols of several scripts
        (``count._probe``'s contexts), encoded by both: the same ids -> agreed."""
        if c in self.agreed:
            return True
        if c in self.differs:
            return False
        text = _probe(c, self.nfc)
        try:
            same = self.encode(text) == self.backend.encode(text, add_special_tokens=False).ids
        except Exception:  # noqa: BLE001 - a character neither takes as UTF-8 (a lone surrogate)
            same = False
        (self.agreed if same else self.differs).add(c)
        return same


# What a character is probed next to (as count.py probes its piece counter): letters (Latin, CJK, kana, Hangul,
# Cyrillic, Arabic), a combining mark, digits, spaces, newlines, the contractions' apostrophe, punctuation, symbols
_CONTEXTS = ("a", "Z", "é", "中", "あ", "ア", "가", "ж", "ع", "\u0301", "1", "1234", "١", " ", "   ", "\t", "\u3000",
             "\xa0", "\n", "\r\n", "\n\n", " \n", "'", "'s", "'LL", ".", ",", "-", "_", "(", "!", "+", "$", "^", "€",
             "🙂")


def _probe(c: str, nfc: bool) -> str:
    """``c`` in every context; for a tokenizer that normalizes to NFC, in those where the text stays in NFC (the
    fast encoder sees no other text: ``tokenize._byte_offsets``)."""
    parts = [f"{r}{c}{r}{c}{c}" for r in _CONTEXTS]
    if nfc:
        parts = [p for p in parts if unicodedata.is_normalized("NFC", p + c)]
    return "".join(parts) + c


def _bytes_of() -> dict[str, int]:
    """ByteLevel's character for each byte -> the byte (GPT-2's map: printable bytes stand for themselves)."""
    return {c: b for b, c in enumerate(_byte_level_chars())}


def _byte_level_chars() -> list[str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _to_bytes() -> dict[int, str]:
    """``str.translate``'s table from ByteLevel's characters to the bytes they stand for (as Latin-1 characters,
    so that ``.encode("latin-1")`` gives the bytes); any other character below U+0200 to one Latin-1 cannot
    encode, as every character above it already is: a piece of other characters fails to encode."""
    table = dict.fromkeys(range(0x200), "\uffff")
    table.update({ord(c): chr(b) for c, b in _bytes_of().items()})
    return table


def pipeline_spec(backend: Tokenizer) -> dict:
    """The parts of a pipeline's ``tokenizer.json`` that say what it does to a text, less the model's vocabulary
    and merges (``model_files``): the model's type and settings, the normalizer and the pre-tokenizer; each read
    from its own small serialization (the whole pipeline's JSON is megabytes, most of it the merges)."""
    model = backend.model
    settings = {key: getattr(model, key, None) for key in ("dropout", "unk_token", "continuing_subword_prefix",
                                                          "end_of_word_suffix", "byte_fallback")}
    parts = {name: getattr(backend, name) for name in ("normalizer", "pre_tokenizer")}
    return {"model": {"type": type(model).__name__, **settings},
            **{name: None if part is None else json.loads(part.__getstate__()) for name, part in parts.items()}}


def model_files(backend: Tokenizer) -> tuple[bytes, bytes]:
    """A BPE model's vocabulary and merges as ``tokenizers`` saves them (``vocab.json``; ``merges.txt``, a pair a
    line in rank order): written and read back in about a quarter of the CPU of parsing the pipeline's JSON."""
    with tempfile.TemporaryDirectory(prefix="qlora-bpe-") as folder:
        vocab, merges = backend.model.save(folder)
        return Path(vocab).read_bytes(), Path(merges).read_bytes()


def build(backend: Tokenizer, files: tuple[bytes, bytes] | None = None) -> FastBPE | str:
    """A ``tokenizers`` pipeline -> its ``FastBPE``, or why tiktoken cannot run it exactly (a sentence). ``files``:
    its model's ``model_files`` when already saved (else saved here)."""
    spec = pipeline_spec(backend)
    reason = _unrepresentable(spec)
    if reason:
        return reason
    if set(pre_tokenizers.ByteLevel.alphabet()) != set(_bytes_of()):  # our map is ByteLevel's
        return "its ByteLevel alphabet is not GPT-2's"
    vocab, merges = files or model_files(backend)
    vocab = json.loads(vocab)
    to_bytes = _to_bytes()
    ranks: dict[bytes, int] = {}
    for piece, i in vocab.items():
        try:
            ranks[piece.translate(to_bytes).encode("latin-1")] = i
        except UnicodeEncodeError:
            pass
        # other pieces never come out of the model (DeepSeek V3 keeps its special tokens' text among them)
    if len(ranks) < len(vocab) - 1024 or any(bytes([b]) not in ranks for b in range(256)):
        return "its vocabulary is not byte-level (a byte without a token, or many pieces of other characters)"
    if len(set(ranks.values())) != len(ranks):
        return "two pieces share an id"
    text = merges.decode()
    if text.startswith("#version"):
        text = text[text.find("\n") + 1:]
    lines = text.count("\n") + (not text.endswith("\n")) if text else 0
    words = text.replace("\n", " ").split(" ")[:2 * lines]
    if text.count(" ") != lines:  # merges.txt writes a pair as "a b": a piece holding a space is ambiguous
        return "a merge's piece holds a space"
    try:
        made = list(map(vocab.__getitem__, map(str.__add__, words[0::2], words[1::2])))
    except KeyError:
        return "a merge makes a piece its vocabulary lacks"
    if made != sorted(made):
        return "its merges' order is not its ids' order (tiktoken ranks a token by its id)"
    if len(set(made)) + 256 != len(ranks):
        return "a byte-level token no merge makes (tiktoken would join pairs into it, tokenizers never)"
    added = backend.get_added_tokens_decoder()
    special: dict[str, int] = {}
    for i, tok in added.items():
        if tok.single_word or tok.lstrip or tok.rstrip or not tok.content:
            return f"the added token {tok.content!r} has single_word, lstrip or rstrip set (or is empty)"
        if tok.normalized and spec.get("normalizer") and not unicodedata.is_normalized("NFC", tok.content):
            return f"the added token {tok.content!r} is matched normalized and is not in NFC"
        special[tok.content] = i
    contents = sorted(special)
    if any(b.startswith(a) for a, b in zip(contents, contents[1:])):
        return "an added token starts another (tiktoken takes the first alternative, tokenizers the longest)"
    try:
        encoding = tiktoken.Encoding(f"qlora-train:{id(backend)}", pat_str=spec["pre_tokenizer_pattern"],
                                     mergeable_ranks=ranks, special_tokens=special)
        encoding.encode_ordinary("probe 123 ünïcode")  # the pattern compiles in tiktoken's engine
    except Exception as exc:  # noqa: BLE001 - tiktoken raises what its regex engine raises
        return f"tiktoken cannot take it: {type(exc).__name__}: {exc}"
    fast = FastBPE(encoding, frozenset(special), backend)
    differ = [c for c in map(chr, range(128)) if not fast.probe(c)]
    if differ:
        return f"it cuts or merges the ASCII characters {''.join(differ)!r} unlike tokenizers"
    return fast


def _unrepresentable(spec: dict) -> str | None:
    """Why the pipeline in ``spec`` (a ``tokenizer.json``) is not one tiktoken runs exactly, else None; its one
    Split expression left in ``spec["pre_tokenizer_pattern"]``."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"its model is {model.get('type')}, not BPE"
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"its BPE has {key}"
    if model.get("byte_fallback"):
        return "its BPE has byte_fallback"
    normalizers = _flat(spec.get("normalizer"), "normalizers")
    if any(n["type"] != "NFC" for n in normalizers):
        return f"its normalizer is {', '.join(n['type'] for n in normalizers)} (only NFC is represented)"
    pre = _flat(spec.get("pre_tokenizer"), "pretokenizers")
    if [p["type"] for p in pre] != ["Split", "ByteLevel"]:
        return f"its pre-tokenizer is {' + '.join(p['type'] for p in pre) or 'none'}, not one Split then ByteLevel"
    split, level = pre
    if split.get("behavior") != "Isolated" or split.get("invert") or "Regex" not in split.get("pattern", {}):
        return "its Split is not an isolated, non-inverted regular expression"
    if level.get("add_prefix_space") or level.get("use_regex", True):
        return "its ByteLevel adds a prefix space or splits with an expression of its own"
    spec["pre_tokenizer_pattern"] = split["pattern"]["Regex"]
    return None


def _flat(spec: dict | None, key: str) -> list[dict]:
    if spec is None:
        return []
    return [s for part in spec[key] for s in _flat(part, key)] if spec["type"] == "Sequence" else [spec]
