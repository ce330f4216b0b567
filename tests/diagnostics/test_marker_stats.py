"""--stats-only on a template whose markers are plain text in the vocabulary: what each costs, and the advice to
add them with model.new_tokens; with new tokens, which were added."""

from __future__ import annotations

import json

import pytest
import yaml

from qlora_train.cli import main
from qlora_train.diagnostics.stats import marker_advice

# runs --stats-only on real vocabularies: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

ROWS = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}] * 3


def stats_only(tmp_path, tokenizer_dir, template, capsys, *overrides) -> tuple[list[str], dict]:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = {"model": {"name_or_path": str(tokenizer_dir), "chat_template": str(template)},
           "data": {"datasets": [{"path": str(tmp_path / "d.jsonl")}], "max_length": 64},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    args = ["--config", str(tmp_path / "cfg.yaml"), "--stats-only", *(a for o in overrides for a in ("--set", o))]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    return lines, json.loads((tmp_path / "out" / "stats.json").read_text())


def test_plain_text_markers_are_counted_and_the_option_suggested(tmp_path, qwen_tokenizer_dir, foreign_template,
                                                                 capsys):
    lines, stats = stats_only(tmp_path, qwen_tokenizer_dir, foreign_template, capsys)
    assert stats["markers"] == {"plain_text": {"<|turn_open|>": 6, "<|turn_close|>": 6}, "added": {},
                                "already_tokens": [], "new_tokens": None}
    assert "template markers as plain text (tokens each time a turn writes one): <|turn_open|> 6, " \
           "<|turn_close|> 6" in lines
    advice = [line for line in lines if "model.new_tokens" in line]
    assert advice == [f"- {marker_advice(stats['markers'])}"]
    assert "set model.new_tokens: auto to add them as tokens" in advice[0]
    assert stats["overall"]["rows_kept"] == 3


def test_with_new_tokens_it_says_which_were_added(tmp_path, qwen_tokenizer_dir, foreign_template, capsys):
    lines, stats = stats_only(tmp_path, qwen_tokenizer_dir, foreign_template, capsys, "model.new_tokens=auto")
    assert stats["markers"]["added"] == {"<|turn_open|>": {"id": 151669, "was_tokens": 6},
                                         "<|turn_close|>": {"id": 151670, "was_tokens": 6}}
    assert stats["markers"]["plain_text"] == {}
    assert "new tokens (model.new_tokens): <|turn_open|> id 151669 (was 6 tokens), <|turn_close|> id 151670 " \
           "(was 6 tokens)" in lines
    assert "template markers as plain text (tokens each time a turn writes one): none, every marker is a single " \
           "token" in lines
    assert not any("model.new_tokens: auto" in line for line in lines)
    # the trained tokens: Hello, ! and the end marker, now one token each
    assert stats["overall"]["trained_tokens"]["total"] == 3 * 3


def test_a_listed_token_that_leaves_markers_plain_names_the_list(tmp_path, qwen_tokenizer_dir, foreign_template,
                                                                 capsys):
    lines, stats = stats_only(tmp_path, qwen_tokenizer_dir, foreign_template, capsys,
                              'model.new_tokens=["<|turn_close|>", "<think>"]')
    assert stats["markers"]["plain_text"] == {"<|turn_open|>": 6}
    assert stats["markers"]["already_tokens"] == ["<think>"]
    assert "new tokens already single tokens, not added: <think>" in lines
    assert any("add them to model.new_tokens (or set it to auto)" in line for line in lines)
