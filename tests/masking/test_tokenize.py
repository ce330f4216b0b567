from __future__ import annotations

import copy
import unicodedata

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from qlora_train.masking.tokenize import (
    IGNORE_INDEX,
    ByteOffsets,
    EncodingOffsets,
    OffsetArray,
    _rust_backend,
    cuttable,
    encode_batch,
    make_labels,
    piece_bounds,
    project_char_mask,
    text_order_forms,
    token_byte_lengths,
)

TEXTS = [
    "<|im_start|>user\nnaïve café 東京 🙂<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>\n",
    "def add(a, b):\n    return a + b\n",
    "",
    "   \n\n  trailing spaces   ",
]


def hf_call(texts, tok):
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    return [(ids, [tuple(o) for o in offs]) for ids, offs in zip(enc["input_ids"], enc["offset_mapping"])]


def pairs(offsets) -> list[tuple[int, int]]:
    if isinstance(offsets, ByteOffsets):
        offsets = offsets.to_array()
    if isinstance(offsets, OffsetArray):
        return [tuple(p) for p in offsets.array.tolist()]
    return list(offsets.encoding.offsets)


def as_lists(encoded):
    return [(list(ids), pairs(offs)) for ids, offs in encoded]


def test_rust_backend_path_equals_the_tokenizer_call(qwen3_tok):
    assert _rust_backend(qwen3_tok) is not None  # the fast path is the one taken
    got = encode_batch(TEXTS, qwen3_tok)
    assert all(isinstance(offs, ByteOffsets) and len(offs) == len(ids) for ids, offs in got)
    assert as_lists(got) == hf_call(TEXTS, qwen3_tok)


def test_configured_truncation_falls_back_to_the_tokenizer_call(qwen3_tok):
    tok = copy.deepcopy(qwen3_tok)
    tok._tokenizer.enable_truncation(max_length=4)  # a tokenizer.json may ship with truncation on
    assert _rust_backend(tok) is None
    got = encode_batch(TEXTS, tok)
    assert all(isinstance(offs, OffsetArray) for _, offs in got)
    assert as_lists(got) == hf_call(TEXTS, qwen3_tok)  # transformers turns it off per call


def test_make_labels_by_hand():
    # text "abcdef", tokens "ab" "cd" "ef"; chars c..f trained -> tokens 1 and 2 trained
    offsets = OffsetArray.from_pairs([(0, 2), (2, 4), (4, 6)])
    tm = project_char_mask(offsets, np.array([0, 0, 1, 1, 1, 1], dtype=np.uint8))
    assert tm.runs == [(1, 3)]
    assert make_labels([7, 8, 9], tm) == {
        "input_ids": [7, 8, 9], "attention_mask": [1, 1, 1], "labels": [IGNORE_INDEX, 8, 9]}
    assert make_labels([7, 8, 9], tm, max_length=2)["labels"] == [8, 9]
    assert make_labels([7, 8, 9], tm, max_length=2, truncate_side="right")["labels"] == [IGNORE_INDEX, 8]


def test_projection_by_hand():
    # "ab" "cde" "f"+"f" (two tokens share a split emoji's character): in text order
    offsets = OffsetArray.from_pairs([(0, 2), (2, 5), (5, 6), (5, 6)])
    tm = project_char_mask(offsets, np.array([0, 0, 0, 1, 1, 1], dtype=np.uint8))
    assert tm == ([(2, 4)], 1)  # "cde" starts masked: not trained, straddles
    tm = project_char_mask(offsets, np.array([0, 1, 1, 1, 1, 0], dtype=np.uint8))
    assert tm == ([(1, 2)], 1)  # "ab" starts masked and straddles; "cde" trained
    assert project_char_mask(offsets, np.zeros(6, dtype=np.uint8)) == ([], 0)
    # an empty token is never trained, even inside a trained run (the per-token pass)
    empty = OffsetArray.from_pairs([(0, 2), (2, 2), (2, 4)])
    assert project_char_mask(empty, np.ones(4, dtype=np.uint8)) == ([(0, 1), (2, 3)], 0)


def brute_projection(offsets, mask):
    """The rule, per token and per character: trained when its first character is; straddling when its
    characters are partly trained."""
    trained = [e > s and bool(mask[s]) for s, e in offsets]
    straddling = sum(0 < sum(mask[s:e]) < e - s for s, e in offsets)
    return trained, straddling


def as_flags(runs, n):
    flags = [False] * n
    for a, b in runs:
        assert a < b
        flags[a:b] = [True] * (b - a)
    return flags


