"""The fast byte-level encoder (masking/fast_bpe.py): the ids and offsets ``tokenizers`` gives, on the real Qwen,
Llama 3 and DeepSeek V3 vocabularies; a pipeline it cannot run exactly keeps ``tokenizers``; a difference found by
``data.rule_check`` switches the tokenizer back, counted."""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from qlora_train.config import DataConfig
from qlora_train.data import process_rows
from qlora_train.data.dataset import summarize_columns
from qlora_train.masking import fast_bpe
from qlora_train.masking import tokenize as T
from qlora_train.masking.tokenize import ByteOffsets, encode_batch, fast_encoder, verify_encoder
from tests.masking.test_tokenize import as_lists, hf_call

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}? naïve café 東京"},
                      {"role": "assistant", "content": f"<think>\nadd\n</think>\n\n{2 * i}  \n\n done."}]}
        for i in range(12)]


def with_backend(tok, change):
    """A copy of ``tok`` whose Rust pipeline ``change`` (a function of the pipeline's JSON) altered."""
    spec = json.loads(tok._tokenizer.to_str())
    change(spec)
    out = copy.deepcopy(tok)
    out._tokenizer = Tokenizer.from_str(json.dumps(spec))
    return out


@pytest.fixture(scope="module")
def vocabularies(qwen3_tok, llama3_vocab_tok, real_vocab_dir):
    """name -> tokenizer: the real Qwen vocabulary (Qwen3's markers), the same with Qwen2's NFC normalizer, Llama 3
    and DeepSeek V3 (its three Split steps: not representable, it keeps tokenizers)."""
    nfc = copy.deepcopy(qwen3_tok)
    nfc._tokenizer.normalizer = normalizers.NFC()
    deepseek = PreTrainedTokenizerFast.from_pretrained(real_vocab_dir("deepseek_v3"))
    return {"qwen": qwen3_tok, "qwen-nfc": nfc, "llama3": llama3_vocab_tok, "deepseek_v3": deepseek}


def test_which_vocabularies_take_the_fast_encoder(vocabularies):
    took = {name: fast_encoder(tok, tok._tokenizer) is not None for name, tok in vocabularies.items()}
    assert took == {"qwen": True, "qwen-nfc": True, "llama3": True, "deepseek_v3": False}
    assert "Split + Split + Split + ByteLevel" in fast_bpe.build(vocabularies["deepseek_v3"]._tokenizer)


WHITESPACE = st.text(st.sampled_from(" \t\n\r\u00a0\u3000\u2028\x0b\x0c"), min_size=1, max_size=6)
DIGITS = st.text(st.sampled_from("0123456789٣४"), min_size=1, max_size=8)
WORDS = st.sampled_from(["hello", " world", "naïve", "cafe\u0301", "東京", "🙂🙂", "'s", "'LL", "x.y", "--", "ÿ"])
ADDED = st.sampled_from(["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|begin_of_text|>",
                         "<|eot_id|>", "<｜end▁of▁sentence｜>", "<|im_start", "think>", "<"])
PIECE = st.one_of(st.text(max_size=6), WHITESPACE, DIGITS, WORDS, ADDED)
TEXT = st.lists(PIECE, max_size=12).map("".join)


@pytest.mark.parametrize("name", ["qwen", "qwen-nfc", "llama3", "deepseek_v3"])
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(texts=st.lists(TEXT, min_size=1, max_size=3), cut_at=st.lists(st.floats(0, 1), max_size=3))
def test_fast_ids_and_offsets_are_those_of_tokenizers(vocabularies, name, texts, cut_at):
    """Random Unicode, whitespace runs, digits and added tokens next to text: the engine's encode step gives the
    ids and offsets of the tokenizer call, with and without cuts (pieces: ``encoder="tokenizers"``)."""
    tok = vocabularies[name]
    assert as_lists(encode_batch(texts, tok)) == hf_call(texts, tok)
    cuts = [[int(f * len(t)) for f in cut_at] for t in texts]
    assert (as_lists(encode_batch(texts, tok, cuts)) ==
            as_lists(encode_batch(texts, tok, cuts, encoder="tokenizers")))


@pytest.mark.parametrize("text", [
    "",  # regression cases kept as explicit examples
    "\u3000\n 12٣४",
    "a<|im_start|>b<think>c</think>d",
    "<|im_start<|im_start|>",
    "  \n\n\t  x  ",
    "cafe\u0301 café",  # not NFC: the NFC tokenizer encodes it with tokenizers
    "\ud800x",  # a lone surrogate: neither encoder takes it as UTF-8
])
def test_regressions(vocabularies, text):
    for name, tok in vocabularies.items():
        try:
            want = hf_call([text], tok)
        except Exception:  # noqa: BLE001 - what tokenizers refuses, the engine refuses too
            with pytest.raises(Exception):  # noqa: B017
                encode_batch([text], tok)
            continue
        assert as_lists(encode_batch([text], tok)) == want, name


def test_fast_offsets_are_worked_out_from_byte_lengths(vocabularies):
    (ids, offsets), = encode_batch(["<think>\nhi</think> 東京"], vocabularies["qwen"])
    assert isinstance(offsets, ByteOffsets) and len(offsets) == len(ids)


