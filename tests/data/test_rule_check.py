"""``data.rule_check``: the fast path checked against the rule on the user's own rows (data/rule_check.py,
masking/check.py), on the real Qwen vocabulary: which rows, their counts, a wrong declared layout caught."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import random
import zlib
from pathlib import Path

import pytest
import yaml

from qlora_train.chat_templates import get_chat_template
from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data import process_rows
from qlora_train.data import rule_check as R
from qlora_train.data.dataset import load_and_process, summarize_columns
from qlora_train.diagnostics.samples import load_samples
from qlora_train.masking import (
    AGREE,
    DISAGREE,
    IGNORE_INDEX,
    UNDECIDED,
    LossPolicy,
    check_with_rule,
)
from qlora_train.masking.layout import TemplateLayout
from qlora_train.masking.layout_declaration import check_declaration
from qlora_train.masking.render import render_conversation

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs/data/quickstart.jsonl"
ROWS = [json.loads(line) for line in QUICKSTART.read_text().splitlines()]
# an end marker that runs into the next turn's opener: the answer, its <|im_end|>, and the next user turn's header
RUNS_ON = {"end_markers": ["<|im_end|>\n<|im_start|>user", "<|im_end|>"]}
DECLARED = dataclasses.replace(TemplateLayout("h", ("h",), ("e",)), declared=("end_markers",))
U1, A1, U2, A2 = ({"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"})


def declared(tok, declaration: dict):
    return get_chat_template(copy.copy(tok), None, None, check_declaration(declaration))


def counts(out: dict) -> tuple[int, int, int]:
    report = summarize_columns({**out, "source": ["s"] * len(out["drop_reason"])})
    return report.rule_checked_rows, report.rule_unchecked_rows, report.rule_disagreements


def trained_text(tok, ids, labels) -> str:
    return tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])


# --- which rows ------------------------------------------------------------------------------------------------


def test_sample_selects_the_first_rows_and_one_in_64_by_a_stable_hash():
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4000)]
    texts = [json.dumps(row) for row in rows]  # the rows as read: their JSON lines
    picked = [i for i, text in enumerate(texts) if R.selected("sample", i, text)]
    assert picked[:R.FIRST_ROWS] == list(range(R.FIRST_ROWS))
    later = len(picked) - R.FIRST_ROWS
    assert 40 <= later <= 85  # about 3992 / 64 = 62
    # by the row, not its place: the same rows are picked in any order, at any position past the first ones
    shuffled = list(range(R.FIRST_ROWS, 4000))
    random.Random(0).shuffle(shuffled)
    again = {i for k, i in enumerate(shuffled) if R.selected("sample", R.FIRST_ROWS + k, texts[i])}
    assert again == set(picked[R.FIRST_ROWS:])
    assert R.row_hash('{"a": 1}') == zlib.crc32(b'{"a": 1}')  # not Python's salted hash()
    assert R.row_text({"b": 2, "a": 1}) == R.row_text({"a": 1, "b": 2}) == '{"a": 1, "b": 2}'
    assert not any(R.selected("off", i, text) for i, text in enumerate(texts[:20]))
    assert all(R.selected("all", i, text) for i, text in enumerate(texts[:20]))
    assert [i for i in range(100) if R.selected("sample", i, "{}", R.first_rows(DECLARED))] == list(range(64))


def test_the_counts_do_not_depend_on_batches_or_row_order(qwen3_tok):
    rows = ROWS * 3  # 144 rows: positions 0-7 and the hash pick
    cfg = DataConfig()
    whole = process_rows(rows, qwen3_tok, cfg)
    halves = [process_rows(rows[a:b], qwen3_tok, cfg, positions=list(range(a, b))) for a, b in ((0, 50), (50, 144))]
    assert [json.loads(p) for h in halves for p in h["parse_report"]] == [json.loads(p) for p in whole["parse_report"]]
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)
    moved = process_rows([rows[i] for i in order], qwen3_tok, cfg, positions=order)
    assert [moved["parse_report"][order.index(i)] for i in range(len(rows))] == whole["parse_report"]


# --- outcomes and counts ---------------------------------------------------------------------------------------


def test_quickstart_rows_agree_and_are_counted(qwen3_tok):
    checked, unchecked, disagree = counts(process_rows(ROWS, qwen3_tok, DataConfig(rule_check="all")))
    # Qwen3 drops an earlier turn's reasoning block: the 12 multi-turn rows are not prefix-stable
    assert (checked, unchecked, disagree) == (36, 12, 0)
    sampled = counts(process_rows(ROWS, qwen3_tok, DataConfig()))
    assert sampled[0] >= R.FIRST_ROWS - 1 and sampled[2] == 0 and sum(sampled) < 48
    assert counts(process_rows(ROWS, qwen3_tok, DataConfig(rule_check="off"))) == (0, 0, 0)


@pytest.mark.parametrize("think_loss", ["all", "answer_only", "answer_plus_think"])
def test_every_think_loss_agrees_on_the_empty_reasoning_block(qwen3_tok, think_loss):
    """Qwen3 writes an empty reasoning block in the last turn of a row without reasoning; ``answer_only`` masks it
    on the fast path, and the rule (prefix renders) must read it the same (it once trained it: every sampled
    ``answer_only`` row disagreed and the run stopped)."""
    rows = [{"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": c}]}
            for c in ("x", "Hello there.", "<")] + ROWS
    out = process_rows(rows, qwen3_tok, DataConfig(think_loss=think_loss, rule_check="all"))
    assert "mask_disagrees" not in out["drop_reason"]
    first = trained_text(qwen3_tok, out["input_ids"][0], out["labels"][0])
    assert first == ("x<|im_end|>" if think_loss != "all" else "<think>\n\n</think>\n\nx<|im_end|>")


def test_a_row_the_layout_cannot_verify_is_verified_by_the_rule_and_counts_as_checked(qwen3_tok):
    messages = LossPolicy().mark([U1, A1])
    rendered = render_conversation(messages, qwen3_tok)._replace(verified_by="prefix_renders")
    assert check_with_rule(messages, rendered, qwen3_tok).outcome == AGREE


def test_a_wrong_declared_layout_is_caught_and_its_rows_refused(qwen3_tok):
    tok = declared(qwen3_tok, RUNS_ON)
    row = {"messages": [U1, A1, U2, A2]}
    messages = LossPolicy().mark(row["messages"])
    rendered = render_conversation(messages, tok)
    assert "".join(c for c, m in zip(rendered.text, rendered.char_mask) if m) == (
        "4<|im_end|>\n<|im_start|>user<think>\n\n</think>\n\n6<|im_end|>")  # the next turn's header trained
    check = check_with_rule(messages, rendered, tok)
    assert check.outcome == DISAGREE
    assert check.detail == ("messages[1]: the turn's answer differs at char 11: the layout trains "
                            "'4<|im_end|>\\n<|im_start|>user', the render through this turn alone ends it "
                            "'4<|im_end|>'")
    out = process_rows([row, {"messages": [U1, A1]}], tok, DataConfig())
    assert out["drop_reason"] == ["mask_disagrees", ""]
    assert out["drop_detail"][0] == "row 0: the layout's mask differs from the rule's: " + check.detail
    assert out["input_ids"][0] == [] and "<|im_start|>user" not in trained_text(tok, out["input_ids"][1],
                                                                                 out["labels"][1])
    assert counts(out) == (1, 0, 1)
    # 'off' trains the wrong mask: the check is what stands between it and training
    off = process_rows([row], tok, DataConfig(rule_check="off"))
    assert off["drop_reason"] == [""] and "4<|im_end|>\n<|im_start|>user" in trained_text(
        tok, off["input_ids"][0], off["labels"][0])


def test_on_a_prefix_stable_template_the_check_compares_tokens(family_tokenizers):
    tok = declared(family_tokenizers["chatml"], RUNS_ON)
    messages = LossPolicy().mark([U1, A1, U2, A2])
    check = check_with_rule(messages, render_conversation(messages, tok), tok)
    assert check.outcome == DISAGREE and check.detail.startswith("token ")
    assert "the layout has '\\n' trained, the rule '\\n' masked" in check.detail
    assert trained_text(tok, *check.fast) == "4<|im_end|>\n<|im_start|>user6<|im_end|>"
    assert trained_text(tok, *check.rule) == "4<|im_end|>6<|im_end|>"
    right = check_with_rule(messages, render_conversation(messages, family_tokenizers["chatml"]),
                            family_tokenizers["chatml"])
    assert right.outcome == AGREE


def test_a_row_the_rule_cannot_decide_is_kept_unchecked(qwen3_tok):
    messages = LossPolicy().mark([U1, A1, U2, A2])
    check = check_with_rule(messages, render_conversation(messages, qwen3_tok), qwen3_tok)
    assert check.outcome == UNDECIDED and "not prefix-stable" in check.detail
    out = process_rows([{"messages": [U1, A1, U2, A2]}], qwen3_tok, DataConfig())
    assert out["drop_reason"] == [""] and counts(out) == (0, 1, 0)


def test_extra_examples_of_expand_are_checked_with_their_row(qwen3_tok):
    row = {"messages": [U1, {**A1, "reasoning_content": "two and two"}, U2, A2]}
    out = process_rows([row], qwen3_tok, DataConfig(reasoning_history="expand"))
    assert out["drop_reason"] == [""] and len(out["expanded_input_ids"][0]) == 1
    # the primary example trains the last turn only (the first is trained in the extra one): both prefix-stable
    assert counts(out) == (1, 0, 0)
    # each example trains one turn, its last: the wrong end marker never applies, both agree and train it right
    tok = declared(qwen3_tok, RUNS_ON)
    bad = process_rows([row], tok, DataConfig(reasoning_history="expand"))
    assert bad["drop_reason"] == [""] and counts(bad) == (1, 0, 0)
    assert "<|im_start|>user" not in trained_text(tok, bad["expanded_input_ids"][0][0], bad["expanded_labels"][0][0])


def test_pairs_are_checked_on_both_sides(qwen3_tok):
    pair = {"prompt": [U1, A1, U2], "chosen": "6", "rejected": "7"}
    single = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    cfg = DataConfig(objective="preference")
    out = process_rows([pair, single], qwen3_tok, cfg)
    assert out["drop_reason"] == ["", ""] and counts(out) == (2, 0, 0)
    tok = declared(qwen3_tok, RUNS_ON)
    bad = process_rows([pair, single], tok, cfg)
    assert bad["drop_reason"] == ["", ""]  # the prompt's turn is not trained: the wrong marker trains nothing
    # a response that goes on after a tool result (Qwen3 writes it in a user turn): the call's turn trains the
    # tool result's header by the wrong marker
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 3}}}]}
    two = {"prompt": [U2], "chosen": [call, {"role": "tool", "content": "6"}, A2],
           "rejected": [call, {"role": "tool", "content": "6"}, {**A2, "content": "7"}]}
    assert process_rows([two], qwen3_tok, cfg)["drop_reason"] == [""]
    refused = process_rows([two], tok, cfg)
    assert refused["drop_reason"] == ["mask_disagrees"]
    assert refused["drop_detail"][0].startswith("row 0: the layout's mask differs from the rule's: chosen: ")
    assert counts(refused) == (0, 0, 1)
    assert counts(process_rows([two], tok, cfg.model_copy(update={"rule_check": "off"}))) == (0, 0, 0)


# --- the run: stopped when the layout does not fit, both masks shown ---------------------------------------------


def source_of(tmp_path, rows: list[dict]) -> DataConfig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(datasets=[DatasetSource(path=str(path))], cache_dir=str(tmp_path / "cache"))


def test_a_few_disagreements_refuse_rows_more_stop_the_run(tmp_path, qwen3_tok, caplog):
    tok = declared(qwen3_tok, RUNS_ON)
    multi, single = {"messages": [U1, A1, U2, A2]}, {"messages": [U1, A1]}
    few = source_of(tmp_path / "few", [multi] * 3 + [single] * 5)
    with caplog.at_level(logging.WARNING):
        _, processed = load_and_process(few, tok)
    assert processed["drop_reason"].count("mask_disagrees") == 3
    assert "3 of 8 rows checked against the rule (data.rule_check) are masked differently" in caplog.text
    many = source_of(tmp_path / "many", [multi] * 4 + [single] * 4)
    with pytest.raises(R.MaskDisagreementError) as err:
        load_and_process(many, tok)
    message = str(err.value)
    assert message.startswith(f"4 of 8 rows checked against the rule (data.rule_check) are masked differently by "
                              f"the layout of the chat template (model.chat_template, else the one of "
                              f"{tok.name_or_path}) and refused as mask_disagrees; the first: ")
    assert "model.template_layout" in message and "--stats-only" in message
    assert err.value.exit_code == 2


def test_debug_samples_show_both_masks_of_a_refused_row(tmp_path, family_tokenizers):
    tok = declared(family_tokenizers["chatml"], RUNS_ON)
    cfg = source_of(tmp_path, [{"messages": [U1, A1, U2, A2]}])
    raw, processed = load_and_process(cfg, tok)
    samples = load_samples(raw, processed, tok, [0], cfg)
    where = raw[0]["location"]  # the row's file and line, as every message names it
    assert [s.name for s in samples] == [where, f"{where} by the layout", f"{where} by the rule"]
    assert samples[0].drop_reason == "mask_disagrees"
    assert "".join(p for p, on in zip(samples[1].pieces, samples[1].trained) if on) == (
        "4<|im_end|>\n<|im_start|>user6<|im_end|>")
    assert "".join(p for p, on in zip(samples[2].pieces, samples[2].trained) if on) == "4<|im_end|>6<|im_end|>"


# --- through the CLI ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stats_only_on_the_quickstart_rows_counts_the_check(tmp_path, qwen_tokenizer_dir, capsys):
    from qlora_train.cli import main

    cfg = {"model": {"name_or_path": str(qwen_tokenizer_dir), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(QUICKSTART)}], "max_length": 256, "cache_dir": str(tmp_path / "c")},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(path), "--stats-only", "--stats-dir", str(tmp_path / "s")]) == 0
    overall = json.loads((tmp_path / "s/stats.json").read_text())["overall"]
    assert overall["rule_checked_rows"] > 0 and overall["rule_disagreements"] == 0
    assert "checked against the rule (data.rule_check): rule_checked_rows " in capsys.readouterr().out
    cfg["model"]["template_layout"] = RUNS_ON
    cfg["data"]["rule_check"] = "all"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(path), "--stats-only", "--stats-dir", str(tmp_path / "s2")]) == 2
    assert "model.template_layout" in capsys.readouterr().err
