"""Extra examples (``reasoning_history: expand``) through the dataset: stable column types, one training row per
example after the eval split, and the report's counts (checked by hand on columns built here)."""

from __future__ import annotations

import json

import datasets
import pytest

import qlora_train.data.dataset as D
from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data.dataset import (
    DatasetReport,
    build_datasets,
    expanded_count,
    explode_examples,
    load_and_process,
    summarize_columns,
)
from qlora_train.data.processed import PAIR_ROW, ROW_TYPES, SFT_ROW, UNPAIRED_ROW
from qlora_train.masking.tokenize import IGNORE_INDEX

# --- column types ----------------------------------------------------------------------------------------------


def test_the_column_sets_derive_from_the_one_row_definition():
    for row_type in ROW_TYPES.values():
        assert list(row_type.features()) == [*row_type.output_columns, "source", "location", "domain"]
        assert list(row_type.empty()) == list(row_type.output_columns) and row_type.empty()["parse_report"] == "{}"
        assert set(row_type.report_columns) - set(row_type.stats_columns) == {"error_traceback"}  # the check's
    assert SFT_ROW.model_columns == ("input_ids", "attention_mask", "labels", "images")
    assert SFT_ROW.kept_columns == ("input_ids", "attention_mask", "labels", "num_tokens", "expanded_input_ids",
                                    "expanded_labels", "images", "source", "domain")
    assert set(SFT_ROW.stats_columns) - set(SFT_ROW.report_columns) == {
        "num_tokens_before", "source", "tool_schema_tokens"}
    # a pair's row holds its two sides, no SFT example; an unpaired row one sequence with its prompt and label
    assert PAIR_ROW.model_columns == (
        "chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "prompt_length", "images")
    assert PAIR_ROW.kept_columns == (*PAIR_ROW.model_columns[:-1], "num_tokens", "images", "source", "domain")
    assert not {"input_ids", "labels", "expanded_input_ids", "token_fallback"} & set(PAIR_ROW.output_columns)
    assert UNPAIRED_ROW.model_columns == ("input_ids", "attention_mask", "labels", "prompt_length", "desirable",
                                          "images")
    assert not {"chosen_input_ids", "expanded_input_ids"} & set(UNPAIRED_ROW.output_columns)
    f = SFT_ROW.features()
    assert (f["input_ids"].feature.dtype, f["labels"].feature.dtype, f["expanded_labels"].feature.feature.dtype,
            f["drop_reason"].dtype) == ("int32", "int64", "int64", "string")


def fake_expansions(n_extra: int):
    """A ``process_rows`` that gives each kept row ``n_extra`` extra examples: its ids cut short by 1, 2, …
    tokens (what a real expansion looks like: a prefix of the conversation), labels = the ids (all trained)."""
    real = D.process_rows

    def process_rows(batch, tokenizer, cfg, **kwargs):
        out = real(batch, tokenizer, cfg, **kwargs)
        for i, reason in enumerate(out["drop_reason"]):
            if reason:
                continue
            ids = out["input_ids"][i]
            extra = [ids[:-k] for k in range(1, n_extra + 1)]
            out["expanded_input_ids"][i] = extra
            out["expanded_labels"][i] = [list(x) for x in extra]
            out["expanded_tokens"][i] = out["expanded_trained_tokens"][i] = sum(len(x) for x in extra)
            report = json.loads(out["parse_report"][i])
            report.update(expanded_examples=n_extra, reasoning_expanded_turns=n_extra)
            out["parse_report"][i] = json.dumps(report)
        return out

    return process_rows


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}]}


REFUSED = {"messages": [{"role": "user", "content": "no answer"}]}


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_batches_without_and_with_token_lists_concatenate(tmp_path, qwen3_tok, monkeypatch):
    """batch_size 1: the first batch is a refused row (every list empty), the second a kept row with an extra
    example; without stated types the first is typed list<null> and the second cannot be written after it."""
    monkeypatch.setattr(D, "process_rows", fake_expansions(1))
    a = write_rows(tmp_path / "a.jsonl", [REFUSED, chat(0)])
    b = write_rows(tmp_path / "b.jsonl", [chat(1)])  # a second source: concatenated with the first
    cfg = DataConfig(datasets=[DatasetSource(path=a), DatasetSource(path=b)], batch_size=1,
                     cache_dir=str(tmp_path / "cache"))
    _, processed = load_and_process(cfg, qwen3_tok)
    assert processed.features == SFT_ROW.features()
    assert processed["drop_reason"][0] and processed["expanded_input_ids"][0] == []
    assert [len(x) for x in processed["expanded_input_ids"][1:]] == [1, 1]
    assert processed["expanded_input_ids"][1][0] == processed["input_ids"][1][:-1]
    assert expanded_count(processed) == 2


# --- one row per example -----------------------------------------------------------------------------------------


