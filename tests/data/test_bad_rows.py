"""Bad rows: every row is kept or dropped with a reason and its location; nothing from a row crashes a batch."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data import process_rows
from qlora_train.data.dataset import build_datasets
from qlora_train.data.drops import BadRowError

GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
LONG = {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "a"}]}


def test_unexpected_exception_in_a_stage_drops_only_that_row(qwen3_tok, monkeypatch):
    import qlora_train.data.sft as pipeline

    real = pipeline.canonicalize_row

    def flaky(row, cfg, **kw):
        if row.get("boom"):
            raise KeyError("surprise")
        return real(row, cfg, **kw)

    monkeypatch.setattr(pipeline, "canonicalize_row", flaky)
    out = process_rows([GOOD, {**GOOD, "boom": 1}, GOOD], qwen3_tok, DataConfig(max_length=64))
    assert out["drop_reason"] == ["", "bad_row", ""]
    assert out["drop_detail"][1] == "row 1: unexpected KeyError: 'surprise'"
    assert len(out["input_ids"][0]) == len(out["labels"][0]) > 0 and out["input_ids"][1] == []


def bug_config(tmp_path, tokenizer_dir, rows: int) -> tuple:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**GOOD, "n": i}) + "\n" for i in range(rows)))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tokenizer_dir), "chat_template": "qwen3"},
        "data": {"datasets": [{"path": str(data)}], "cache_dir": str(tmp_path / "cache"), "max_length": 64},
        "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}))
    return cfg, data


def test_a_bug_in_a_stage_on_every_row_stops_the_run_with_its_traceback(tmp_path, qwen_tokenizer_dir, monkeypatch,
                                                                         capsys):
    """Loud bugs, quiet bad rows: a TypeError raised by our own code on every row is not 'bad data' to count and
    skip: --stats-only stops (exit 70) and prints the first row's traceback, down to the line that raised."""
    import qlora_train.data.sft as pipeline
    from qlora_train.cli import main

    def buggy(messages, tokenizer, **kw):
        return len(messages) + "1"  # a TypeError in a stage, on every row

    monkeypatch.setattr(pipeline, "render_example", buggy)
    cfg, data = bug_config(tmp_path, qwen_tokenizer_dir, rows=20)
    assert main(["--config", str(cfg), "--stats-only", "--stats-dir", str(tmp_path / "stats")]) == 70
    err = capsys.readouterr().err
    assert "internal error (a bug in qlora-train" in err
    assert f"20 of 20 rows (100.0%) failed with an unexpected exception; the first, {data}:1: unexpected " \
           "TypeError: unsupported operand type(s) for +: 'int' and 'str'" in err
    assert "Traceback (most recent call last):" in err and 'return len(messages) + "1"' in err
    assert "stopped: more than 1% of the rows is a bug in qlora-train, not bad data" in err


def test_a_rare_unexpected_exception_is_counted_and_its_traceback_shown(tmp_path, qwen_tokenizer_dir, monkeypatch,
                                                                        caplog):
    import qlora_train.data.sft as pipeline
    from qlora_train.config import load_config
    from qlora_train.data.dataset import build_datasets as build
    from qlora_train.tokenizer import load_tokenizer

    real = pipeline.render_example

    def rarely(messages, tokenizer, **kw):
        if "boom" in messages[0]["content"]:
            raise TypeError("only here")
        return real(messages, tokenizer, **kw)

    monkeypatch.setattr(pipeline, "render_example", rarely)
    cfg_path, data = bug_config(tmp_path, qwen_tokenizer_dir, rows=200)
    rows = data.read_text().splitlines()
    rows[7] = json.dumps({"messages": [{"role": "user", "content": "boom"}, {"role": "assistant", "content": "a"}]})
    data.write_text("\n".join(rows) + "\n")
    cfg = load_config(cfg_path)
    _, _, report = build(cfg.data, load_tokenizer(cfg.model))
    assert report.dropped == {"bad_row": 1} and report.rows_kept == 199  # 0.5%: counted, the run goes on
    assert f"1 of 200 rows (0.5%) failed with an unexpected exception; the first, {data}:8: unexpected TypeError: " \
           "only here" in caplog.text and 'raise TypeError("only here")' in caplog.text


def test_lone_surrogate_is_invalid_unicode_naming_the_message(qwen3_tok):
    bad = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a\ud800b"}]}
    out = process_rows([bad, GOOD], qwen3_tok, DataConfig(max_length=64))
    assert out["drop_reason"] == ["invalid_unicode", ""]
    assert out["drop_detail"][0].startswith("row 0: messages[1]: lone surrogate '\\ud800' at character ")


