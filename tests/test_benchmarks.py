"""The benchmark's reference methods, checked against the pipeline (they must compute the same masks)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from qlora_train.data import DataConfig, canonicalize_row, process_rows
from qlora_train.data.tokenize import IGNORE_INDEX

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_preprocess.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_preprocess", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generation_tok(family_tokenizers, bench):
    tok = copy.deepcopy(family_tokenizers["chatml"])
    tok.chat_template = bench.GENERATION_TEMPLATE.read_text()
    return tok


def test_rows_are_deterministic(bench):
    assert bench.make_rows(5) == bench.make_rows(5) != bench.make_rows(5, seed=1)
    assert [r for r in bench.iter_rows(3)] == bench.make_rows(3)


def test_reference_masks_match_the_pipeline(bench, generation_tok):
    rows = bench.make_rows(24)
    cfg = DataConfig(max_length=4096)
    canon = [canonicalize_row(r, cfg) for r in rows]
    trained = [[lab != IGNORE_INDEX for lab in labels] for labels in bench.pipeline(rows, generation_tok, cfg)]
    # prefix re-rendering is exact on a template whose prefixes render identically (ChatML)
    assert [[bool(m) for m in mask] for mask in bench.prefix_rerender(canon, generation_tok)] == trained
    # transformers' generation-tag masks differ only on tokens that straddle a span edge
    hf = bench.hf_assistant_mask(canon, generation_tok)
    straddling = sum(process_rows(rows, generation_tok, cfg)["straddling_tokens"])
    differ = sum(bool(m) != t for mask, tr in zip(hf, trained) for m, t in zip(mask, tr))
    assert [len(m) for m in hf] == [len(t) for t in trained]
    assert 0 < differ <= straddling  # (the generated rows do have some)
    assert bench.agreement(bench.pipeline(rows, generation_tok, cfg), hf) > 0.99