@st.composite
def offsets_and_mask(draw):
    """Offsets as tokenizers give them (cuts of the text, split characters repeated, sometimes empty
    tokens) and, in a third of the cases, shuffled out of text order."""
    mask = draw(st.lists(st.integers(0, 1), min_size=1, max_size=40))
    n = len(mask)
    bounds = [0, *sorted(draw(st.lists(st.integers(0, n), max_size=20))), n]
    offsets = []
    for a, b in zip(bounds, bounds[1:]):
        offsets += [(a, b)] * draw(st.integers(1, 2))
    if draw(st.integers(0, 2)) == 0:
        offsets = draw(st.permutations(offsets))
    return offsets, np.array(mask, dtype=np.uint8)


@settings(max_examples=400, deadline=None)
@given(offsets_and_mask())
def test_projection_equals_the_per_token_definition(case):
    offsets, mask = case
    trained, straddling = brute_projection(offsets, mask)
    tm = project_char_mask(OffsetArray.from_pairs(offsets), mask)
    assert as_flags(tm.runs, len(offsets)) == trained
    assert tm.straddling == straddling


def pieces_call(text, cuts, tok):
    """The tokenizer call on each piece of ``text`` cut at ``cuts`` alone: ids joined, offsets shifted into the
    text."""
    bounds = piece_bounds(text, cuts)
    ids, offsets = [], []
    for a, b in zip(bounds, bounds[1:]):
        (piece_ids, piece_offsets), = hf_call([text[a:b]], tok)
        ids += piece_ids
        offsets += [(s + a, e + a) for s, e in piece_offsets]
    return ids, offsets


def check_projection(tok, text, mask, kind, cuts=None):
    """encode_batch picks ``kind`` of offsets for ``text`` (cut at ``cuts``; any kind for None); all kinds give
    the per-token definition."""
    ((ids, offsets),) = encode_batch([text], tok, None if cuts is None else [cuts])
    assert kind is None or isinstance(offsets, kind)
    got = pairs(offsets)
    expected = hf_call([text], tok)[0] if cuts is None else pieces_call(text, cuts, tok)
    assert (list(ids), got) == expected  # ByteOffsets: worked out, equal to the tokenizer's
    if kind not in (OffsetArray, None):  # what the kind relies on: offsets in text order, no empty token
        starts, ends = [a for a, _ in got], [b for _, b in got]
        assert starts == sorted(starts) and ends == sorted(ends) and all(a < b for a, b in got)
    trained, straddling = brute_projection(got, mask)
    every = OffsetArray.from_pairs(got)
    for offs in (offsets, every):
        tm = project_char_mask(offs, mask)
        assert as_flags(tm.runs, len(ids)) == trained and tm.straddling == straddling
    for pos in range(len(text) + 2):  # the lookups truncation and the tool block count make
        assert offsets.tokens_before(pos, len(text)) == every.tokens_before(pos, len(text))
        assert offsets.count_starting_in(0, pos, len(text)) == every.count_starting_in(0, pos, len(text))
    assert offsets.starts().tolist() == every.starts().tolist()


def random_mask(data, n: int) -> np.ndarray:
    runs = data.draw(st.lists(st.tuples(st.integers(0, 1), st.integers(1, 8)), max_size=12))
    mask = [v for v, k in runs for _ in range(k)][:n]
    return np.array(mask + [0] * (n - len(mask)), dtype=np.uint8)


TEXT = st.text(st.characters(codec="utf-8"), max_size=80) | st.sampled_from(TEXTS)


@settings(max_examples=150, deadline=None)
@given(TEXT, st.data())
def test_projection_with_the_real_tokenizer(qwen3_tok, text, data):
    check_projection(qwen3_tok, text, random_mask(data, len(text)), ByteOffsets)


@pytest.fixture(scope="module")
def nfc_qwen(qwen3_tok):
    """The Qwen tokenizer with the NFC normalizer Qwen's own tokenizer.json carries."""
    tok = copy.deepcopy(qwen3_tok)
    tok._tokenizer.normalizer = normalizers.NFC()
    return tok


@settings(max_examples=100, deadline=None)
@given(st.text(st.sampled_from("ae\u0301\u0323\u0302\u00e9 \n\u1e09c\u0327\u0301\U0001f642"), max_size=30), st.data())
def test_unicode_normalization_keeps_the_encoding_offsets_only_for_normalized_text(nfc_qwen, text, data):
    # combining marks: NFC composes and reorders them, so only a text already in NFC keeps its offsets in order
    kind = ByteOffsets if unicodedata.is_normalized("NFC", text) else OffsetArray
    check_projection(nfc_qwen, text, random_mask(data, len(text)), kind)


