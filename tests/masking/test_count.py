"""count_tokens: piece by piece where the counter applies (checked per character), equal to the tokenizer's count."""

from __future__ import annotations

import copy

import pytest
import regex
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, normalizers, pre_tokenizers

import qlora_train.masking.count as count_module
from qlora_train.masking.count import PieceCounter, count_tokens, piece_counter


def tokenizer_counts(texts, tok) -> list[int]:
    return [len(tok(text, add_special_tokens=False)["input_ids"]) for text in texts]


@pytest.fixture(scope="module")
def vocabularies(qwen3_tok, real_vocab_dir):
    """Byte-level BPEs with one expression (Qwen, Llama 3), three (DeepSeek V3: gaps between matches are pieces
    too), and Qwen with the NFC normalizer its own tokenizer.json carries."""
    from transformers import AutoTokenizer

    nfc = copy.deepcopy(qwen3_tok)
    nfc._tokenizer.normalizer = normalizers.NFC()
    return {"qwen": qwen3_tok, "qwen+nfc": nfc,
            **{name: AutoTokenizer.from_pretrained(real_vocab_dir(name)) for name in ("llama3", "deepseek_v3")}}


def test_counts_by_hand(qwen3_tok):
    texts = ["Add 2 and 3: 5.", "東京 🙂", "<think>", "", "'s  \n\n"]
    pieces = [["Add", " ", "2", " and", " ", "3", ":", " ", "5", "."], ["東京", " 🙂"], ["<think>"], [],
              ["'s", "  \n\n"]]  # what the tokenizer cuts (its Split), before the model tokenizes each piece
    assert [[p for p, _ in qwen3_tok._tokenizer.pre_tokenizer.pre_tokenize_str(t)] for t in texts[:2]] == [
        ["Add", "Ġ", "2", "Ġand", "Ġ", "3", ":", "Ġ", "5", "."], ["æĿ±äº¬", "ĠðŁĻĤ"]]  # the same, in ByteLevel form
    counter = piece_counter(qwen3_tok)
    assert counter is not None and counter is piece_counter(qwen3_tok)  # made once per tokenizer
    assert [counter._pieces(t) for t in texts[:2]] + [counter._pieces(t) for t in texts[3:]] == \
        [pieces[0], pieces[1], pieces[3], pieces[4]]
    # "<think>" is an added token: the tokenizer cuts it out before its pre-tokenizer, so the tokenizer counts it
    assert counter.count(texts) == [10, 3, None, 0, 2]  # 東京: one token; " 🙂": two; "  \n\n": one
    assert count_tokens(texts, qwen3_tok) == tokenizer_counts(texts, qwen3_tok) == [10, 3, 1, 0, 2]


# A broad alphabet: each script and class the expressions name, whitespace the two engines might read apart
# (U+001C-U+001F, U+0085, U+180E, U+200B), the contractions' apostrophe and letters (with U+017F, long s, which
# case-folds to s), characters newer than one engine's tables, and the vocabularies' added tokens' texts
ALPHABET = st.characters(codec="utf-8") | st.sampled_from(
    list("aZsStTrRvVmMlLdD'é\u0301ſK1234567890١٢中文あア가жع🙂👍🏽.,-_()!?+$^€<>| \t\n\r\x0b\x0c\x1c\x1f\x85\xa0"
         "\u180e\u200b\u200d\u2028\u3000\ufe0f\ua7ce\U00010940"))
TEXT = st.lists(ALPHABET | st.sampled_from(["'s", "'LL", "  ", "\n\n", "\r\n", "123456", "<think>", "</think>",
                                            "<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>"]),
                max_size=40).map("".join)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["qwen", "qwen+nfc", "llama3", "deepseek_v3"]), texts=st.lists(TEXT, max_size=4))
@example(name="deepseek_v3", texts=["ab1234567c 東京x", "x'LL\ufe0f  "])
@example(name="qwen+nfc", texts=["cafe\u0301", "ſ's 'S"])
def test_counts_equal_the_tokenizers(vocabularies, name, texts):
    tok = vocabularies[name]
    assert count_tokens(texts, tok) == tokenizer_counts(texts, tok)


def _with_expression(tok, expression: str):
    out = copy.deepcopy(tok)
    out._tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(expression), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return out


