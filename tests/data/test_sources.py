"""Every local source shape: JSON array / lines, Parquet, Arrow, CSV, directories, globs, lists, builders."""

from __future__ import annotations

import json

import datasets
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data.dataset import build_datasets
from qlora_train.data.sources import SourceError, load_source, load_sources

ROWS = [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(3)]


def rows_of(ds):
    return [json.loads(r) for r in ds["row"]]


def test_json_array_and_json_lines_are_detected(tmp_path):
    array, lines = tmp_path / "a.json", tmp_path / "b.json"
    array.write_text(json.dumps(ROWS, indent=1))
    lines.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    a, b = load_source(DatasetSource(path=str(array))), load_source(DatasetSource(path=str(lines)))
    assert rows_of(a) == rows_of(b) == ROWS
    assert a["location"] == [f"{array}[{i}]" for i in range(3)] and b["location"] == [f"{lines}:{i}" for i in (1, 2, 3)]


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_json_lines_rows_that_are_lists(tmp_path, name):
    path = tmp_path / name
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path.write_text(json.dumps(convo) + "\n" + json.dumps(convo[::-1]) + "\n")
    assert rows_of(load_source(DatasetSource(path=str(path)))) == [convo, convo[::-1]]


@pytest.mark.parametrize("fmt", ["parquet", "csv", "arrow"])
def test_table_formats(tmp_path, fmt):
    ds = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"d.{fmt}"
    if fmt == "parquet":
        ds.to_parquet(path)
    elif fmt == "csv":
        ds.to_csv(path, index=False)
    else:  # an Arrow stream file as save_to_disk writes it
        ds.save_to_disk(tmp_path / "saved")
        path = next((tmp_path / "saved").glob("*.arrow"))
    out = load_source(DatasetSource(path=str(path)))
    assert rows_of(out) == ROWS and out["location"] == [f"{path}[{i}]" for i in range(3)]


def test_saved_dataset_directory(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    assert rows_of(load_source(DatasetSource(path=str(tmp_path / "saved")))) == ROWS


def test_directory_glob_and_list_of_paths(tmp_path):
    (tmp_path / "d").mkdir()
    datasets.Dataset.from_list(ROWS[:0]).save_to_disk(tmp_path / "d" / "saved")  # its .json metadata is not data
    (tmp_path / "d" / "1.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    datasets.Dataset.from_list(ROWS[1:]).to_parquet(tmp_path / "d" / "2.parquet")
    (tmp_path / "d" / "notes.txt").write_text("not data")
    assert rows_of(load_source(DatasetSource(path=str(tmp_path / "d")))) == ROWS
    assert rows_of(load_source(DatasetSource(path=str(tmp_path / "d" / "*.jsonl")))) == ROWS[:1]
    both = DatasetSource(path=[str(tmp_path / "d" / "2.parquet"), str(tmp_path / "d" / "1.jsonl")])
    assert rows_of(load_source(both)) == ROWS[1:] + ROWS[:1]
    only = DatasetSource(path=str(tmp_path / "d"), data_files="*.parquet")
    assert rows_of(load_source(only)) == ROWS[1:]


def test_file_without_extension_needs_builder(tmp_path):
    path = tmp_path / "data"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with pytest.raises(SourceError, match=f"{path}: unknown extension; set `builder`"):
        load_source(DatasetSource(path=str(path)))
    assert rows_of(load_source(DatasetSource(path=str(path), builder="json"))) == ROWS


def test_unknown_hub_id_fails_with_one_clear_line():
    with pytest.raises(SourceError, match="no-such-owner/no-such-set: not a local file, directory or glob"):
        load_source(DatasetSource(path="no-such-owner/no-such-set"))


def test_sources_are_labelled_and_a_list_entry_has_one_label(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(ROWS[0]) + "\n")
    b.write_text(json.dumps(ROWS[1]) + "\n")
    raw = load_sources([DatasetSource(path=[str(a), str(b)]), DatasetSource(path=str(b))])
    assert raw["source"] == [f"0:{a}+{b}", f"0:{a}+{b}", f"1:{b}"]


def test_per_source_schema_and_mappings(tmp_path, qwen3_tok):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps({"q": "x", "a": "y"}) + "\n")
    b.write_text(json.dumps({"q": "x", "a": "y"}) + "\n")
    cfg = DataConfig(datasets=[DatasetSource(path=str(a), schema="prompt_response",
                                             field_mappings={"prompt": "q", "response": "a"}),
                               DatasetSource(path=str(b))])
    train, _, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_kept == 1 and report.dropped == {"unknown_schema": 1}
    assert report.first_dropped["unknown_schema"].startswith(f"{b}:1:")


FORMAT_ROWS = {
    "alpaca": [{"instruction": "Translate.", "input": "hola", "output": "hello"},
               {"instruction": "Say hi.", "input": "", "output": "hi"}],
    "sharegpt": [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}],
    "segments": [{"segments": [{"text": "Q: 1\n", "label": False}, {"text": "A: 1", "label": True}]}],
    "pretokenized": [{"input_ids": [9707, 1879], "labels": [-100, 1879]}],
}


@pytest.mark.parametrize("schema, fmt", [(s, f) for s in sorted(FORMAT_ROWS) for f in ("parquet", "arrow")]
                         + [("alpaca", "csv")])  # CSV holds flat rows only