@pytest.fixture(scope="module")
def sentencepiece_style():
    """A Llama-2-style tokenizer trained here: "▁" prepended and replacing spaces, byte fallback."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    corpus = ["the model reads each token and predicts the next one", "naïve café 東京", "hello world\n" * 3]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=[f"<0x{b:02X}>" for b in range(256)]))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@settings(max_examples=100, deadline=None)
@given(TEXT, st.data())
def test_projection_with_a_sentencepiece_style_tokenizer(sentencepiece_style, text, data):
    check_projection(sentencepiece_style, text, random_mask(data, len(text)), OffsetArray)


@pytest.fixture(scope="module")
def dropping():
    """A BPE without byte level or unk token: characters outside its vocabulary get no token."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    tok.train_from_iterator(["ab ba abab"] * 10, trainers.BpeTrainer(vocab_size=20))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@settings(max_examples=60, deadline=None)
@given(st.text(st.sampled_from("abz "), max_size=20), st.data())
def test_a_character_no_token_contains_falls_back_to_every_offset(dropping, text, data):
    assert text_order_forms(dropping._tokenizer) == ()
    check_projection(dropping, text, random_mask(data, len(text)), EncodingOffsets)


def test_which_pipelines_keep_offsets_in_text_order(qwen3_tok, nfc_qwen, sentencepiece_style):
    assert text_order_forms(qwen3_tok._tokenizer) == ()
    assert text_order_forms(nfc_qwen._tokenizer) == ("NFC",)
    assert text_order_forms(sentencepiece_style._tokenizer) is None  # inserts and replaces characters
    tok = copy.deepcopy(qwen3_tok)
    tok._tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)  # GPT-2's: trims spaces off offsets
    assert text_order_forms(tok._tokenizer) is None
    tok._tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tok._tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                            pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert text_order_forms(tok._tokenizer) is None  # drops whitespace


@pytest.fixture(scope="module")
def lstrip_qwen(qwen3_tok):
    """The Qwen tokenizer with an added token that takes in the whitespace before it (``lstrip``)."""
    tok = copy.deepcopy(qwen3_tok)
    tok.add_tokens([AddedToken("<tool>", lstrip=True, normalized=False)])
    return tok


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<tool>", " ", "\n", "a", "é"]), max_size=12).map("".join), st.data())
def test_an_added_token_taking_in_whitespace_is_encoded_again_with_offsets(lstrip_qwen, text, data):
    # whitespace before "<tool>" gets no token of its own: the ids' byte lengths fall short of the text's
    taken_in = any(text[i - 1].isspace() for i in range(1, len(text)) if text.startswith("<tool>", i))
    check_projection(lstrip_qwen, text, random_mask(data, len(text)), EncodingOffsets if taken_in else ByteOffsets)


def test_byte_lengths_by_hand(qwen3_tok, sentencepiece_style, dropping):
    lengths = token_byte_lengths(qwen3_tok, qwen3_tok._tokenizer)
    ids = qwen3_tok("<|im_start|>user\n東京", add_special_tokens=False)["input_ids"]
    assert [qwen3_tok.decode([i]) for i in ids] == ["<|im_start|>", "user", "\n", "東", "京"]
    assert lengths[ids].tolist() == [12, 4, 1, 3, 3]  # 東 and 京: three UTF-8 bytes each
    assert token_byte_lengths(qwen3_tok, qwen3_tok._tokenizer) is lengths  # worked out once
    grown = copy.deepcopy(qwen3_tok)
    before = token_byte_lengths(grown, grown._tokenizer)
    grown.add_tokens(["<new_marker>"])  # model.new_tokens: the vocabulary grows, the lengths are worked out again
    new_id = grown.convert_tokens_to_ids("<new_marker>")
    assert len(before) == new_id and token_byte_lengths(grown, grown._tokenizer)[new_id] == len("<new_marker>")
    (ids, offsets), = encode_batch(["a<new_marker>b"], grown)
    assert ids[1] == new_id and isinstance(offsets, ByteOffsets) and pairs(offsets)[1] == (1, 13)
    assert token_byte_lengths(sentencepiece_style, sentencepiece_style._tokenizer) is None  # "▁" pieces
    assert token_byte_lengths(dropping, dropping._tokenizer) is None  # no byte level: pieces are characters


@pytest.fixture(scope="module")
def byte_level_families(real_vocab_dir):
    """The real Llama 3 and DeepSeek V3 tokenizers (DeepSeek V3 keeps its special tokens' text, outside the
    ByteLevel alphabet, among the model's pieces as well as among its added tokens)."""
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(real_vocab_dir(name)) for name in ("llama3", "deepseek_v3")}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["llama3", "deepseek_v3"]), data=st.data())
def test_offsets_from_the_ids_on_real_byte_level_vocabularies(byte_level_families, name, data):
    tok = byte_level_families[name]
    specials = sorted(t.content for t in tok._tokenizer.get_added_tokens_decoder().values())[:30]
    pieces = data.draw(st.lists(st.sampled_from(specials) | TEXT, max_size=6))
    text = "".join(pieces)
    check_projection(tok, text, random_mask(data, len(text)), ByteOffsets)