def kept_rows(rows: list[dict]) -> datasets.Dataset:
    """Kept rows as ``build_datasets`` carries them (types as processing writes them)."""
    names = ["input_ids", "attention_mask", "labels", "source", "domain", "num_tokens", "expanded_input_ids",
             "expanded_labels", "images"]
    cols = {k: [r.get(k) for r in rows] for k in names}
    cols["attention_mask"] = [[1] * len(ids) for ids in cols["input_ids"]]
    cols["num_tokens"] = [len(ids) for ids in cols["input_ids"]]
    cols["expanded_input_ids"] = [r.get("expanded_input_ids", []) for r in rows]
    cols["expanded_labels"] = [r.get("expanded_labels", []) for r in rows]
    cols["images"] = [r.get("images", []) for r in rows]
    return datasets.Dataset.from_dict(cols, features=datasets.Features(
        {k: SFT_ROW.features()[k] for k in names}))


def test_explode_puts_the_primary_example_first_then_the_extra_ones_in_order():
    m = IGNORE_INDEX
    kept = kept_rows([
        {"input_ids": [1, 2, 3, 4], "labels": [m, m, 3, 4], "source": "0:a", "domain": "x",
         "expanded_input_ids": [[1, 2], [1, 2, 3]], "expanded_labels": [[m, 2], [m, m, 3]]},
        {"input_ids": [5, 6], "labels": [m, 6], "source": "1:b", "domain": "y"},
        {"input_ids": [7, 8, 9], "labels": [m, 8, 9], "source": "0:a", "domain": "",
         "expanded_input_ids": [[7]], "expanded_labels": [[7]]},
    ])
    out, added = explode_examples(kept)
    assert added == 3 and len(out) == 6
    assert set(out.column_names) == {"input_ids", "attention_mask", "labels", "images", "num_tokens", "source",
                                     "domain"}
    assert out["input_ids"] == [[1, 2, 3, 4], [1, 2], [1, 2, 3], [5, 6], [7, 8, 9], [7]]
    assert out["labels"] == [[m, m, 3, 4], [m, 2], [m, m, 3], [m, 6], [m, 8, 9], [7]]
    assert out["attention_mask"] == [[1] * 4, [1, 1], [1, 1, 1], [1, 1], [1, 1, 1], [1]]
    assert out["num_tokens"] == [4, 2, 3, 2, 3, 1]
    assert out["source"] == ["0:a", "0:a", "0:a", "1:b", "0:a", "0:a"]
    assert out["domain"] == ["x", "x", "x", "y", "", ""]
    assert out.features["input_ids"] == kept.features["input_ids"]  # types kept: int32 ids, int64 labels
    assert out.features["labels"] == kept.features["labels"]


def test_explode_without_extra_examples_only_drops_the_columns():
    kept = kept_rows([{"input_ids": [1, 2], "labels": [-100, 2], "source": "0:a", "domain": ""}])
    out, added = explode_examples(kept)
    assert added == 0 and set(out.column_names) == {"input_ids", "attention_mask", "labels", "images", "source",
                                                    "domain", "num_tokens"}
    assert out["input_ids"] == [[1, 2]]


def test_build_datasets_splits_rows_before_exploding_them(tmp_path, qwen3_tok, monkeypatch):
    """10 rows with 2 extra examples each -> 30 examples; every row's 3 examples sit together on one side of the
    eval split, the primary first; the report counts examples in train/eval and the extra ones by row."""
    monkeypatch.setattr(D, "process_rows", fake_expansions(2))
    path = write_rows(tmp_path / "d.jsonl", [chat(i) for i in range(10)] + [REFUSED])
    cfg = DataConfig(datasets=[DatasetSource(path=path)], eval_fraction=0.3, cache_dir=str(tmp_path / "cache"))
    train, eval_ds, report = build_datasets(cfg, qwen3_tok)
    for split in (train, eval_ds):
        ids = split["input_ids"]
        assert len(ids) % 3 == 0
        for k in range(0, len(ids), 3):  # primary, then the same ids cut short by 1 and by 2 tokens
            assert ids[k + 1] == ids[k][:-1] and ids[k + 2] == ids[k][:-2]
    assert (report.rows_kept, report.train_rows, report.eval_rows) == (10, 21, 9)
    assert report.expanded_examples == 20 and report.reasoning_expanded_turns == 20
    assert report.expanded_tokens == report.expanded_trained_tokens == sum(
        len(ids) for split in (train, eval_ds) for k, ids in enumerate(split["input_ids"]) if k % 3)
    assert report.lines()[0] == "rows in 11, kept 10 -> 30 examples (train 21, eval 9)"
    # max_samples and shuffle count examples, after the explode
    cfg = cfg.model_copy(update={"eval_fraction": 0.0, "shuffle": True, "max_samples": 7})
    train, _, report = build_datasets(cfg, qwen3_tok)
    assert report.train_rows == len(train) == 7


# --- the report ----------------------------------------------------------------------------------------------------


def report_columns(rows: list[dict]) -> dict[str, list]:
    """``SFT_ROW.report_columns`` for hand-made rows: each row gives drop_reason, parse (a dict) and expanded token
    counts."""
    keys = {"drop_reason": "", "drop_detail": "", "num_tokens": 10, "num_trained_tokens": 4, "dropped_turns": 0,
            "reasoning_trimmed_tokens": 0, "token_fallback": "", "straddling_tokens": 0, "expanded_tokens": 0,
            "expanded_trained_tokens": 0}
    cols = {k: [r.get(k, default) for r in rows] for k, default in keys.items()}
    cols["parse_report"] = [json.dumps(r["parse"]) if r.get("parse") else "{}" for r in rows]
    return cols


