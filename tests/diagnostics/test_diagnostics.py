"""--stats-only and --debug-samples on small data with the real Qwen tokenizer: numbers checked by hand."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from qlora_train.cli import main
from qlora_train.diagnostics import samples as S
from qlora_train.diagnostics.html import debug_html, read_tokens
from qlora_train.diagnostics.stats import advice, group_stats, percentiles

SIMPLE = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
SIMPLE_TEXT = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n")
SIMPLE_TRAINED = "<think>\n\n</think>\n\nHello!<|im_end|>"
LONG = {"messages": [m for k in range(6) for m in (
    {"role": "user", "content": f"Question {k}: " + "tell me more " * 8},
    {"role": "assistant", "content": f"Answer {k}: " + "here is more " * 8})]}
TOOLS = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}],
         "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                                     "parameters": {"type": "object", "properties": {
                                                         "city": {"type": "string"}}}}}]}
NO_ANSWER = {"messages": [{"role": "user", "content": "only a question"}]}


def write_data(tmp_path, lines: list[str], name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def write_config(tmp_path, tokenizer_dir, paths, max_length=192):
    cfg = {"model": {"name_or_path": str(tokenizer_dir), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(p)} for p in paths], "max_length": max_length},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def dataset(tmp_path, qwen_tokenizer_dir):
    """Two sources: 5 rows (simple, broken line, long, no answer, tools) and 1 simple row."""
    a = write_data(tmp_path, [json.dumps(SIMPLE), "{broken", json.dumps(LONG), json.dumps(NO_ANSWER),
                              json.dumps(TOOLS)])
    b = write_data(tmp_path, [json.dumps(SIMPLE)], name="b.jsonl")
    return write_config(tmp_path, qwen_tokenizer_dir, [a, b]), a, b


# --- stats -----------------------------------------------------------------------------------------------------


def test_percentiles_are_nearest_rank():
    assert percentiles([4, 1, 3, 2]) == {"p25": 1, "p50": 2, "p75": 3, "p90": 4, "p95": 4, "p99": 4, "max": 4}
    assert percentiles(range(1, 101)) == {"p25": 25, "p50": 50, "p75": 75, "p90": 90, "p95": 95, "p99": 99,
                                          "max": 100}
    assert percentiles([]) == dict.fromkeys(["p25", "p50", "p75", "p90", "p95", "p99", "max"])


def columns(before, after, trained, reasons=None, **extra):
    n = len(before)
    cols = {"drop_reason": reasons or [""] * n, "drop_detail": [""] * n, "num_tokens_before": before,
            "num_tokens": after, "num_trained_tokens": trained, "dropped_turns": [0] * n,
            "reasoning_trimmed_tokens": [0] * n, "token_fallback": [""] * n, "straddling_tokens": [0] * n,
            "parse_report": ["{}"] * n, "expanded_tokens": [0] * n, "expanded_trained_tokens": [0] * n,
            "source": ["0:x"] * n}
    cols.update(extra)
    return cols


def test_advice_thresholds():
    # 4 of 10 rows reach max_length=100 (40% > 30%); 6 use under 25 tokens (60% > 50%)
    before = [10, 10, 10, 10, 10, 10, 100, 150, 200, 120]
    cols = columns(before, [min(b, 100) for b in before], [5] * 10)
    stats = group_stats(cols, max_length=100, tool_tokens={0: 4, 1: 4})  # 8 of their 20 tokens
    assert stats["share_at_max_length"] == 0.4 and stats["share_under_25pct_max_length"] == 0.6
    assert stats["tool_schema_tokens"] == {"rows_with_tools": 2, "mean_per_row": 4.0, "share_of_their_tokens": 0.4}
    lines = advice(stats, max_length=100)
    assert len(lines) == 3
    assert lines[0].startswith("40% of rows reach max_length=100") and "p95 before truncation is 200" in lines[0]
    assert lines[1].startswith("60% of rows use under 25% of max_length=100") and "to 256" in lines[1]  # p99 200
    assert lines[2].startswith("tool schemas add 4 tokens per row on average (40% of the 2 rows with tools)")
    # at the thresholds themselves nothing is said
    calm = columns([30, 100, 100, 100, 30, 30, 30, 30, 30, 30], [30] * 10, [5] * 10)
    assert group_stats(calm, max_length=100)["share_at_max_length"] == 0.3
    assert advice(group_stats(calm, max_length=100), max_length=100) == []


def test_pair_advice_with_no_pair_kept_says_how_long_the_first_refused_one_was():
    from qlora_train.diagnostics.stats import pair_lines

    detail = ("f.jsonl:1: chosen: 497 tokens > max_length=256 (fit_pair drops prompt exchanges and trims reasoning "
              "first; data.max_response_length would cut the response)")
    cols = columns([0, 0], [0, 0], [0, 0], reasons=["too_long"] * 2, drop_detail=[detail, detail],
                   prompt_length=[0, 0], chosen_tokens=[0, 0], rejected_tokens=[0, 0])
    stats = group_stats(cols, max_length=256, pairs=True)
    assert advice(stats, max_length=256)[0] == (
        "100% of pairs are over a limit (max_length=256; more than 30%: 0 truncated, 2 refused as too_long): raise "
        "data.max_length (no pair was kept; the first refused: chosen: 497 tokens > max_length=256) or the "
        "per-side limits, or pre-filter long pairs")
    assert pair_lines(stats["pairs"], 256)[1:5] == [
        "  prompt (shared)    none (no rows)", "  chosen response    none (no rows)",
        "  rejected response  none (no rows)", "  longer side        none (no rows)"]


def test_stats_only_counts_add_up_and_match_the_rows(dataset, qwen3_tok, capsys):
    cfg_path, a, b = dataset
    out = cfg_path.parent / "stats"
    assert main(["--config", str(cfg_path), "--stats-only", "--stats-dir", str(out)]) == 0
    stats = json.loads((out / "stats.json").read_text())
    overall = stats["overall"]
    assert overall["rows_in"] == 6 and overall["rows_kept"] == 4
    assert overall["dropped"] == {"no_assistant_turn": 1, "unparseable_json": 1}
    assert overall["rows_in"] == overall["rows_kept"] + sum(overall["dropped"].values())
    # per source, in config order, adding up to the overall counts
    assert list(stats["sources"]) == [f"0:{a}", f"1:{b}"]
    assert [s["rows_in"] for s in stats["sources"].values()] == [5, 1]
    assert [s["rows_kept"] for s in stats["sources"].values()] == [3, 1]

    # lengths computed directly with the tokenizer
    def n_tokens(row):
        return len(qwen3_tok(qwen3_tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False),
                             add_special_tokens=False)["input_ids"])

    simple, long, tools = n_tokens(SIMPLE), n_tokens(LONG), n_tokens(TOOLS)
    assert qwen3_tok.apply_chat_template(SIMPLE["messages"], tokenize=False) == SIMPLE_TEXT
    assert (simple, tools, long) == (17, 149, 412)  # only the long row is over max_length=192
    before = sorted([simple, long, tools, simple])
    expect = {f"p{p}": before[math.ceil(p / 100 * 4) - 1] for p in (25, 50, 75, 90, 95, 99)}
    assert overall["tokens_before_truncation"] == {"rows": 4, **expect, "max": long}
    after = overall["tokens_after_truncation"]
    assert after["rows"] == 4 and after["max"] <= 192 and after["p25"] == simple
    assert overall["share_at_max_length"] == 0.25  # the long row
    assert overall["truncation"]["rows_turns_dropped"] == 1 and overall["truncation"]["turns_dropped"] >= 2
    assert overall["truncation"]["rows_token_fallback_left"] == 0
    # trained tokens: "<think>\n\n</think>\n\nHello!<|im_end|>" is 7 tokens in each simple row
    assert len(qwen3_tok(SIMPLE_TRAINED, add_special_tokens=False)["input_ids"]) == 7
    assert overall["trained_tokens"]["per_row"]["p25"] == 7
    assert overall["tool_schema_tokens"]["rows_with_tools"] == 1
    no_tools = len(qwen3_tok(qwen3_tok.apply_chat_template(TOOLS["messages"], tokenize=False),
                             add_special_tokens=False)["input_ids"])
    assert overall["tool_schema_tokens"]["mean_per_row"] == tools - no_tools
    assert overall["parse"]["tools_present"] == 1 and overall["parse"]["schemas"] == {"messages": 4}
    assert stats["advice"][-1].startswith("2 of 6 rows are dropped")
    png = (out / "token_lengths.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    printed = capsys.readouterr().out
    assert "rows in 6, kept 4, dropped 2" in printed and f"== source 0:{a}" in printed
    assert "dropped       1  unparseable_json  (first: " + f"{a}:2: unparseable JSON line" in printed
    assert not (cfg_path.parent / "out").exists()  # nothing else written, no model loaded


# --- samples ---------------------------------------------------------------------------------------------------


def test_token_pieces_join_to_the_text_even_inside_a_character(qwen3_tok):
    text = "naïve 🙂 龘<|im_end|>"
    ids = qwen3_tok(text, add_special_tokens=False)["input_ids"]
    pieces = S.token_pieces(ids, qwen3_tok)
    assert "".join(pieces) == text and len(pieces) == len(ids)
    assert pieces[-1] == "<|im_end|>"
    assert pieces[-3:] == ["", " 龘", "<|im_end|>"]  # 龘's bytes span two tokens: the first adds no text


def test_select_indices():
    reasons = ["", "x", "", "", "y", ""]
    assert S.select_indices(reasons, 2) == [0, 2]
    assert S.select_indices(reasons, 9, refused=True) == [1, 4]
    drawn = S.select_indices(reasons, 2, seed=3)
    assert drawn == S.select_indices(reasons, 2, seed=3) and set(drawn) <= {0, 2, 3, 5} and len(drawn) == 2
    assert S.select_indices(reasons, 10, seed=3) == [0, 2, 3, 5]


def test_debug_samples_plain_output_and_html(dataset, monkeypatch, capsys):
    cfg_path, a, _ = dataset
    out = cfg_path.parent / "dbg"
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["--config", str(cfg_path), "--debug-samples", "1", "--debug-tokens", "--stats-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    body = SIMPLE_TEXT.replace(SIMPLE_TRAINED, S.OPEN + SIMPLE_TRAINED + S.CLOSE)
    assert (f"--- {a}:1  (source 0:{a})\ntokens 17 before truncation, 17 after; trained 7; "
            f"truncation: none\n{body}\n") in printed
    assert "     0    -100  151644  '<|im_start|>'" in printed  # (label, id) per token
    assert "    15  151645  151645  '<|im_end|>'" in printed  # the end of turn is trained
    assert "    16    -100     198  '\\n'" in printed
    page = (out / "debug_samples.html").read_text()
    tokens = read_tokens(page)
    assert list(tokens) == ["row-0"] and len(tokens["row-0"]) == 17
    assert "".join(t for _, _, t in tokens["row-0"]) == SIMPLE_TEXT
    assert "".join(t for on, _, t in tokens["row-0"] if on) == SIMPLE_TRAINED  # exactly the trained text
    assert tokens["row-0"][15] == (True, "#15 id 151645 label 151645", "<|im_end|>")


def test_sharegpt_rows_with_a_system_column_show_it_rendered_and_masked(tmp_path, qwen_tokenizer_dir, monkeypatch,
                                                                       capsys):
    """A row-level ``system`` column (ShareGPT's convention) opens the conversation, untrained; a conversation with a
    system message of its own keeps it, and the column that differs is counted and advised on."""
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Arr!"}]
    rows = [{"system": "You are a pirate.", "conversations": turns},
            {"system": "You are a pirate.", "conversations": [{"from": "system", "value": "Be brief."}, *turns]}]
    data = write_data(tmp_path, [json.dumps(r) for r in rows])
    cfg, out = write_config(tmp_path, qwen_tokenizer_dir, [data]), tmp_path / "dbg"
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["--config", str(cfg), "--stats-only", "--debug-samples", "2", "--stats-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    answer = S.OPEN + "<think>\n\n</think>\n\nArr!<|im_end|>" + S.CLOSE
    for system, line in (("You are a pirate.", 1), ("Be brief.", 2)):
        assert (f"--- {data}:{line}  (source 0:{data})\ntokens ") in printed
        assert (f"\n<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                f"{answer}\n") in printed
    assert "system column first in 1 rows, not used in 1 (a system message of their own that differs)" in printed
    assert ("- system column: 1 row has a system message of their own and a 'system' column that differs: their own "
            "is used, the column is not: make them agree, or leave one out") in printed
    stats = json.loads((out / "stats.json").read_text())["overall"]["parse"]
    assert (stats["system_from_column"], stats["system_column_conflicts"]) == (1, 1)
    tokens = read_tokens((out / "debug_samples.html").read_text())["row-0"]
    assert "".join(t for _, _, t in tokens).startswith("<|im_start|>system\nYou are a pirate.<|im_end|>\n")
    assert "".join(t for on, _, t in tokens if on) == "<think>\n\n</think>\n\nArr!<|im_end|>"


def test_debug_refused_shows_reason_and_raw_row(dataset, capsys, monkeypatch):
    cfg_path, a, _ = dataset
    monkeypatch.setenv("NO_COLOR", "1")
    assert main(["--config", str(cfg_path), "--debug-samples", "5", "--debug-refused",
                 "--stats-dir", str(cfg_path.parent / "dbg")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("== template layout\n")  # the layout first (test_layout_declaration.py)
    assert "\n2 refused samples (first rows)" in printed
    assert f"--- {a}:2  (source 0:{a})\nrefused: unparseable_json: {a}:2: unparseable JSON line" in printed
    assert f"refused: no_assistant_turn: {a}:4:" in printed and '"content": "only a question"' in printed


def test_colour_on_a_terminal():
    sample = S.Sample(index=0, location="x:1", source="0:x", input_ids=[1, 2, 3], labels=[-100, 2, 3],
                    pieces=["a", "b", "c"], num_tokens_before=3, truncation="none")
    assert S.spans(sample) == [("a", False), ("bc", True)] and S.trained_text(sample) == ["bc"]
    assert f"{S.GREEN}bc" in S.format_sample(sample, color=True)
    assert S.format_sample(sample, color=False).endswith(f"a{S.OPEN}bc{S.CLOSE}")


def test_cli_rejects_debug_flags_without_samples(dataset, capsys):
    cfg_path, _, _ = dataset
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(cfg_path), "--debug-tokens"])
    assert exc.value.code == 2 and "need --debug-samples N" in capsys.readouterr().err


def test_html_escapes_and_marks_refused_rows():
    kept = S.Sample(index=3, location="f:4", source="0:f", input_ids=[7, 8], labels=[-100, 8],
                  pieces=["<b>&", "</pre>"], num_tokens_before=2, truncation="none")
    refused = S.Sample(index=5, location="f:6", source="0:f", input_ids=[], labels=[], pieces=[],
                     num_tokens_before=0, truncation="none", drop_reason="no_assistant_turn",
                     drop_detail="f:6: no assistant", raw='{"messages": []}')
    page = debug_html([kept, refused])
    assert "&lt;b&gt;&amp;" in page and "&lt;/pre&gt;" in page
    assert read_tokens(page) == {"row-3": [(False, "#0 id 7 label -100", "<b>&"), (True, "#1 id 8 label 8", "</pre>")],
                                 "row-5": []}
    assert "refused: no_assistant_turn" in page