def test_byte_lengths_of_real_vocabularies(byte_level_families):
    for name, tok in byte_level_families.items():
        lengths = token_byte_lengths(tok, tok._tokenizer)
        bos = tok.convert_tokens_to_ids(tok.bos_token)
        assert lengths[bos] == len(tok.bos_token.encode()), name  # DeepSeek V3's: 27 bytes of 21 characters


# ------------------------------------------------------------------ a text cut in pieces


def cuts_of(data, text: str) -> list[int]:
    return data.draw(st.lists(st.integers(0, len(text)), max_size=4), label="cuts")


def test_a_cut_is_a_token_boundary_by_hand(qwen3_tok):
    # ChatML's header "\n" and content " \nx": one token "\n \n" across the boundary; cut there, two
    text = "<|im_start|>assistant\n \nx"
    cut = len("<|im_start|>assistant\n")
    whole, = encode_batch([text], qwen3_tok)
    pieced, = encode_batch([text], qwen3_tok, [[cut]])
    assert [qwen3_tok.decode([i]) for i in whole[0]] == ["<|im_start|>", "assistant", "\n \n", "x"]
    assert [qwen3_tok.decode([i]) for i in pieced[0]] == ["<|im_start|>", "assistant", "\n", " \n", "x"]
    assert isinstance(pieced[1], ByteOffsets) and pairs(pieced[1])[2:] == [(21, 22), (22, 24), (24, 25)]
    assert encode_batch([text], qwen3_tok, [[0, len(text)]])[0][0] == whole[0]  # a cut at either end: no cut
    assert piece_bounds(text, [cut, 0, cut, len(text)]) == [0, cut, len(text)]


@settings(max_examples=150, deadline=None)
@given(TEXT, st.data())
def test_pieces_are_each_tokenized_alone_offsets_from_the_ids(qwen3_tok, text, data):
    check_projection(qwen3_tok, text, random_mask(data, len(text)), ByteOffsets, cuts_of(data, text))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["llama3", "deepseek_v3"]), data=st.data())
def test_pieces_on_real_byte_level_vocabularies(byte_level_families, name, data):
    tok = byte_level_families[name]
    specials = sorted(t.content for t in tok._tokenizer.get_added_tokens_decoder().values())[:30]
    text = "".join(data.draw(st.lists(st.sampled_from(specials) | TEXT, max_size=6)))
    check_projection(tok, text, random_mask(data, len(text)), ByteOffsets, cuts_of(data, text))


@settings(max_examples=60, deadline=None)
@given(st.text(st.sampled_from("ae\u0301\u0323\u0302\u00e9 \n\u1e09c\u0327\u0301\U0001f642"), max_size=30),
       st.data())
def test_pieces_with_unicode_normalization(nfc_qwen, text, data):
    check_projection(nfc_qwen, text, random_mask(data, len(text)), None, cuts_of(data, text))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["<tool>", " ", "\n", "a", "é"]), max_size=12).map("".join), st.data())
def test_pieces_with_an_added_token_taking_in_whitespace(lstrip_qwen, text, data):
    check_projection(lstrip_qwen, text, random_mask(data, len(text)), None, cuts_of(data, text))


@settings(max_examples=60, deadline=None)
@given(st.text(st.sampled_from("abz "), max_size=20), st.data())
def test_pieces_read_from_the_encodings_without_byte_lengths(dropping, text, data):
    cuts = cuts_of(data, text)
    multi = len(piece_bounds(text, cuts)) > 2
    check_projection(dropping, text, random_mask(data, len(text)), OffsetArray if multi else EncodingOffsets, cuts)


def test_a_tokenizer_that_prefixes_every_text_is_not_cut(qwen3_tok, sentencepiece_style):
    # a piece alone would gain the "▁" SentencePiece writes before a text: the ids would spell another text
    assert cuttable(qwen3_tok) and not cuttable(sentencepiece_style)
    text = "hello world"
    assert encode_batch([text], sentencepiece_style, [[5]])[0][0] == hf_call([text], sentencepiece_style)[0][0]
    tok = copy.deepcopy(qwen3_tok)
    tok._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not cuttable(tok)
    tok._tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert not cuttable(tok)
    tok._tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    assert cuttable(tok)


def test_pieces_through_the_tokenizer_call(qwen3_tok):
    tok = copy.deepcopy(qwen3_tok)
    tok._tokenizer.enable_truncation(max_length=4)  # not the Rust backend directly: the tokenizer call
    text = "<|im_start|>assistant\n \nx"
    got = encode_batch([text, "ab"], tok, [[22], [1]])
    assert all(isinstance(offs, OffsetArray) for _, offs in got)
    assert as_lists(got) == [pieces_call(text, [22], qwen3_tok), pieces_call("ab", [1], qwen3_tok)]
