"""The reasoning section of --stats-only: reasoning the template drops, extra examples, unrendered messages and
roles, and the advice on each; processed columns built by hand so every count can be checked."""

from __future__ import annotations

import json

from qlora_train.config import DataConfig
from qlora_train.data.processed import SFT_ROW
from qlora_train.diagnostics.stats import (
    advice,
    compute_stats,
    reasoning_advice,
    stats_lines,
    unrendered_messages_advice,
    unrendered_role_advice,
)

DETAIL = ("d:4: messages[1]: role 'knowledge' is not rendered by the chat template: map it with data.roles: "
          "{system: [knowledge]} or {user: [knowledge]}")


def row(source="0:a", *, reason="", detail="", tokens=100, trained=20, parse=None, extra_tokens=0, extra_trained=0):
    return {"drop_reason": reason, "drop_detail": detail, "num_tokens_before": 0 if reason else tokens,
            "num_tokens": 0 if reason else tokens, "num_trained_tokens": 0 if reason else trained,
            "dropped_turns": 0, "reasoning_trimmed_tokens": 0, "token_fallback": "", "straddling_tokens": 0,
            "parse_report": json.dumps(parse) if parse else "{}", "expanded_tokens": extra_tokens,
            "expanded_trained_tokens": extra_trained, "tool_schema_tokens": 0, "num_images": 0,
            "num_image_tokens": 0, "source": source}


def columns(rows: list[dict]) -> dict[str, list]:
    assert set(rows[0]) == set(SFT_ROW.stats_columns)
    return {k: [r[k] for r in rows] for k in SFT_ROW.stats_columns}


ROWS = [
    # source a: one row with 3 extra examples (3 turns expanded), one with 1, one plain
    row(parse={"rows": 1, "reasoning_expanded_turns": 3, "expanded_examples": 3}, extra_tokens=240,
        extra_trained=90),
    row(parse={"rows": 1, "reasoning_expanded_turns": 1, "expanded_examples": 1}, extra_tokens=60, extra_trained=15),
    row(parse={"rows": 1}),
    # source b: a row with 2 turns trained without 70 reasoning tokens; a system prompt the template leaves out;
    # a row refused for a role the template does not render (the expansion a dropped row had is not counted)
    row("1:b", parse={"rows": 1, "reasoning_dropped_rows": 1, "reasoning_dropped_turns": 2,
                      "reasoning_dropped_tokens": 70, "unrendered_messages": {"system": 1}}),
    row("1:b", reason="unrendered_role", detail=DETAIL,
        parse={"rows": 1, "unknown_roles": {"knowledge": 1}, "expanded_examples": 5}, extra_tokens=9),
]


def test_reasoning_section_per_source_and_overall():
    stats = compute_stats(columns(ROWS), max_length=1000)
    a, b, overall = stats["sources"]["0:a"], stats["sources"]["1:b"], stats["overall"]
    assert a["reasoning"] == {
        "reasoning_dropped_rows": 0, "reasoning_dropped_turns": 0, "reasoning_dropped_tokens": 0,
        "reasoning_expanded_turns": 4, "expanded_rows": 2, "expanded_examples": 4, "expanded_tokens": 300,
        "expanded_trained_tokens": 105, "examples_per_row": {"mean": 7 / 3, "max": 4}}
    assert b["reasoning"] == {
        "reasoning_dropped_rows": 1, "reasoning_dropped_turns": 2, "reasoning_dropped_tokens": 70,
        "reasoning_expanded_turns": 0, "expanded_rows": 0, "expanded_examples": 0, "expanded_tokens": 0,
        "expanded_trained_tokens": 0, "examples_per_row": {"mean": 1.0, "max": 1}}
    assert overall["reasoning"]["expanded_examples"] == 4 and overall["reasoning"]["reasoning_dropped_turns"] == 2
    assert overall["reasoning"]["examples_per_row"] == {"mean": 8 / 4, "max": 4}
    assert a["unrendered_messages"] == {} and b["unrendered_messages"] == overall["unrendered_messages"] == {
        "system": 1}
    # the length distributions stay one per row (the primary example), as before
    assert overall["tokens_after_truncation"]["rows"] == 4 and overall["trained_tokens"]["total"] == 80
    # parse keeps summing every row that parsed, the refused one included
    assert overall["parse"]["expanded_examples"] == 9


def test_no_kept_row_has_no_examples_per_row():
    stats = compute_stats(columns([row(reason="unrendered_role", detail=DETAIL)]), max_length=1000)
    assert stats["overall"]["reasoning"]["examples_per_row"] == {"mean": 0.0, "max": None}


def test_stats_lines_show_the_reasoning_section():
    lines = stats_lines(compute_stats(columns(ROWS), max_length=1000))
    overall = lines[:lines.index("== source 0:a")]
    assert ("reasoning history: 2 trained turns in 1 rows without their reasoning (70 tokens not rendered); "
            "expand: 4 extra examples from 2 rows (300 tokens, 105 trained); examples per row mean 2.00, max 4"
            ) in overall
    assert "messages the template does not render: system 1" in overall
    a = lines[lines.index("== source 0:a"):lines.index("== source 1:b")]
    assert "messages the template does not render: none" in a