ROWS = [
    # Qwen3 under drop: 2 earlier turns trained without their 30 reasoning tokens
    {"parse": {"rows": 1, "reasoning_dropped_rows": 1, "reasoning_dropped_turns": 2, "reasoning_dropped_tokens": 30}},
    # under expand: 2 turns trained in 2 extra examples of 50 tokens, 20 of them trained
    {"parse": {"rows": 1, "reasoning_expanded_turns": 2, "expanded_examples": 2}, "expanded_tokens": 50,
     "expanded_trained_tokens": 20},
    # a template that ignores system prompts
    {"parse": {"rows": 1, "unrendered_messages": {"system": 1}}},
    # a duplicate of the second row: in ``parse`` (every row that parsed), not in the kept counts
    {"parse": {"rows": 1, "reasoning_expanded_turns": 2, "expanded_examples": 2, "unrendered_messages":
               {"system": 1}}, "drop_reason": "duplicate", "drop_detail": "d:4: same content as d:2",
     "expanded_tokens": 50, "expanded_trained_tokens": 20},
    {"drop_reason": "unrendered_role", "drop_detail": "d:5: messages[1]: role 'knowledge' is not rendered"},
]


def test_summarize_counts_reasoning_and_extra_examples_of_kept_rows():
    report = summarize_columns(report_columns(ROWS))
    assert (report.rows_in, report.rows_kept) == (5, 3)
    assert (report.reasoning_dropped_rows, report.reasoning_dropped_turns, report.reasoning_dropped_tokens) == (
        1, 2, 30)
    assert (report.reasoning_expanded_turns, report.expanded_examples) == (2, 2)
    assert (report.expanded_tokens, report.expanded_trained_tokens) == (50, 20)
    assert report.unrendered_messages == {"system": 1}
    # parse: every row that parsed, the duplicate included
    assert report.parse["rows"] == 4 and report.parse["expanded_examples"] == 4
    assert report.parse["unrendered_messages"] == {"system": 2}


def test_report_lines_say_what_the_template_dropped_and_what_expand_added():
    report = summarize_columns(report_columns(ROWS))
    report.train_rows = 5
    lines = report.lines()
    assert lines[0] == "rows in 5, kept 3 -> 5 examples (train 5, eval 0)"
    assert "reasoning_history expand: 2 extra examples (50 tokens, 20 trained)" in lines
    assert "reasoning not rendered by the chat template: 2 turns (30 tokens) in 1 rows trained without it" in lines
    assert "messages the chat template does not render (the model never sees them): system 1" in lines
    quiet = DatasetReport(rows_in=1, rows_kept=1, train_rows=1).lines()
    assert quiet[0] == "rows in 1, kept 1 (train 1, eval 0)" and not any("reasoning" in x for x in quiet)
    assert json.loads(report.to_json())["expanded_examples"] == 2


# --- end to end, with the real pipeline ------------------------------------------------------------------------------

TWO_TURNS = {"messages": [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two makes four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6.", "reasoning_content": "Three plus three makes six."},
]}


def trained_text(example: dict, tok) -> str:
    return tok.decode([i for i, lab in zip(example["input_ids"], example["labels"]) if lab != IGNORE_INDEX])


@pytest.mark.parametrize("history", ["expand", "drop"])
def test_qwen3_first_turn_reasoning_is_trained_once_under_expand(tmp_path, qwen3_tok, history):
    path = write_rows(tmp_path / "d.jsonl", [TWO_TURNS])
    cfg = DataConfig(datasets=[DatasetSource(path=path)], reasoning_history=history,
                     cache_dir=str(tmp_path / "cache"))
    train, _, report = build_datasets(cfg, qwen3_tok)
    texts = [trained_text(ex, qwen3_tok) for ex in train]
    assert report.rows_kept == 1
    if history == "expand":
        assert len(train) == report.train_rows == 2
        assert (report.expanded_examples, report.reasoning_expanded_turns, report.reasoning_dropped_turns) == (1, 1, 0)
        assert report.expanded_tokens == len(train[1]["input_ids"])
        assert report.expanded_trained_tokens == sum(lab != IGNORE_INDEX for lab in train[1]["labels"])
        # every turn and its reasoning trained exactly once over the examples
        for part in ("Two plus two makes four.", "It is 4.", "Three plus three makes six.", "It is 6."):
            assert sum(part in t for t in texts) == 1, (part, texts)
        assert "Two plus two makes four." in texts[1]
    else:
        assert len(train) == report.train_rows == 1
        assert (report.expanded_examples, report.reasoning_dropped_rows, report.reasoning_dropped_turns) == (0, 1, 1)
        assert report.reasoning_dropped_tokens > 0
        assert "Two plus two makes four." not in texts[0] and "It is 4." in texts[0]
        assert "reasoning not rendered by the chat template: 1 turns" in "\n".join(report.lines())