def test_on_too_long_drop_refuses_instead_of_truncating(qwen3_tok):
    n = len(process_rows([LONG], qwen3_tok, DataConfig(max_length=512))["input_ids"][0])
    assert n > 40
    cut = process_rows([LONG, GOOD], qwen3_tok, DataConfig(max_length=40))
    assert cut["drop_reason"] == ["", ""] and len(cut["input_ids"][0]) == 40
    dropped = process_rows([LONG, GOOD], qwen3_tok, DataConfig(max_length=40, on_too_long="drop"))
    assert dropped["drop_reason"] == ["too_long", ""]
    assert dropped["drop_detail"][0] == f"row 0: {n} tokens > max_length=40 (data.on_too_long: drop)"
    assert dropped["num_tokens_before"][0] == n and dropped["input_ids"][0] == []


RAISING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('role ' + m.role + ' not supported') }}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ESCAPING_TEMPLATE = RAISING_TEMPLATE.replace(
    "{{ raise_exception('role ' + m.role + ' not supported') }}", "{{ m.content.__class__.__mro__ }}")


@pytest.mark.parametrize("template, detail", [
    (RAISING_TEMPLATE, "row 1: TemplateError: role narrator not supported"),
    (ESCAPING_TEMPLATE, "row 1: SecurityError: "),  # the sandbox refuses attribute escapes
], ids=["raise_exception", "sandbox"])
def test_template_errors_are_row_reasons(qwen_tokenizer_dir, template, detail):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.chat_template = template
    narrator = {"messages": [{"role": "narrator", "content": "once"}, *GOOD["messages"]]}
    out = process_rows([GOOD, narrator], tok, DataConfig(max_length=64))
    assert out["drop_reason"] == ["", "template_error"]
    assert out["drop_detail"][1].startswith(detail), out["drop_detail"][1]


def _jsonl(tmp_path, lines: list[bytes]) -> str:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_undecodable_bytes_are_counted_with_file_and_line(tmp_path, qwen3_tok):
    bad = json.dumps(GOOD).encode().replace(b'"a"', b'"a\xff"')
    path = _jsonl(tmp_path, [json.dumps(GOOD).encode(), bad])
    _, _, report = build_datasets(DataConfig(datasets=[DatasetSource(path=path)], max_length=64), qwen3_tok)
    assert report.rows_in == 2 and report.rows_kept == 1 and report.dropped == {"invalid_unicode": 1}
    assert report.first_dropped["invalid_unicode"].startswith(f"{path}:2: messages[1]: lone surrogate '\\udcff'")


def test_on_bad_row_error_stops_at_the_first_bad_row(tmp_path, qwen3_tok):
    path = _jsonl(tmp_path, [json.dumps(GOOD).encode(), json.dumps(LONG).encode(), b'{"foo": 1}', b"{broken"])
    cfg = DataConfig(datasets=[DatasetSource(path=path)], max_length=40, on_bad_row="error", on_too_long="drop")
    with pytest.raises(BadRowError) as err:  # line 2 is too long, a drop the config asked for: not a bad row
        build_datasets(cfg, qwen3_tok)
    assert str(err.value).startswith(f"bad row (unknown_schema) at {path}:3: no known schema among keys ['foo']")


def test_skip_counts_every_row_and_warns_once_per_reason(tmp_path, qwen3_tok, caplog):
    path = _jsonl(tmp_path, [json.dumps(GOOD).encode(), b'{"foo": 1}', b'{"foo": 2}', b"{broken",
                             json.dumps(LONG).encode()])
    cfg = DataConfig(datasets=[DatasetSource(path=path)], max_length=40, on_too_long="drop")
    with caplog.at_level("WARNING", logger="qlora_train.data.dataset"):
        _, _, report = build_datasets(cfg, qwen3_tok)
    assert report.dropped == {"unknown_schema": 2, "unparseable_json": 1, "too_long": 1}
    assert report.rows_in == 5 == report.rows_kept + sum(report.dropped.values())
    warnings = sorted(r.getMessage() for r in caplog.records)
    assert len(warnings) == 3
    assert warnings[2].startswith(f"dropped 2 rows: unknown_schema (first: {path}:2: ")


def test_troubleshooting_page_lists_every_drop_reason():
    from pathlib import Path

    from qlora_train.data.drops import KNOWN_DROP_REASONS

    page = (Path(__file__).resolve().parents[2] / "docs/troubleshooting.md").read_text()
    assert [r for r in sorted(KNOWN_DROP_REASONS) if f"| `{r}` |" not in page] == []


