"""Unpaired preference rows (KTO, ``data.objective: unpaired``): the row shapes, what is refused and why, the
sequence equal to a pair's side (the same verified mask: the completion trained, nothing of the prompt), truncation,
``build_datasets`` with exact counts and columns, and the config keys; real Qwen vocabulary, qwen3 template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qlora_train.config import Config, ConfigError, DataConfig, DatasetSource, load_config
from qlora_train.data.dataset import build_datasets
from qlora_train.data.drops import DropReason
from qlora_train.data.pairs import build_preference_example, canonicalize_pair
from qlora_train.data.pipeline import process_rows
from qlora_train.data.processed import UNPAIRED_ROW
from qlora_train.data.unpaired import build_unpaired_example, canonicalize_unpaired, fit_unpaired
from qlora_train.masking import RowRejected
from qlora_train.masking.tokenize import IGNORE_INDEX

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]}
RESULT = {"role": "tool", "content": "{\"temp_c\": 19}"}
GOOD = [  # lines 1-5: TRL's standard and conversational forms, reasoning, a tool call, an instruction row
    {"prompt": "Name the largest planet.", "completion": "Jupiter.", "label": True},
    {"prompt": "What is 12 divided by 4?", "completion": "<think>12 / 4 = 3</think>4.", "label": False},
    {"tools": [WEATHER], "prompt": [{"role": "system", "content": "Use tools for live data."},
                                    {"role": "user", "content": "How warm is it in Lima?"}],
     "completion": [CALL, RESULT, {"role": "assistant", "content": "19 degrees in Lima."}], "label": True},
    {"instruction": "Reverse the word.", "input": "stop", "completion": "pots", "label": 1},
    {"prompt": [{"role": "user", "content": "Opposite of up?"}],
     "completion": [{"role": "assistant", "content": "Left."}], "label": 0},
]
BAD = [  # lines 6-10: each refused for one reason
    (json.dumps({"prompt": "Say hi.", "completion": "Hi!"}), DropReason.UNKNOWN_SCHEMA),
    (json.dumps({"prompt": "Say hi.", "completion": "Hi!", "label": "yes"}), DropReason.BAD_ROW),
    ("{not json", DropReason.UNPARSEABLE_JSON),
    (json.dumps({"prompt": "Weather?", "completion": [CALL, RESULT], "label": True}), DropReason.PAIR_BAD_RESPONSE),
    (json.dumps(GOOD[0]), DropReason.DUPLICATE),
]


@pytest.mark.parametrize(("row", "reason", "detail"), [
    ({"prompt": "q", "completion": "a"}, "unknown_schema",
     "an unpaired preference row (train.method: kto) needs 'completion' and 'label'; it has keys ['completion', "
     "'prompt']; data.field_mappings names other columns, e.g. {completion: response, label: is_good}"),
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "unknown_schema",
     "an unpaired preference row (train.method: kto) needs 'completion' and 'label'; it has keys ['chosen', "
     "'prompt', 'rejected']: a pair (chosen, rejected) trains with train.method: dpo or orpo"),
    ({"prompt": "q", "completion": "a", "label": "true"}, "bad_row",
     "label: expected true (desirable) or false (undesirable), got 'true'"),
    ({"prompt": "q", "completion": "a", "label": 2}, "bad_row",
     "label: expected true (desirable) or false (undesirable), got 2"),
    ({"prompt": "q", "completion": "a", "label": None}, "bad_row",
     "label: expected true (desirable) or false (undesirable), got None"),
    ({"completion": "a", "label": True}, "pair_bad_prompt",
     "no prompt: an unpaired row needs 'prompt' (or 'question', or 'instruction') beside its completion (keys "
     "['completion', 'label'])"),
    ({"prompt": "q", "completion": "", "label": True}, "pair_empty_response", "completion[0]: empty assistant turn"),
    ({"prompt": "q", "completion": True, "label": True}, "bad_content_type",
     "completion: messages[0]: content of type bool"),
    ({"prompt": [{"role": "user", "content": None}], "completion": "a", "label": True}, "empty_user_turn",
     "prompt: messages[0]: a user turn without content (nothing for a response to answer)"),
    ({"prompt": "q", "completion": [{"role": "user", "content": "a"}], "label": True}, "pair_bad_response",
     "completion[0]: a 'user' message inside the response (a response holds assistant turns and tool results "
     "only)"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "completion": "b",
      "label": True}, "pair_bad_prompt",
     "the prompt ends with a assistant message: it must end with a user turn (or a tool result) for a response to "
     "answer"),
])
def test_refused_rows_name_the_key_and_why(row, reason, detail):
    with pytest.raises(RowRejected) as err:
        canonicalize_unpaired(row)
    assert (err.value.reason, err.value.detail) == (reason, detail)


def test_row_shapes_to_canonical_messages():
    rows = [canonicalize_unpaired(r) for r in GOOD]
    assert [r.desirable for r in rows] == [True, False, True, True, False]
    assert [r.format for r in rows] == ["prompt_completion"] * 3 + ["instruction", "prompt_completion"]
    assert rows[0].prompt == [{"role": "user", "content": "Name the largest planet."}]
    assert rows[0].completion == [{"role": "assistant", "content": "Jupiter."}]
    assert rows[1].completion == [{"role": "assistant", "content": "4.", "reasoning_content": "12 / 4 = 3"}]
    assert rows[3].prompt == [{"role": "user", "content": "Reverse the word.\n\nstop"}]
    assert rows[2].tools == [WEATHER]
    mapped = canonicalize_unpaired({"q": "2+2?", "answer": "4", "good": True, "system": "Be brief."},
                                   DataConfig(field_mappings={"prompt": "q", "completion": "answer", "label": "good"}))
    assert mapped.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert mapped.report.system_from_column == 1
    own = canonicalize_unpaired({"prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "q"}],
                                 "completion": "a", "label": True, "system": "Be brief."})
    assert own.prompt[0] == {"role": "system", "content": "Mine."} and own.report.system_column_conflicts == 1


@pytest.mark.parametrize("raw", GOOD[:3] + GOOD[4:])
def test_the_sequence_is_a_pair_sides_sequence(raw, qwen3_tok):
    """The same prompt and completion as a pair's chosen side: the same ids, labels and prompt length (the pair's
    verified mask: the completion's assistant turns trained, the prompt and tool results not)."""
    row = canonicalize_unpaired(raw)
    ex = build_unpaired_example(row.prompt, row.completion, qwen3_tok, tools=row.tools)
    other = [{"role": "assistant", "content": "A different answer."}]
    pair = build_preference_example(row.prompt, row.completion, other, qwen3_tok, tools=row.tools)
    assert ex["input_ids"] == pair["chosen_input_ids"] and ex["labels"] == pair["chosen_labels"]
    assert ex["prompt_length"] == pair["prompt_length"] and ex["attention_mask"] == [1] * len(ex["input_ids"])
    n = ex["prompt_length"]
    assert set(ex["labels"][:n]) == {IGNORE_INDEX}
    assert qwen3_tok.decode(ex["input_ids"][:n]).endswith("<|im_start|>assistant\n")