@pytest.mark.parametrize("change, why", [
    (lambda s: s.update(normalizer={"type": "Lowercase"}), "normalizer is Lowercase"),
    (lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True), "adds a prefix space"),
    (lambda s: s["model"].update(dropout=0.1), "dropout"),
    (lambda s: s["added_tokens"][1].update(lstrip=True), "lstrip"),
])
def test_a_pipeline_tiktoken_cannot_run_exactly_keeps_tokenizers(qwen3_tok, change, why, caplog):
    tok = with_backend(qwen3_tok, change)
    with caplog.at_level(logging.INFO, logger="qlora_train.masking.tokenize"):
        assert fast_encoder(tok, tok._tokenizer) is None
        assert fast_encoder(tok, tok._tokenizer) is None  # decided once, said once
    assert why in fast_bpe.build(tok._tokenizer)
    assert sum("not the fast byte-level encoder" in r.message for r in caplog.records) == 1
    texts = ["<|im_start|>user\nHello World 123<|im_end|>"]
    if why != "dropout":  # dropout makes tokenizers' own ids random
        assert as_lists(encode_batch(texts, tok)) == hf_call(texts, tok)


def test_gemma3_is_not_byte_level_and_keeps_tokenizers(real_vocab_dir):
    tok = PreTrainedTokenizerFast.from_pretrained(real_vocab_dir("gemma3"))
    assert fast_encoder(tok, tok._tokenizer) is None
    assert isinstance(fast_bpe.build(tok._tokenizer), str)
    texts = ["<start_of_turn>user\nHello  wörld 123<end_of_turn>"]
    assert as_lists(encode_batch(texts, tok)) == hf_call(texts, tok)


class Wrong:
    """A fast encoder that differs from tokenizers on texts holding "7" (what data.rule_check must catch)."""

    def __init__(self, fast):
        self.fast = fast

    def takes(self, text):
        return self.fast.takes(text)

    def encode(self, text):
        ids = self.fast.encode(text)
        return ids[::-1] if "7" in text else ids

    def encode_array(self, text):
        return np.asarray(self.encode(text), dtype=np.uint32)


def test_a_difference_on_a_checked_row_switches_the_tokenizer_back_counted(qwen3_tok, monkeypatch, caplog):
    tok = copy.deepcopy(qwen3_tok)
    real = fast_encoder(tok, tok._tokenizer)
    want = process_rows(ROWS, qwen3_tok, DataConfig(rule_check="off"))["input_ids"]
    monkeypatch.setattr(T, "fast_encoder", lambda t, b: None if T._SWITCHED_OFF.get(t) else Wrong(real))
    assert verify_encoder(["no seven here"], tok) is None
    with caplog.at_level(logging.WARNING, logger="qlora_train.masking.tokenize"):
        out = process_rows(ROWS, tok, DataConfig(rule_check="all"))
    report = summarize_columns({**out, "source": ["s"] * len(ROWS)})
    assert report.parse["fast_encoder_mismatches"] == 1  # row 7, the first with a 7: switched back there
    assert sum("differs from tokenizers" in r.message for r in caplog.records) == 1
    assert report.rows_kept == len(ROWS) and not report.dropped  # refuses nothing
    assert out["input_ids"] == want  # row 7 and the rest encoded by tokenizers
    assert any("fast byte-level encoder" in line for line in report.lines())


def test_the_pre_tokenizer_is_read_from_the_pipeline(qwen3_tok):
    pre = qwen3_tok._tokenizer.pre_tokenizer
    assert isinstance(pre, pre_tokenizers.Sequence)
    fast = fast_encoder(qwen3_tok, qwen3_tok._tokenizer)
    assert fast.encoding._pat_str == json.loads(pre.__getstate__())["pretokenizers"][0]["pattern"]["Regex"]


def test_token_byte_lengths_from_the_fast_encoders_ranks_are_the_vocabularys(vocabularies):
    """``token_byte_lengths`` read from the fast encoder's ranks (what a run does) equals the array worked out from
    the vocabulary piece by piece."""
    import numpy as np

    for name in ("qwen", "llama3"):
        backend = vocabularies[name]._tokenizer
        fast = fast_bpe.build(backend)
        assert isinstance(fast, fast_bpe.FastBPE), name
        assert np.array_equal(T._byte_lengths(backend, fast), T._byte_lengths(backend)), name


def test_the_build_reads_the_models_saved_vocabulary_and_merges_as_its_json_says(vocabularies):
    """``model_files`` (what the build reads) holds the pipeline JSON's vocabulary and merges, in its order."""
    backend = vocabularies["llama3"]._tokenizer
    vocab, merges = fast_bpe.model_files(backend)
    spec = json.loads(backend.to_str())["model"]
    lines = merges.decode().splitlines()
    assert json.loads(vocab) == spec["vocab"]
    assert lines[0].startswith("#version") and [line.split(" ") for line in lines[1:]] == [
        m.split(" ") if isinstance(m, str) else m for m in spec["merges"]]