def _call_row(arguments: str) -> bytes:
    call = {"function": {"name": "f", "arguments": arguments}}
    return json.dumps({"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "", "tool_calls": [call]}]}).encode()


HUGE = b"9" * 5000  # past Python's 4,300-digit limit for int(str)
DEEP = b"[" * 5000 + b"]" * 5000  # past its recursion limit
HOSTILE_LINES = [  # (line, reason, the detail after "file:line: ")
    (b'{"n": ' + HUGE + b"}", "unparseable_json", "unparseable JSON line: an integer of more than 4300 digits"),
    (b'{"x": ' + DEEP + b"}", "unparseable_json",
     "unparseable JSON line: nested deeper than Python's JSON reader goes (about 1000 levels)"),
    (b'{"n": ' + HUGE + b', "bad": "\xff"}', "unparseable_json",  # bytes that are not UTF-8: parsed when read
     "unparseable JSON line: an integer of more than 4300 digits"),
    (_call_row('{"n": ' + "9" * 5000 + "}"), "bad_row",
     "messages[1].tool_calls[0]: arguments: an integer of more than 4300 digits"),
    (json.dumps({**GOOD, "tools": "[" * 5000}).encode(), "tools_unparseable",
     "column 'tools': nested deeper than Python's JSON reader goes (about 1000 levels)"),
    (json.dumps({"messages": GOOD["messages"][:1] + [{"role": "assistant", "tool_calls": "[" * 5000}]}).encode(),
     "bad_row", "messages[1]: tool_calls is a string that is not JSON (nested deeper than Python's JSON reader goes "
     "(about 1000 levels))"),
    (b"42", "bad_row", "row is a int, not a mapping"),
    (b"[1, 2]", "bad_row", "messages[0]: expected a mapping, got int"),
    (b'"text"', "bad_row", "row is a str, not a mapping"),
    (b"null", "bad_row", "row is a NoneType, not a mapping"),
    (json.dumps(GOOD).encode().replace(b'"q"', b'"q\x00"'), "unparseable_json",  # a raw NUL byte
     "unparseable JSON line: Invalid control character at line 1 column 45"),
    (json.dumps(GOOD).encode().replace(b'"a"', b'"a\\ud800"'), "invalid_unicode",
     "messages[1]: lone surrogate '\\ud800' at character 71 of the render"),
    (json.dumps({**GOOD, "score": 1e999}).encode(), "", ""),  # read as inf; no stage reads it in an SFT row
    (json.dumps(GOOD).encode().replace(b'"q"', b'"q\\u0000"'), "", ""),  # an escaped NUL is text like any other
    (json.dumps({"messages": [{"role": "user\udcff", "content": "q"}, GOOD["messages"][1]]}).encode(),
     "marker_in_row_text", "messages[0].role 'user\\udcff' is not a plain name (letters, digits, '_', '-', '.', "
     "inner spaces): the template writes it inside its own markup; map it with data.roles"),
    (json.dumps({"messages": [{"role": "user", "content": "\u202e\x9b2J\x1b]0;owned\x07"}]}).encode(),
     "no_assistant_turn", "no trained message (a role in ['assistant'])"),
]


def test_no_line_stops_the_run_each_is_counted_with_its_reason(tmp_path, qwen3_tok):
    """Everything a JSON line can hold that Python's reader, Arrow or a stage refuses: the row is counted under a
    named reason with its location, as a bad row, not as our bug (no traceback), and the run goes on."""
    from qlora_train.data.dataset import load_and_process

    path = _jsonl(tmp_path, [json.dumps(GOOD).encode()] + [line for line, _, _ in HOSTILE_LINES])
    _, processed = load_and_process(DataConfig(datasets=[DatasetSource(path=path)], max_length=64), qwen3_tok)
    assert processed["drop_reason"] == [""] + [reason for _, reason, _ in HOSTILE_LINES]
    assert processed["drop_detail"] == [""] + [f"{path}:{n}: {detail}" if reason else ""
                                               for n, (_, reason, detail) in enumerate(HOSTILE_LINES, start=2)]
    assert set(processed["error_traceback"]) == {""}


@pytest.mark.slow
def test_hostile_lines_stats_only_exits_0(tmp_path, qwen_tokenizer_dir, capsys):
    """The CLI on a file of hostile lines: exit 0, every row counted (on main, the first huge integer stopped
    --stats-only with a ValueError traceback, exit 1)."""
    from qlora_train.cli import main

    cfg, data = bug_config(tmp_path, qwen_tokenizer_dir, rows=1)
    data.write_bytes(b"\n".join([json.dumps(GOOD).encode()] + [line for line, _, _ in HOSTILE_LINES]) + b"\n")
    stats = tmp_path / "stats"
    assert main(["--config", str(cfg), "--stats-only", "--debug-samples", "20", "--debug-refused",
                 "--stats-dir", str(stats)]) == 0
    out = capsys.readouterr().out
    assert f"rows in {1 + len(HOSTILE_LINES)}, kept 3, dropped {len(HOSTILE_LINES) - 2}" in out
    assert (f"dropped       4  unparseable_json  (first: {data}:2: unparseable JSON line: an integer of more than "
            "4300 digits)") in out
    assert '"content": "\\u202e\\x9b2J\\u001b]0;owned\\u0007"' in out  # the refused raw row, shown escaped
    assert re.findall("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e\ud800-\udfff]", out) == []  # no colour: not a tty
    assert json.loads((stats / "stats.json").read_text())["overall"]["parse"]["unknown_roles"] == {"user\udcff": 1}