def test_advice_on_reasoning_depends_on_reasoning_history():
    overall = compute_stats(columns(ROWS), max_length=1000)["overall"]
    head = ("2 trained turns in 1 rows are trained without their reasoning (70 tokens the chat template does not "
            "render)")
    drop = reasoning_advice(overall["reasoning"], DataConfig(reasoning_history="drop"))
    assert drop == (f"{head}: set data.reasoning_history: expand to train each such turn with its reasoning in an "
                    "extra example (the conversation up to that turn), or data.think_mode: drop to train without "
                    "reasoning on purpose")
    # under expand, below the cap: the template never renders this reasoning
    expand = reasoning_advice(overall["reasoning"], DataConfig())
    assert expand.startswith(f"{head} under reasoning_history: expand: the template does not render this reasoning "
                             "even in the last turn: pass model.chat_template_kwargs (e.g. {skip_think: false})")
    # a row reached the cap (3 extra examples, cap 3): raise it first
    capped = reasoning_advice(overall["reasoning"], DataConfig(reasoning_history_max_examples=3))
    assert "rows reach data.reasoning_history_max_examples=3 (at most 3 extra examples per row): raise it" in capped
    assert "if turns remain, the template does not render" in capped
    quiet = compute_stats(columns(ROWS[:3]), max_length=1000)["overall"]
    assert reasoning_advice(quiet["reasoning"], DataConfig()) is None


def test_advice_names_unrendered_roles_and_messages():
    overall = compute_stats(columns(ROWS), max_length=1000)["overall"]
    assert unrendered_role_advice(overall) == (
        "1 rows are dropped as unrendered_role: the chat template does not render role 'knowledge': map it to a "
        "role it renders with data.roles: {system: [knowledge]} or {user: [knowledge]}")
    assert unrendered_messages_advice(overall["unrendered_messages"]) == (
        "the chat template does not render 1 untrained messages (system 1): the model never sees their content; "
        "map the role to one the template renders (data.roles, e.g. {user: [system]}) or use a template that "
        "renders it")
    assert unrendered_messages_advice({}) is None
    # no role in the detail: the unknown role the parse counted instead, and the other unknown roles named
    other = dict(overall, first_dropped={"unrendered_role": "d:4: not rendered"},
                 parse={"unknown_roles": {"knowledge": 3, "context": 1}})
    assert unrendered_role_advice(other).startswith(
        "1 rows are dropped as unrendered_role: the chat template does not render role 'knowledge' (other unknown "
        "roles in the data: context 1): map it")


def test_advice_order_keeps_the_drop_summary_last():
    stats = compute_stats(columns(ROWS), max_length=200, data=DataConfig(reasoning_history="drop"))
    lines = stats["advice"]  # rows of 100 tokens: no length advice at max_length 200
    assert [line.split(" ", 3)[:3] for line in lines] == [
        ["2", "trained", "turns"], ["the", "chat", "template"], ["1", "rows", "are"], ["1", "of", "5"]]
    assert lines == advice(stats["overall"], max_length=200, data=DataConfig(reasoning_history="drop"))


# --- debug samples ---------------------------------------------------------------------------------------------------


def test_debug_samples_show_each_extra_example_after_its_row(qwen3_tok):
    import datasets

    from qlora_train.diagnostics import samples as S
    from qlora_train.diagnostics.html import debug_html, read_tokens

    def ids(text):
        return qwen3_tok(text, add_special_tokens=False)["input_ids"]

    full, prefix = ids("q1 a1 q2 r2 a2"), ids("q1 r1 a1")
    raw = datasets.Dataset.from_dict({"row": ["{}"], "location": ["d:1"], "source": ["0:d"]})
    processed = datasets.Dataset.from_dict({
        "input_ids": [full], "labels": [[-100] * 3 + full[3:]], "num_tokens_before": [len(full)],
        "dropped_turns": [0], "reasoning_trimmed_tokens": [0], "token_fallback": [""], "drop_reason": [""],
        "drop_detail": [""], "expanded_input_ids": [[prefix]], "expanded_labels": [[[-100] * 2 + prefix[2:]]]})
    primary, extra = S.load_samples(raw, processed, qwen3_tok, [0])
    assert (primary.name, primary.anchor, extra.name, extra.anchor) == ("d:1", "row-0", "d:1 extra 1/1",
                                                                        "row-0-extra-1")
    assert extra.input_ids == prefix and extra.num_trained == len(prefix) - 2
    text = S.format_sample(primary, color=False)
    assert f"trained {len(full) - 3}; truncation: none; 1 extra examples follow (reasoning_history: expand)" in text
    text = S.format_sample(extra, color=False)
    assert text.startswith("--- d:1 extra 1/1  (source 0:d)\n"
                           f"tokens {len(prefix)}; trained {len(prefix) - 2}; extra example 1 of 1")
    assert list(read_tokens(debug_html([primary, extra]))) == ["row-0", "row-0-extra-1"]