def test_what_is_trained_by_hand(qwen3_tok):
    row = canonicalize_unpaired(GOOD[2])
    ex = build_unpaired_example(row.prompt, row.completion, qwen3_tok, tools=row.tools)
    trained = qwen3_tok.decode([t for t in ex["labels"] if t != IGNORE_INDEX])
    assert '"city": "Lima"' in trained and "19 degrees in Lima.<|im_end|>" in trained and "temp_c" not in trained
    assert "How warm" not in trained
    row = canonicalize_unpaired(GOOD[0])
    ex = build_unpaired_example(row.prompt, row.completion, qwen3_tok)
    trained = qwen3_tok.decode([t for t in ex["labels"] if t != IGNORE_INDEX])
    assert trained == "<think>\n\n</think>\n\nJupiter.<|im_end|>"


def test_truncation_drops_middle_prompt_exchanges_then_cuts_only_with_max_response_length(qwen3_tok):
    long_turns = [m for k in range(6) for m in ({"role": "user", "content": f"Question {k}: " + "word " * 30},
                                                 {"role": "assistant", "content": f"Answer {k}."})]
    row = canonicalize_unpaired({"prompt": [{"role": "system", "content": "Sys."}, *long_turns,
                                            {"role": "user", "content": "Last?"}],
                                 "completion": "Final answer.", "label": True})
    full = build_unpaired_example(row.prompt, row.completion, qwen3_tok)
    fitted = fit_unpaired(row, qwen3_tok, max_length=len(full["input_ids"]) - 20)
    assert fitted.tokens_before == len(full["input_ids"]) and fitted.dropped_turns == 1
    text = qwen3_tok.decode(fitted.example["input_ids"])
    assert "Sys." in text and "Question 0" not in text and "Question 1" in text and "Last?" in text
    assert len(fitted.example["input_ids"]) <= len(full["input_ids"]) - 20
    with pytest.raises(RowRejected, match="data.on_too_long: drop") as err:
        fit_unpaired(row, qwen3_tok, max_length=len(full["input_ids"]) - 20, on_too_long="drop")
    assert err.value.reason == DropReason.TOO_LONG
    # a completion longer than max_response_length: cut on the right, its end lost
    long = canonicalize_unpaired({"prompt": "Count.", "completion": " ".join(map(str, range(60))), "label": False})
    cut = fit_unpaired(long, qwen3_tok, max_length=512, max_response_length=10).example
    assert cut["cut"] and len(cut["input_ids"]) == cut["prompt_length"] + 10
    with pytest.raises(RowRejected) as err:
        fit_unpaired(long, qwen3_tok, max_length=cut["prompt_length"] + 10)
    assert err.value.reason == DropReason.TOO_LONG


