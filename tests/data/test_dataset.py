"""Sources and the dataset report: every row is kept or dropped with a reason and a location."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data.dataset import EmptyDatasetError, build_datasets
from qlora_train.data.pipeline import process_rows
from qlora_train.data.processed import SFT_ROW, arrow_lists
from qlora_train.data.sources import SourceError, load_labelled_source, load_source

GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
TOOL_ROW = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}, {"role": "tool", "content": "1"},
    {"role": "assistant", "content": "one"}]}


def test_jsonl_with_broken_line_and_report(tmp_path, qwen3_tok):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(GOOD), "{not json", json.dumps({"foo": 1}), json.dumps(TOOL_ROW),
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]})]
    path.write_text("\n".join(lines) + "\n")
    cfg = DataConfig(datasets=[DatasetSource(path=str(path))], max_length=64)
    train_ds, eval_ds, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_in == 5 and report.rows_kept == 2 == len(train_ds) and eval_ds is None
    assert report.dropped == {"unparseable_json": 1, "unknown_schema": 1, "no_assistant_turn": 1}
    assert report.first_dropped["unparseable_json"].startswith(f"{path}:2: unparseable JSON line")
    assert report.first_dropped["no_assistant_turn"].startswith(f"{path}:5:")
    assert report.parse["rows"] == 2 and report.parse["schemas"] == {"messages": 2}  # rows that parsed


def test_nested_rows_are_not_unioned_by_arrow(tmp_path, qwen3_tok):
    """Arrow would give every tool call every argument key seen in the file (as null)."""
    other = json.loads(json.dumps(TOOL_ROW))
    other["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"y": 2}
    path = tmp_path / "d.json"
    path.write_text(json.dumps([TOOL_ROW, other]))  # a top-level JSON array
    ds = load_source(DatasetSource(path=str(path)))
    rows = [json.loads(r) for r in ds["row"]]
    assert rows == [TOOL_ROW, other]
    assert ds["location"] == [f"{path}[0]", f"{path}[1]"]


def test_parquet_and_max_samples(tmp_path, qwen3_tok):
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": f"q{i}", "response": f"a{i}"} for i in range(5)]).to_parquet(path)
    cfg = DataConfig(datasets=[DatasetSource(path=str(path), max_samples=3)], eval_fraction=0.3)
    train_ds, eval_ds, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_in == 3 and len(train_ds) + len(eval_ds) == 3 and len(eval_ds) == 1


def test_an_eval_split_that_comes_out_empty_is_said_in_one_line_and_left_out(tmp_path, qwen3_tok, caplog):
    """One kept row cannot be split; an eval file whose rows are all dropped gives none: either way the run trains
    without evaluation (docs/training.md), said once."""
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(GOOD) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "only a question"}]}) + "\n")
    for cfg, why in (
        (DataConfig(datasets=[DatasetSource(path=str(one))], eval_fraction=0.1),
         "data.eval_fraction 0.1 of 1 kept row leaves no row for one side of the split"),
        (DataConfig(datasets=[DatasetSource(path=str(one))], eval_datasets=[DatasetSource(path=str(bad))]),
         "no row of data.eval_datasets was kept (their drops: eval_dropped in dataset_report.json)")):
        caplog.clear()
        train_ds, eval_ds, report = build_datasets(cfg, qwen3_tok)
        assert (len(train_ds), eval_ds, report.train_rows, report.eval_rows) == (1, None, 1, 0)
        assert [r.getMessage() for r in caplog.records if "eval" in r.getMessage()] == [
            f"no eval split: {why}; training without evaluation"]


def test_all_rows_dropped_stops_with_reasons(tmp_path, qwen3_tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(EmptyDatasetError, match="unknown_schema: 1"):
        build_datasets(DataConfig(datasets=[DatasetSource(path=str(path))]), qwen3_tok)


def test_missing_source_names_the_path():
    with pytest.raises(SourceError, match="nope.jsonl"):
        load_source(DatasetSource(path="nope.jsonl"))


def test_too_long_rows_are_truncated_or_refused(tmp_path, qwen3_tok):
    long = {"messages": [{"role": "system", "content": "S " * 200}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(long) + "\n" + json.dumps(GOOD) + "\n")
    cfg = DataConfig(datasets=[DatasetSource(path=str(path))], max_length=40, truncate_side="left")
    train_ds, _, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_token_fallback == {"left": 1} and report.rows_kept == 2
    assert max(len(ids) for ids in train_ds["input_ids"]) == 40
    cfg = DataConfig(datasets=[DatasetSource(path=str(path))], max_length=40, truncate_side="right")
    _, _, report = build_datasets(cfg, qwen3_tok)  # the right cut leaves the answer out
    assert report.dropped == {"no_trained_token_after_truncation": 1}


def test_a_change_to_the_masking_code_is_a_new_cache_fingerprint(tmp_path, qwen3_tok, monkeypatch):
    # datasets fingerprints the map function by name, not code: the source hash must reach the fingerprint
    from qlora_train.data import dataset

    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n")
    cfg = DataConfig(datasets=[DatasetSource(path=str(path))], cache_dir=str(tmp_path / "cache"))
    raw = load_labelled_source(0, cfg.datasets[0], cache_dir=cfg.cache_dir)
    assert len(dataset.pipeline_code_hash()) == 32
    first = dataset.process_dataset(raw, qwen3_tok, cfg)._fingerprint
    assert dataset.process_dataset(raw, qwen3_tok, cfg)._fingerprint == first  # same code: cache reused
    monkeypatch.setattr(dataset, "pipeline_code_hash", lambda: "other code")
    assert dataset.process_dataset(raw, qwen3_tok, cfg)._fingerprint != first


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), max_size=12), max_size=8),
       st.lists(st.lists(st.integers(-100, 2**31 - 1), max_size=12), max_size=8))
def test_int_list_columns_are_written_as_the_values_they_hold(bits, ints):
    # the map's int-list columns go to Arrow as one flat array (arrow_lists); a column of ones is made as ones
    for values, dtype in ((bits, "int8"), (ints, "int32"), (ints, "int64"), ([[1, 1], [], [1]], "int8")):
        array = arrow_lists(values, dtype)
        assert array.type == pa.list_(pa.from_numpy_dtype(np.dtype(dtype)))
        assert array.to_pylist() == values


def direct_locations(path) -> list[str]:
    return [f"{path}:{i}" for i in (1, 2, 3)]


def test_the_processed_dataset_holds_what_process_rows_returned(tmp_path, qwen3_tok):
    rows = [GOOD, {"messages": [{"role": "user", "content": "x"}]}, {"text": "plain text " * 3}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(datasets=[DatasetSource(path=str(path))], cache_dir=str(tmp_path / "cache"))
    from qlora_train.data import dataset

    processed = dataset.process_dataset(load_labelled_source(0, cfg.datasets[0], cache_dir=cfg.cache_dir),
                                        qwen3_tok, cfg)
    direct = process_rows(rows, qwen3_tok, cfg, locations=direct_locations(path))
    assert processed.features == SFT_ROW.features()
    for name in SFT_ROW.output_columns:
        assert processed[name] == direct[name], name
    assert processed["source"] == [f"0:{path}"] * 3 and processed["location"] == direct_locations(path)