@pytest.fixture(scope="module")
def unchunked(qwen3_tok):
    """Expressions that read across a space: pieces of two words; a lookahead past the piece other than (?!\\S)."""
    return {"two words": _with_expression(qwen3_tok, r"\p{L}+ \p{L}+|\p{L}+|\p{N}|\s+|[^\s\p{L}\p{N}]+"),
            "lookahead": _with_expression(qwen3_tok, r" ?\p{L}+(?= \p{N})|\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+")}


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["two words", "lookahead"]), texts=st.lists(TEXT, max_size=4))
@example(name="two words", texts=["ab cd ef", "x 1 y  z"])
@example(name="lookahead", texts=["ab 12 cd", "ab  12"])
def test_expressions_reading_across_a_space_are_not_cut_in_chunks(unchunked, name, texts):
    tok = unchunked[name]
    counter = piece_counter(tok)
    assert counter is not None and not counter.chunked  # the ASCII probe, or the lookahead, ruled chunks out
    assert count_tokens(texts, tok) == tokenizer_counts(texts, tok)


def test_the_counter_counts_what_it_can(vocabularies):
    # the fast path is taken (a counter that always left texts to the tokenizer would pass the test above)
    text = "Plan: add 2 and 3, then check it's 5. Code: `print(add(2, 3))`\n\n  東京 naïve 🙂 ١٢٣"
    for name, tok in vocabularies.items():
        counter = piece_counter(tok)
        assert counter is not None and counter.chunked, name  # each text cut in chunks at its spaces (_chunks)
        assert counter.count([text]) == tokenizer_counts([text], tok), name
    assert piece_counter(vocabularies["qwen+nfc"]).count(["cafe\u0301"]) == [None]  # NFC would change it


def test_a_character_the_engines_read_apart_goes_to_the_tokenizer(qwen3_tok):
    # a counter whose expression reads only decimal digits as digits (\d; \p{N} also holds "²", "½"): the
    # probes find those cut apart
    tampered = regex.compile(piece_counter(qwen3_tok).patterns[0].pattern.replace(r"\p{N}", r"\d"))
    counter = PieceCounter(qwen3_tok._tokenizer, [tampered], ())
    assert counter.ascii_good and not counter.bad  # the same on ASCII
    texts = ["x ½ y", "x 123 ١٢٣ y", "a²"]
    assert counter.count(texts) == [None, tokenizer_counts(["x 123 ١٢٣ y"], qwen3_tok)[0], None]
    assert counter.bad == {"½", "²"} and {"x", "a", "١"} <= counter.good
    # a tokenizer whose own expression reads them so: its counter (with the real expression) counts them
    tok = copy.deepcopy(qwen3_tok)
    tok._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert piece_counter(tok).count(texts) == tokenizer_counts(texts, tok)


def test_the_piece_table_starts_again_when_full(qwen3_tok, monkeypatch):
    monkeypatch.setattr(count_module, "_MAX_PIECES", 3)
    counter = PieceCounter(qwen3_tok._tokenizer, piece_counter(qwen3_tok).patterns, ())
    texts = [" ".join(f"word{chr(97 + i)}{chr(97 + j)}" for j in range(6)) for i in range(5)]  # 30 pieces
    assert counter.count(texts) == tokenizer_counts(texts, qwen3_tok)
    assert len(counter.counts) <= 3 + 6  # cleared before a text's new pieces went in


def test_other_pipelines_are_counted_by_the_tokenizer(qwen3_tok, real_vocab_dir):
    from transformers import AutoTokenizer

    gemma = AutoTokenizer.from_pretrained(real_vocab_dir("gemma3"))  # SentencePiece-style: no ByteLevel pieces
    capturing = _with_expression(qwen3_tok, r"(\p{L}+)|\s+|\P{L}")  # a group `regex` would read as capturing
    anchored = _with_expression(qwen3_tok, r"\p{L}+$|\s+|.")  # "$" ends a line to Oniguruma, the text to `regex`
    assert piece_counter(_with_expression(qwen3_tok, r"\p{L}+|\s+|\P{L}")) is not None  # the same, plain
    texts = ["Add 2 and 3: 5.", "x\ny z"]
    for tok in (gemma, capturing, anchored):
        assert piece_counter(tok) is None
        assert count_tokens(texts, tok) == tokenizer_counts(texts, tok)