def write_rows(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_unpaired_rows_through_build_datasets_counted_exactly(tmp_path, qwen3_tok):
    path = write_rows(tmp_path / "kto.jsonl", [json.dumps(r) for r in GOOD] + [line for line, _ in BAD])
    cfg = DataConfig(datasets=[DatasetSource(path=str(path))], objective="unpaired", max_length=256, dedup=True,
                     cache_dir=str(tmp_path / "hf-cache"))
    train, eval_ds, report = build_datasets(cfg, qwen3_tok)
    assert eval_ds is None and report.objective == "unpaired"
    assert (report.rows_in, report.rows_kept, report.train_rows, report.desirable_rows) == (10, 5, 5, 3)
    assert report.dropped == {reason: 1 for _, reason in BAD}
    for k, (_, reason) in enumerate(BAD, start=len(GOOD) + 1):
        assert report.first_dropped[reason].startswith(f"{path}:{k}: ")
    assert train.column_names == list(UNPAIRED_ROW.model_columns) == [
        "input_ids", "attention_mask", "labels", "prompt_length", "desirable", "images"]
    for raw, row in zip(GOOD, train.to_list()):
        canon = canonicalize_unpaired(raw)
        ex = build_unpaired_example(canon.prompt, canon.completion, qwen3_tok, tools=canon.tools)
        fed = {k: ex[k] for k in UNPAIRED_ROW.model_columns if k != "desirable"}
        assert row == {**fed, "desirable": int(canon.desirable)}
    assert "labels (kept): 3 desirable, 2 undesirable" in "\n".join(report.lines())


def test_process_rows_refuses_without_raising(qwen3_tok):
    out = process_rows([GOOD[0], {"prompt": "x", "completion": "y", "label": "no"}, "not a row"], qwen3_tok,
                       DataConfig(objective="unpaired"))
    assert out["drop_reason"] == ["", "bad_row", "bad_row"]
    assert out["desirable"][0] == 1 and out["prompt_length"][0] > 0 and out["num_trained_tokens"][0] > 0
    assert out["drop_detail"][1].startswith("row 1: label: ")


def test_a_pair_row_under_objective_preference_names_kto(qwen3_tok):
    with pytest.raises(RowRejected, match="train.method: kto trains it"):
        canonicalize_pair({"prompt": "q", "completion": "a", "label": True})


def config(tmp_path, **train) -> dict:
    rows = write_rows(tmp_path / "kto.jsonl", [json.dumps(GOOD[0])])
    return {"model": {"name_or_path": "org/model"}, "data": {"datasets": [{"path": str(rows)}]},
            "train": {"method": "kto", "per_device_train_batch_size": 2, **train}}


def test_the_kto_keys_default_to_one_and_every_config_saves():
    """Every run writes its resolved config (``model_dump``): the defaults must be plain values."""
    cfg = Config.model_validate({"model": {"name_or_path": "org/model"}})
    assert (cfg.train.desirable_weight, cfg.train.undesirable_weight) == (1.0, 1.0)
    assert cfg.model_dump(mode="json")["train"]["undesirable_weight"] == 1.0


def test_config_method_kto_reads_unpaired_rows(tmp_path):
    cfg = Config.model_validate(config(tmp_path, desirable_weight=1.33, undesirable_weight=1.0))
    assert cfg.data.objective == "unpaired" and cfg.train.desirable_weight == 1.33


@pytest.mark.parametrize(("tree", "message"), [
    ({"train": {"per_device_train_batch_size": 1}},
     "train.per_device_train_batch_size: method: kto estimates its KL term from each row's prompt paired with "
     "another row's completion in the same batch; set at least 2"),
    ({"data": {"objective": "preference"}},
     "data.objective: train.method: kto trains on unpaired rows (prompt, completion, label); set data.objective: "
     "unpaired (or leave it out)"),
    ({"train": {"method": "dpo", "desirable_weight": 2.0}},
     "train.desirable_weight: applies to method: kto; remove it"),
])
def test_config_refusals(tmp_path, tree, message):
    base = config(tmp_path)
    for section, keys in tree.items():
        base[section].update(keys)
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_stats_only_and_debug_samples_on_unpaired_rows_through_the_cli(tmp_path, qwen_tokenizer_dir, capsys):
    """Tokenizer only, no weights: the report counts the labels (printed and in stats.json, as docs/preference.md
    says); each sample is headed with its file and line, its label, and shows only the completion trained."""
    import yaml

    from qlora_train.cli import main

    rows = write_rows(tmp_path / "kto.jsonl", [json.dumps(r) for r in GOOD] + [line for line, _ in BAD])
    cfg = {"model": {"name_or_path": str(qwen_tokenizer_dir), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(rows)}], "max_length": 256, "dedup": True,
                    "cache_dir": str(tmp_path / "hf-cache")},
           "train": {"method": "kto", "per_device_train_batch_size": 2, "output_dir": str(tmp_path / "out"),
                     "report_to": "none"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "stats"
    assert main(["--config", str(path), "--stats-only", "--debug-samples", "2", "--stats-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("rows in 10, kept 5, dropped 5\n", "labels (kept): 3 desirable, 2 undesirable\n",
                 f"--- {rows}:1 ", "desirable completion: tokens ", f"--- {rows}:2 ", "undesirable completion: tokens ",
                 "Jupiter.<|im_end|>\u27e7",
                 "<|im_start|>user\nName the largest planet.<|im_end|>\n<|im_start|>assistant\n\u27e6<think>"):
        assert line in printed, line
    assert "\u27e6Name the largest" not in printed and "\u27e6<|im_start|>user" not in printed
    stats = json.loads((out / "stats.json").read_text())
    assert stats["overall"]["rows_kept"] == 5
    assert stats["overall"]["labels"] == {"desirable": 3, "undesirable": 2}
