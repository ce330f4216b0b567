"""What training checks of prepared data read back (issue 46): its files' hashes against those ``--preprocess``
wrote, and every row's tokens (ids and labels of one length, ids in the vocabulary, labels -100 or their id)."""

from __future__ import annotations

import datasets
import pytest

from qlora_train.data import prepared_checks
from qlora_train.data.prepared_checks import changed_files, shard_hashes, token_problem

OK = {"input_ids": [[1, 2, 3], [4, 5]], "labels": [[-100, 2, 3], [-100, 5]]}


def problem(columns: dict, vocab_size: int = 10) -> str | None:
    return token_problem(datasets.Dataset.from_dict(columns), vocab_size=vocab_size)


@pytest.mark.parametrize("columns, expected", [
    (OK, None),
    ({**OK, "labels": [[-100, 2, 3], [-100]]}, "row 1: 2 ids and 1 labels"),
    ({**OK, "input_ids": [[1, 2, 3], [4, 10]], "labels": [[-100, 2, 3], [-100, -100]]},
     "row 1, position 1: id 10 is outside the vocabulary of 10 tokens"),
    ({**OK, "input_ids": [[1, -1, 3], [4, 5]], "labels": [[-100, -100, 3], [-100, 5]]},
     "row 0, position 1: id -1 is outside the vocabulary of 10 tokens"),
    ({**OK, "labels": [[-100, 2, 3], [4, 5]]}, None),  # a prompt trained: the hash check's to find, not this one's
    ({**OK, "labels": [[-100, 2, 3], [-100, 6]]}, "row 1, position 1: label 6 is neither -100 nor its token id 5"),
    ({**OK, "labels": [[-99, 2, 3], [-100, 5]]}, "row 0, position 0: label -99 is neither -100 nor its token id 1"),
    ({"chosen_input_ids": [[1, 2]], "chosen_labels": [[-100, 2]], "rejected_input_ids": [[1, 3]],
      "rejected_labels": [[-100, 4]]}, "row 0 (rejected), position 1: label 4 is neither -100 nor its token id 3"),
])
def test_token_problem_names_the_first_bad_row(columns, expected):
    assert problem(columns) == expected


def test_token_problem_counts_rows_across_its_batches(monkeypatch):
    monkeypatch.setattr(prepared_checks, "ROWS_AT_ONCE", 2)
    ids = [[1, 2]] * 5
    labels = [[-100, 2]] * 4 + [[-100, 9]]
    assert problem({"input_ids": ids, "labels": labels}) == ("row 4, position 1: label 9 is neither -100 nor its "
                                                             "token id 2")


def test_changed_files_names_what_differs_from_the_hashes_written(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "eval").mkdir()
    for name, text in (("train/a.arrow", "a"), ("train/state.json", "{}"), ("eval/a.arrow", "e")):
        (tmp_path / name).write_text(text)
    saved = shard_hashes(tmp_path, ("train", "eval"))
    assert sorted(saved) == ["eval/a.arrow", "train/a.arrow", "train/state.json"]
    assert changed_files(tmp_path, "train", saved) == []
    (tmp_path / "train/a.arrow").write_text("b")
    (tmp_path / "train/state.json").unlink()
    (tmp_path / "train/b.arrow").write_text("new")
    (tmp_path / "eval/a.arrow").write_text("changed, but not read")
    assert changed_files(tmp_path, "train", saved) == ["train/a.arrow: changed since --preprocess wrote it",
                                                       "train/state.json: missing",
                                                       "train/b.arrow: not written by --preprocess"]


def test_a_single_file_is_hashed_and_checked_too(tmp_path):
    (tmp_path / "dataset_report.json").write_text('{"rows_kept": 3}')
    saved = shard_hashes(tmp_path, ("dataset_report.json",))
    assert list(saved) == ["dataset_report.json"] and changed_files(tmp_path, "dataset_report.json", saved) == []
    (tmp_path / "dataset_report.json").write_text('{"rows_kept": 4}')
    assert changed_files(tmp_path, "dataset_report.json", saved) == [
        "dataset_report.json: changed since --preprocess wrote it"]
