"""Preference rows through the dataset pipeline (``data.objective: preference``): every format through
``build_datasets`` with exact counts and columns, bad rows counted with their location, pair truncation (system +
last exchange + both whole responses), the score-margin filter, dedup / eval split / mixing, the config checks,
``--stats-only`` / ``--debug-samples`` / ``--preprocess`` through the CLI; real Qwen vocabulary, qwen3 template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from qlora_train.cli import main
from qlora_train.config import ConfigError, DataConfig, DatasetSource, MixingConfig, load_config
from qlora_train.data.dataset import build_datasets
from qlora_train.data.messages import DropReason, RowRejected
from qlora_train.data.pairs import build_preference_example, canonicalize_pair, fit_pair
from qlora_train.data.pipeline import process_rows
from qlora_train.data.processed import PAIR_COLUMNS
from qlora_train.data.tokenize import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]}
RESULT = {"role": "tool", "content": "{\"temp_c\": 19}"}
GOOD = [  # lines 1-6: one pair of each format, some with scores, reasoning, a tool call
    {"prompt": "Name the largest planet.", "chosen": "Jupiter.", "rejected": "Mars.",
     "score_chosen": 9, "score_rejected": 2},
    {"prompt": "What is 12 divided by 4?", "chosen": "<think>12 / 4 = 3</think>3.", "rejected": "4.",
     "score_chosen": 5, "score_rejected": 4.5},
    {"tools": [WEATHER], "prompt": [{"role": "system", "content": "Use tools for live data."},
                                    {"role": "user", "content": "How warm is it in Lima?"}],
     "chosen": [CALL, RESULT, {"role": "assistant", "content": "19 degrees in Lima."}],
     "rejected": [{"role": "assistant", "content": "Probably cold."}]},
    {"instruction": "Reverse the word.", "input": "stop", "chosen": "pots", "rejected": "spot"},
    {"chosen": [{"role": "user", "content": "Opposite of up?"}, {"role": "assistant", "content": "Down."}],
     "rejected": [{"role": "user", "content": "Opposite of up?"}, {"role": "assistant", "content": "Left."}]},
    {"chosen": "\n\nHuman: Is ice cold?\n\nAssistant: Yes, it is frozen water.",
     "rejected": "\n\nHuman: Is ice cold?\n\nAssistant: No, ice is hot."},
]
BAD = [  # lines 7-12: each refused for one reason
    (json.dumps({"prompt": "Say hi.", "chosen": "Hi!"}), DropReason.PAIR_MISSING_SIDE),
    (json.dumps({"prompt": "Say hi.", "completion": "Hi!", "label": True}), DropReason.UNPAIRED_PREFERENCE),
    ("{not json", DropReason.UNPARSEABLE_JSON),
    (json.dumps({"prompt": "Say hi.", "chosen": "Hello.", "rejected": "Hello."}), DropReason.PAIR_IDENTICAL),
    (json.dumps({"prompt": "Weather?", "chosen": [CALL, RESULT], "rejected": "Sunny."}), DropReason.PAIR_BAD_RESPONSE),
    (json.dumps(GOOD[0]), DropReason.DUPLICATE),
]


def write_rows(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    return write_rows(tmp_path / "pairs.jsonl", [json.dumps(r) for r in GOOD] + [line for line, _ in BAD])


def data_config(tmp_path, paths, **kw) -> DataConfig:
    return DataConfig(datasets=[DatasetSource(path=str(p)) for p in paths], objective="preference",
                      cache_dir=str(tmp_path / "hf-cache"), **{"max_length": 256, "dedup": True, **kw})


def assert_pair(row: dict, max_length: int) -> None:
    """Both sides within max_length, labels aligned, the shared prompt identical and never trained."""
    n = row["prompt_length"]
    assert n > 0 and row["chosen_input_ids"][:n] == row["rejected_input_ids"][:n]
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        assert len(ids) == len(labels) <= max_length
        assert set(labels[:n]) == {IGNORE_INDEX} and any(t != IGNORE_INDEX for t in labels[n:])


def test_pairs_of_every_format_through_build_datasets_counted_exactly(tmp_path, pairs_file, qwen3_tok):
    train, eval_ds, report = build_datasets(data_config(tmp_path, [pairs_file]), qwen3_tok)
    assert eval_ds is None and report.objective == "preference"
    assert (report.rows_in, report.rows_kept, report.train_rows) == (12, 6, 6)
    assert report.dropped == {reason: 1 for _, reason in BAD}
    for k, (_, reason) in enumerate(BAD, start=len(GOOD) + 1):  # each named with its file and line
        assert report.first_dropped[reason].startswith(f"{pairs_file}:{k}: ")
    assert "same content as" in report.first_dropped[DropReason.DUPLICATE]
    assert train.column_names == list(PAIR_COLUMNS) == [
        "chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "prompt_length"]
    rows = train.to_list()
    for row in rows:
        assert_pair(row, 256)
    # each row is exactly build_preference_example of its canonical pair
    for raw, row in zip(GOOD, rows):
        pair = canonicalize_pair(raw)
        ex = build_preference_example(pair.prompt, pair.chosen, pair.rejected, qwen3_tok, tools=pair.tools)
        assert {k: ex[k] for k in PAIR_COLUMNS} == row
    # the tool-call pair: the call, the answer and their end markers trained; the tool result not
    trained = qwen3_tok.decode([t for t in rows[2]["chosen_labels"] if t != IGNORE_INDEX])
    assert '"city": "Lima"' in trained and "19 degrees in Lima." in trained and "temp_c" not in trained
    both = [sum(len(r[f"{s}_input_ids"]) for s in ("chosen", "rejected")) for r in rows]
    assert report.tokens == sum(both) + both[0]  # the duplicate of line 1 was processed before it was marked
    assert "(both sides of each pair)" in "\n".join(report.lines())


def test_bad_pairs_are_refused_in_process_rows_with_location_never_raised(qwen3_tok):
    rows = [json.loads(line) for line, _ in BAD if line.startswith("{\"")][:5] + [7, ["not", "a pair"]]
    out = process_rows(rows, qwen3_tok, DataConfig(objective="preference"), locations=[f"f:{i}" for i in
                                                                                          range(len(rows))])
    assert out["drop_reason"] == [DropReason.PAIR_MISSING_SIDE, DropReason.UNPAIRED_PREFERENCE,
                                  DropReason.PAIR_IDENTICAL, DropReason.PAIR_BAD_RESPONSE, "",
                                  DropReason.BAD_ROW, DropReason.BAD_ROW]
    assert all(d.startswith(f"f:{i}: ") for i, d in enumerate(out["drop_detail"]) if d)
    assert out["chosen_input_ids"][4] and not out["chosen_input_ids"][0] and not out["input_ids"][4]


def long_prompt_pair(exchanges: int = 4) -> dict:
    prompt = [{"role": "system", "content": "You are terse."}]
    for k in range(exchanges):
        prompt += [{"role": "user", "content": f"Old question {k}: " + "tell me about rivers " * 6},
                   {"role": "assistant", "content": f"Old answer {k}: " + "rivers flow to the sea " * 6}]
    prompt.append({"role": "user", "content": "Last question: which river is longest?"})
    return {"prompt": prompt, "chosen": "The Nile, by most measures, or the Amazon by others.",
            "rejected": "The Thames."}


def test_truncation_keeps_system_last_exchange_and_both_whole_responses(qwen3_tok):
    pair = canonicalize_pair(long_prompt_pair())
    full = fit_pair(pair, qwen3_tok, max_length=10_000)
    assert full.dropped_turns == 0
    # room for the system, the last question and the two newest exchanges, not more
    last_two = canonicalize_pair({**long_prompt_pair(), "prompt": pair.prompt[:1] + pair.prompt[5:]})
    fits = fit_pair(last_two, qwen3_tok, max_length=10_000).example
    max_length = max(len(fits["chosen_input_ids"]), len(fits["rejected_input_ids"]))
    fitted = fit_pair(pair, qwen3_tok, max_length=max_length)
    assert fitted.dropped_turns == 2 and fitted.example == fits
    assert fitted.tokens_before == len(full.example["chosen_input_ids"]) + len(full.example["rejected_input_ids"])
    text = qwen3_tok.decode(fitted.example["chosen_input_ids"])
    assert "You are terse." in text and "which river is longest?" in text and "Old question 3" in text
    assert "Old question 1" not in text
    for side, answer in (("chosen", "The Nile, by most measures, or the Amazon by others."),
                         ("rejected", "The Thames.")):
        assert answer in qwen3_tok.decode([t for t in fitted.example[f"{side}_labels"] if t != IGNORE_INDEX])
    assert_pair(fitted.example, max_length)
    # a response that cannot fit whatever the prompt loses: refused, never cut
    with pytest.raises(RowRejected) as err:
        fit_pair(pair, qwen3_tok, max_length=30)
    assert err.value.reason == DropReason.TOO_LONG and err.value.detail.startswith("chosen: ")
    assert "4 of 4 middle prompt exchanges dropped" in err.value.detail
    with pytest.raises(RowRejected, match="data.on_too_long: drop"):
        fit_pair(pair, qwen3_tok, max_length=max_length, on_too_long="drop")


def test_truncated_and_too_long_pairs_are_counted_in_the_report(tmp_path, qwen3_tok):
    path = write_rows(tmp_path / "long.jsonl", [json.dumps(long_prompt_pair()), json.dumps(GOOD[0]),
                                               json.dumps({**long_prompt_pair(), "chosen": "word " * 300})])
    train, _, report = build_datasets(data_config(tmp_path, [path], max_length=120), qwen3_tok)
    assert (report.rows_kept, report.rows_turns_dropped, report.dropped) == (2, 1, {DropReason.TOO_LONG: 1})
    assert report.first_dropped[DropReason.TOO_LONG].startswith(f"{path}:3: chosen: ")
    for row in train.to_list():
        assert_pair(row, 120)


def test_score_margin_filter_drops_and_counts_its_own_reason(tmp_path, pairs_file, qwen3_tok):
    _, _, report = build_datasets(data_config(tmp_path, [pairs_file], min_score_margin=1.0), qwen3_tok)
    # line 1 (9 - 2) is kept; line 2 (5 - 4.5) and the four pairs without scores are below the margin
    assert report.rows_kept == 1 and report.dropped[DropReason.BELOW_SCORE_MARGIN] == 5
    assert report.first_dropped[DropReason.BELOW_SCORE_MARGIN] == (
        f"{pairs_file}:2: score_chosen - score_rejected = 0.5 < data.min_score_margin=1")
    assert report.dropped[DropReason.DUPLICATE] == 1  # line 12, a copy of line 1, passes the margin


def test_eval_split_and_weighted_mixing_of_pair_sources(tmp_path, pairs_file, qwen3_tok):
    other = write_rows(tmp_path / "other.jsonl", [json.dumps({"prompt": f"Count to {k}.", "chosen": " ".join(
        map(str, range(1, k + 1))), "rejected": "No."}) for k in range(2, 6)])
    cfg = data_config(tmp_path, [pairs_file, other], eval_fraction=0.2)
    train, eval_ds, report = build_datasets(cfg, qwen3_tok)
    assert report.rows_kept == 10 and len(train) + len(eval_ds) == 10 and len(eval_ds) == 2
    assert train.column_names == eval_ds.column_names == list(PAIR_COLUMNS)
    cfg = data_config(tmp_path, [pairs_file, other], mixing=MixingConfig(
        stopping_strategy="all_exhausted_without_replacement"))
    cfg.datasets[0].weight, cfg.datasets[1].weight = 3.0, 1.0
    train, _, report = build_datasets(cfg, qwen3_tok)
    assert len(train) == 10 and set(report.mixing_weights.values()) == {0.75, 0.25}
    assert sorted(report.rows_per_source_after_mixing.values()) == [4, 6]


def write_config(tmp_path: Path, model: Path, data_path: Path, **data) -> Path:
    cfg = {"model": {"name_or_path": str(model), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(data_path)}], "objective": "preference", "max_length": 256,
                    "cache_dir": str(tmp_path / "hf-cache"), **data},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_preference_config_refuses_packing_and_a_margin_without_pairs(tmp_path, qwen_tokenizer_dir, pairs_file):
    path = write_config(tmp_path, qwen_tokenizer_dir, pairs_file)
    with pytest.raises(ConfigError) as err:
        load_config(path, ["train.packing=true"])
    assert "train.packing: preference pairs are batched as two whole padded rows each" in str(err.value)
    assert "set train.packing: false for data.objective: preference" in str(err.value)
    with pytest.raises(ConfigError, match="data.min_score_margin: filters preference pairs"):
        load_config(path, ["data.objective=sft", "data.min_score_margin=1"])
    with pytest.raises(ConfigError, match="data.objective"):
        load_config(path, ["data.objective=dpo"])
    with pytest.raises(ConfigError, match="data.dataset_schema: names an SFT row schema"):
        load_config(path, ["data.datasets=[{path: x.jsonl, schema: messages}]"])
    # train.method decides what a row is: dpo reads pairs unless data.objective says otherwise, which is refused
    assert load_config(path, ["data.objective=sft", "train.method=sft"]).data.objective == "sft"
    with pytest.raises(ConfigError, match="data.objective: train.method: dpo trains on preference pairs"):
        load_config(path, ["data.objective=sft", "train.method=dpo"])
    implicit = yaml.safe_load(path.read_text())
    del implicit["data"]["objective"]
    implicit["train"]["method"] = "orpo"
    path.write_text(yaml.safe_dump(implicit))
    assert load_config(path).data.objective == "preference"


def test_an_unexpected_error_in_a_pair_stage_is_a_bad_row_with_its_location(qwen3_tok, monkeypatch):
    from qlora_train.data import pipeline

    def broken(*args, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(pipeline, "fit_pair", broken)
    out = process_rows([GOOD[0]], qwen3_tok, DataConfig(objective="preference"), locations=["f:1"])
    assert out["drop_reason"] == [DropReason.BAD_ROW]
    assert out["drop_detail"] == ["f:1: unexpected ValueError: a bug"]


def test_stats_only_and_debug_samples_on_pairs_through_the_cli(tmp_path, qwen_tokenizer_dir, pairs_file, capsys):
    cfg = write_config(tmp_path, qwen_tokenizer_dir, pairs_file, dedup=True)
    out = tmp_path / "stats"
    assert main(["--config", str(cfg), "--stats-only", "--debug-samples", "1", "--stats-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("pairs kept 6; tokens per pair (kept):", "prompt (shared)", "chosen response", "rejected response",
                 "refused pairs by reason: ", "truncation: middle prompt exchanges dropped in 0 pairs",
                 "--- row 0 chosen", "--- row 0 rejected", "Jupiter.<|im_end|>\u27e7", "Mars.<|im_end|>\u27e7"):
        assert line in printed, line
    stats = json.loads((out / "stats.json").read_text())
    pairs = stats["overall"]["pairs"]
    assert pairs["pairs_kept"] == 6 and pairs["refused"] == {reason: 1 for _, reason in BAD}
    assert pairs["prompt_tokens"]["p50"] > 0 and pairs["chosen_response_tokens"]["max"] > 0
    html = (out / "debug_samples.html").read_text()
    assert 'id="row-0-chosen"' in html and 'id="row-0-rejected"' in html


@pytest.fixture
def model_dir(tmp_path, qwen_tokenizer_dir):
    """The tokenizer and a model config.json, no weights (what --preprocess reads)."""
    from transformers import Qwen3Config

    path = tmp_path / "model"
    shutil.copytree(qwen_tokenizer_dir, path)
    Qwen3Config(num_hidden_layers=2).save_pretrained(path)
    return path


def test_preprocess_round_trip_keeps_the_pair_columns(tmp_path, model_dir, pairs_file):
    from qlora_train.data.prepared import training_data
    from qlora_train.tokenizer import load_tokenizer

    cfg_path = write_config(tmp_path, model_dir, pairs_file, eval_fraction=0.2)
    prepared = tmp_path / "prepared"
    assert main(["--config", str(cfg_path), "--preprocess", "--preprocess-dir", str(prepared)]) == 0
    cfg = load_config(cfg_path)
    tok = load_tokenizer(cfg.model)
    from_raw = training_data(cfg, tok)
    from_prepared = training_data(load_config(cfg_path, [f"data.prepared_path={prepared}"]), tok)
    assert from_prepared.train.column_names == list(PAIR_COLUMNS)
    assert from_prepared.train.to_list() == from_raw.train.to_list()
    assert from_prepared.eval.to_list() == from_raw.eval.to_list()
    assert from_prepared.report == from_raw.report
    with pytest.raises(ConfigError, match="data.objective"):  # SFT config on pair data: the fingerprint differs
        training_data(load_config(cfg_path, [f"data.prepared_path={prepared}", "data.objective=sft"]), tok)


def test_the_bundled_pair_sample_is_kept_whole(tmp_path, qwen3_tok):
    path = REPO / "configs" / "data" / "quickstart-pairs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    train, _, report = build_datasets(data_config(tmp_path, [path]), qwen3_tok)
    assert report.rows_in == len(rows) == report.rows_kept == 24 and not report.dropped
    assert report.parse["tools_present"] == 2 and report.parse["schemas"] == {"preference": 24}
    formats = {canonicalize_pair(r).format for r in rows}
    assert formats == {"prompt_chosen_rejected", "instruction", "implicit_prompt", "hh_rlhf"}
