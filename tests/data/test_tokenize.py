from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qlora_train.data.tokenize import IGNORE_INDEX, _rust_backend, count_straddling, encode_batch, make_labels

TEXTS = [
    "<|im_start|>user\nnaïve café 東京 🙂<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\nok<|im_end|>\n",
    "def add(a, b):\n    return a + b\n",
    "",
    "   \n\n  trailing spaces   ",
]


def hf_call(texts, tok):
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False)
    return [(ids, [tuple(o) for o in offs]) for ids, offs in zip(enc["input_ids"], enc["offset_mapping"])]


def as_lists(encoded):
    return [(ids, [tuple(o) for o in offs.tolist()]) for ids, offs in encoded]


def test_rust_backend_path_equals_the_tokenizer_call(qwen3_tok):
    assert _rust_backend(qwen3_tok) is not None  # the fast path is the one taken
    got = encode_batch(TEXTS, qwen3_tok)
    assert all(offs.dtype == np.int64 and offs.shape == (len(ids), 2) for ids, offs in got)
    assert as_lists(got) == hf_call(TEXTS, qwen3_tok)


def test_configured_truncation_falls_back_to_the_tokenizer_call(qwen3_tok):
    tok = copy.deepcopy(qwen3_tok)
    tok._tokenizer.enable_truncation(max_length=4)  # a tokenizer.json may ship with truncation on
    assert _rust_backend(tok) is None
    assert as_lists(encode_batch(TEXTS, tok)) == hf_call(TEXTS, qwen3_tok)  # transformers turns it off per call


def test_make_labels_by_hand():
    # text "abcdef", tokens "ab" "cd" "ef"; chars c..f trained -> tokens 1 and 2 trained
    offsets = np.array([[0, 2], [2, 4], [4, 6]])
    mask = np.array([0, 0, 1, 1, 1, 1], dtype=np.uint8)
    assert make_labels([7, 8, 9], offsets, mask) == {
        "input_ids": [7, 8, 9], "attention_mask": [1, 1, 1], "labels": [IGNORE_INDEX, 8, 9]}
    assert make_labels([7, 8, 9], offsets, mask, max_length=2)["labels"] == [8, 9]
    assert make_labels([7, 8, 9], offsets, mask, max_length=2, truncate_side="right")["labels"] == [IGNORE_INDEX, 8]


def test_count_straddling_by_hand():
    offsets = np.array([[0, 2], [2, 5], [5, 6], [5, 6], [6, 6]])  # two tokens share a char (split emoji)
    assert count_straddling(offsets, np.array([0, 0, 0, 1, 1, 1], dtype=np.uint8)) == 1  # "cde": c masked
    assert count_straddling(offsets, np.array([0, 1, 1, 1, 1, 0], dtype=np.uint8)) == 1  # "ab" only
    assert count_straddling(offsets, np.zeros(6, dtype=np.uint8)) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=1, max_size=40), st.data())
def test_count_straddling_equals_the_per_character_definition(mask, data):
    n = len(mask)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=20)))
    bounds = [0, *cuts, n]
    offsets = np.array([[a, b] for a, b in zip(bounds, bounds[1:])] or [[0, 0]])
    char_mask = np.array(mask, dtype=np.uint8)
    brute = sum(0 < int(char_mask[a:b].sum()) < b - a for a, b in offsets)
    assert count_straddling(offsets, char_mask) == brute


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=30))
def test_runs_rebuild_the_mask(mask):
    from qlora_train.data.tokenize import _runs

    rebuilt = [False] * len(mask)
    for a, b in _runs(np.array(mask, dtype=bool)):
        assert a < b and all(mask[a:b])
        rebuilt[a:b] = [True] * (b - a)
    assert rebuilt == mask