def test_table_files_give_the_same_examples_as_json_lines(tmp_path, qwen3_tok, schema, fmt):
    rows = FORMAT_ROWS[schema]
    lines = tmp_path / "rows.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = tmp_path / f"rows.{fmt}"
    ds = datasets.Dataset.from_list(rows)
    if fmt == "parquet":
        ds.to_parquet(table)
    elif fmt == "csv":
        ds.to_csv(table, index=False)
    else:
        ds.save_to_disk(tmp_path / "saved")
        table = tmp_path / "saved"
    built = [build_datasets(DataConfig(datasets=[DatasetSource(path=str(p), schema=schema)]), qwen3_tok)[0]
             for p in (lines, table)]
    assert built[0].to_dict() == built[1].to_dict() and len(built[0]) == len(rows)


def test_a_json_array_with_an_element_python_cannot_read_is_read_one_element_at_a_time(tmp_path):
    """A huge integer or deep nesting in one element of a JSON array file: that element is counted (its index
    and line named), every other is read (on main, the whole load failed: DatasetGenerationError)."""
    path = tmp_path / "a.json"
    path.write_text("[\n" + ",\n".join([
        json.dumps(ROWS[0]), '{"n": ' + "9" * 5000 + "}", json.dumps(ROWS[1]), "[" * 5000 + "]" * 5000,
        '{"prompt": tru}', json.dumps({"prompt": "[{,\"}]", "response": "\\\"]"}), "\n"]).rstrip(",\n") + "\n]\n")
    raw = load_source(DatasetSource(path=str(path)))
    assert raw["location"] == [f"{path}[{i}]" for i in range(6)]
    assert raw["load_error"] == [
        "", "unparseable JSON element (line 3): an integer of more than 4300 digits", "",
        "unparseable JSON element (line 5): nested deeper than Python's JSON reader goes (about 1000 levels)",
        "unparseable JSON element (line 6): Expecting value at line 1 column 12", ""]
    assert [json.loads(r) for r in raw["row"] if r] == [ROWS[0], ROWS[1], {"prompt": "[{,\"}]", "response": "\\\"]"}]


@pytest.mark.parametrize("text, why", [
    ('[{"a": 1}, {"b": "x}]', "a string that is never closed (line 1, column 18)"),
    ('[{"a": 1},\n {"b": [}]', "a '}' that closes nothing open (line 2, column 9)"),
    ('[{"a": 1}, {"b": 2}', "a '[' that is never closed (line 1, column 20)"),
    ('[{"a": 1}] {"b": 2}', "text after the array (line 1, column 11)"),
])
def test_a_json_array_whose_frame_is_broken_is_an_error_naming_the_file_and_place(tmp_path, text, why):
    path = tmp_path / "a.json"
    path.write_text(text)
    with pytest.raises(SourceError) as err:
        load_source(DatasetSource(path=str(path)))
    assert str(err.value) == f"{path}: not a JSON array, even read one element at a time: {why}"


def test_a_csv_file_that_is_not_utf8_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "d.csv"
    path.write_bytes(b"prompt,response\nq,a\nq\xff,a\n")
    with pytest.raises(SourceError) as err:
        load_source(DatasetSource(path=str(path)))
    assert str(err.value).startswith(f"{path}: cannot be read as csv: UnicodeDecodeError: 'utf-8' codec can't decode "
                                     "byte 0xff")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(alphabet='[]{},"\\: ab\n'),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{},"\\ a'), inner, max_size=3),
    max_leaves=12)


@given(st.lists(JSON_VALUES, max_size=5), st.sampled_from([None, 0, 2]))
def test_array_elements_are_the_array_items(items, indent):
    """The frame read by brackets, commas and strings alone finds each element of any JSON array as written."""
    from qlora_train.data.sources import _array_elements

    text = json.dumps(items, indent=indent)
    assert [json.loads(element) for _, element in _array_elements(text, "f.json")] == items


@pytest.mark.parametrize("name, text", [("a.json", json.dumps(ROWS)), ("b.jsonl", "\n".join(map(json.dumps, ROWS)))])
def test_a_byte_order_mark_is_skipped(tmp_path, name, text):
    """A file saved with a UTF-8 byte order mark (Windows editors) reads as without it (on main: an array file was
    taken for JSON lines, every line unparseable; a JSON lines file lost its first row)."""
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    raw = load_source(DatasetSource(path=str(path)))
    assert rows_of(raw) == ROWS and set(raw["load_error"]) == {""}


def test_json_rows_are_read_once_and_again_when_the_file_changes(tmp_path):
    """A JSON-lines file's rows are written to one Arrow file of the cache, named by the file's path, size and
    modification time: read again unchanged, the same file (and fingerprint); changed, a new one with the new rows;
    a file without rows is a SourceError naming it."""
    import os

    from qlora_train.data.sources import ROWS_DIR, SourceError, load_source

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n')
    cache = str(tmp_path / "cache")
    first = load_source(DatasetSource(path=str(path)), cache_dir=cache)
    again = load_source(DatasetSource(path=str(path)), cache_dir=cache)
    assert again._fingerprint == first._fingerprint and again.cache_files == first.cache_files
    assert first.cache_files[0]["filename"].startswith(str(tmp_path / "cache" / ROWS_DIR))
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d"}\n')
    os.utime(path, (1, 1))
    changed = load_source(DatasetSource(path=str(path)), cache_dir=cache)
    assert changed._fingerprint != first._fingerprint and changed["location"] == [f"{path}:1", f"{path}:2"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SourceError, match="empty.jsonl: no rows"):
        load_source(DatasetSource(path=str(empty)), cache_dir=cache)
    assert not [p for p in (tmp_path / "cache" / ROWS_DIR).iterdir() if p.name.endswith(".partial")]
