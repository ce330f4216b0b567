"""Weighted mixing: observed proportions with a fixed seed, stopping strategies, the report and the log."""

from __future__ import annotations

import json
import logging

import pytest

from qlora_train.config import DataConfig, DatasetSource, MixingConfig
from qlora_train.data.dataset import build_datasets


def source(tmp_path, name, n, weight=None):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{name} {i}", "response": "ok"}) + "\n" for i in range(n)))
    return DatasetSource(path=str(path), weight=weight)


@pytest.mark.parametrize("strategy", ["first_exhausted", "all_exhausted"])
def test_observed_proportions_follow_the_weights(tmp_path, qwen3_tok, strategy, caplog):
    a, b = source(tmp_path, "a", 150, weight=3), source(tmp_path, "b", 150, weight=1)
    cfg = DataConfig(datasets=[a, b], mixing=MixingConfig(seed=7, stopping_strategy=strategy))
    with caplog.at_level(logging.INFO, logger="qlora_train.data.dataset"):
        train, _, report = build_datasets(cfg, qwen3_tok)
    la, lb = f"0:{a.path}", f"1:{b.path}"
    assert report.mixing_weights == {la: 0.75, lb: 0.25}
    assert "mixing weights normalised to sum 1" in caplog.text and f"{la}=0.750" in caplog.text
    assert report.rows_per_source_before_mixing == {la: 150, lb: 150}
    after = report.rows_per_source_after_mixing
    assert sum(after.values()) == len(train) == report.train_rows
    assert abs(after[la] / len(train) - 0.75) < 0.05
    if strategy == "first_exhausted":  # stops when the heavier source is used up
        assert after[la] == 150 and 30 < after[lb] < 70
    else:  # oversamples until the lighter source is used up too
        assert after[lb] >= 150 and after[la] > 150


def test_without_replacement_uses_every_row_once(tmp_path, qwen3_tok):
    a, b = source(tmp_path, "a", 30, weight=3), source(tmp_path, "b", 10, weight=1)
    cfg = DataConfig(datasets=[a, b], mixing=MixingConfig(stopping_strategy="all_exhausted_without_replacement"))
    train, _, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_per_source_after_mixing == report.rows_per_source_before_mixing == {
        f"0:{a.path}": 30, f"1:{b.path}": 10}
    assert len(set(map(tuple, train["input_ids"]))) == 40


def test_same_seed_same_mix_other_seed_other_mix(tmp_path, qwen3_tok):
    srcs = [source(tmp_path, "a", 40, weight=1), source(tmp_path, "b", 40, weight=1)]
    runs = [build_datasets(DataConfig(datasets=srcs, mixing=MixingConfig(seed=s, stopping_strategy="first_exhausted")),
                           qwen3_tok)[0]["input_ids"] for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_without_weights_sources_are_concatenated(tmp_path, qwen3_tok):
    a, b = source(tmp_path, "a", 3), source(tmp_path, "b", 2)
    train, _, report = build_datasets(DataConfig(datasets=[a, b]), qwen3_tok)
    assert report.mixing_weights == {} and len(train) == 5
    assert report.rows_per_source_after_mixing == report.rows_per_source_before_mixing == {
        f"0:{a.path}": 3, f"1:{b.path}": 2}
    prompts = [qwen3_tok.decode(ids).split("user\n")[1].split("<|im_end|>")[0] for ids in train["input_ids"]]
    assert prompts == ["a 0", "a 1", "a 2", "b 0", "b 1"]


@pytest.mark.parametrize("weights, problem", [((1, None), "set `weight` on every source or on none"),
                                              ((1, 0), "greater than 0")])
def test_weights_are_validated(tmp_path, weights, problem):
    with pytest.raises(ValueError, match=problem):
        DataConfig(datasets=[DatasetSource(path="a", weight=weights[0]), DatasetSource(path="b", weight=weights[1])])
