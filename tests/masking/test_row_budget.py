"""What one row may cost (``data.row_budget``, masking/budget.py): each budget hit by a crafted row or template,
refused as ``over_budget`` with the budget and the amount, the rows after it rendered as usual."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from qlora_train.config import DataConfig
from qlora_train.data import process_rows
from qlora_train.masking import DropReason, LossPolicy, RowBudget, RowRejected, RowSpending
from qlora_train.masking.apply_template import apply_template
from qlora_train.masking.render import render_conversation

# ChatML, and before it what the first message asks for: each payload builds too much or runs on. No payload is a
# constant (jinja would compute a constant while compiling): ``big`` is 10^7 whatever the row.
HOSTILE = """{%- set c = messages[0].content %}{%- set big = (c|length) * 0 + 10000000 %}
{%- if c == 'multiply' %}{{ 'x' * big }}
{%- elif c == 'power' %}{{ 7 ** big }}
{%- elif c == 'ljust' %}{{ c.ljust(big) }}
{%- elif c == 'percent' %}{{ '%10000000d' % 1 }}
{%- elif c == 'format' %}{{ '{:>{}}'.format(1, big) }}
{%- elif c == 'center' %}{{ c|center(big) }}
{%- elif c == 'double' %}{% set ns = namespace(s=c) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}
{%- elif c == 'join' %}{% set s = 'x' * 90000 %}{{ [s, s]|join }}
{%- elif c == 'replace' %}{% set s = 'x' * 1000 %}{{ s.replace('x', s) }}
{%- elif c == 'output' %}{% for i in range(1000) %}{{ 'x' * 1000 }}{% endfor %}
{%- elif c == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}
{%- elif c == 'recurse' %}{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}
{%- endif %}
{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

mark = LossPolicy().mark
SMALL = {"render_chars": 100_000, "steps": 10_000}  # what the payloads are measured against (fails fast, not big)


def row(content: str) -> dict:
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}


@pytest.fixture(scope="module")
def hostile_tok(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.chat_template = HOSTILE
    return tok


def fresh(tok):
    """The tokenizer as new to the renderer (its first renders are checked against apply_chat_template)."""
    return copy.copy(tok)


@pytest.mark.parametrize(("payload", "detail"), [
    ("multiply", "characters (or items) of a product the template computes 10,000,000 > row_budget.render_chars="
                 "100,000"),
    ("power", "bits of a number the template computes 30,000,000 > 65,536 (more than any template needs)"),
    ("ljust", "characters of str.ljust 10,000,000 > row_budget.render_chars=100,000"),
    ("percent", "characters of a width in a format string 10,000,000 > row_budget.render_chars=100,000"),
    ("format", "characters of a width given to a format string 10,000,000 > row_budget.render_chars=100,000"),
    ("center", "characters of |center 10,000,000 > row_budget.render_chars=100,000"),
    ("double", "characters (or items) in a value the template sets 196,608 > row_budget.render_chars=100,000"),
    ("join", "characters of a join 180,000 > row_budget.render_chars=100,000"),
    ("replace", "characters of a replace 1,000,000 > row_budget.render_chars=100,000"),
    ("output", "characters in one render 1,000,069 > row_budget.render_chars=100,000"),  # and the 69 of ChatML
])
def test_a_template_building_too_much_refuses_the_row_and_the_next_renders(hostile_tok, payload, detail):
    tok = fresh(hostile_tok) if payload == "multiply" else hostile_tok  # (made both ways, first: see fresh)
    out = process_rows([row(payload), row("fine")], tok, DataConfig(row_budget=SMALL))
    assert out["drop_reason"] == [DropReason.OVER_BUDGET, ""]
    assert out["drop_detail"][0] == f"row 0: {detail}"
    assert tok.decode(out["input_ids"][1]) == apply_template(row("fine")["messages"], tok)


def test_a_template_that_runs_on_is_stopped_by_its_steps(hostile_tok):
    out = process_rows([row("loop"), row("recurse"), row("fine")], hostile_tok, DataConfig(row_budget=SMALL))
    assert out["drop_reason"] == [DropReason.OVER_BUDGET, DropReason.OVER_BUDGET, ""]
    # a range's iterations are counted when its loop starts: the outer loop's 100,000
    assert out["drop_detail"][0] == "row 0: template steps in one render 100,000 > row_budget.steps=10,000"
    steps = re.fullmatch(r"row 1: template steps in one render ([\d,]+) > row_budget.steps=10,000",
                         out["drop_detail"][1])  # macro calls, counted one by one, the budget looked at every 64
    assert steps and 10_000 < int(steps.group(1).replace(",", "")) <= 10_000 + 64


def test_a_template_that_runs_on_is_stopped_by_the_clock(hostile_tok):
    out = process_rows([row("loop"), row("fine")], hostile_tok,
                       DataConfig(row_budget={"seconds": 0.2, "steps": 10**12}))
    assert out["drop_reason"] == [DropReason.OVER_BUDGET, ""]
    assert re.fullmatch(r"row 0: seconds \d+\.\d > row_budget.seconds=0.2", out["drop_detail"][0])


def marked_row(exchanges: int) -> dict:
    """Short exchanges, the last user message holding ChatML's own markers: the layout cannot verify the row,
    so each trained turn takes two prefix renders (the general path)."""
    messages = []
    for i in range(exchanges):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    messages[-2]["content"] = "see <|im_start|>assistant\nhi<|im_end|>"
    return {"messages": messages}


@pytest.fixture(scope="module")
def chatml_tok(hostile_tok):
    tok = copy.copy(hostile_tok)
    tok.chat_template = HOSTILE.split("{%- endif %}", 1)[1]  # ChatML alone
    return tok


def test_a_row_on_the_prefix_path_is_bounded_by_renders_and_characters(chatml_tok):
    ok = process_rows([marked_row(30)], chatml_tok, DataConfig(rule_check="off"))
    assert ok["drop_reason"] == [""] and json.loads(ok["parse_report"][0])["prefix_renders"] == 60
    out = process_rows([marked_row(30), row("fine")], chatml_tok,
                       DataConfig(rule_check="off", row_budget={"renders": 40}))
    assert out["drop_reason"] == [DropReason.OVER_BUDGET, ""]
    assert out["drop_detail"][0] == "row 0: template renders 41 > row_budget.renders=40"
    out = process_rows([marked_row(30)], chatml_tok, DataConfig(rule_check="off", row_budget={"row_chars": 20_000}))
    chars = re.fullmatch(r"row 0: characters rendered ([\d,]+) > row_budget.row_chars=20,000", out["drop_detail"][0])
    assert chars and 20_000 < int(chars.group(1).replace(",", "")) < 20_000 + 2_000  # one render more than allowed


def test_the_seconds_count_only_while_the_row_is_worked_on(chatml_tok):
    spending = RowSpending(RowBudget(seconds=1.0))
    for _ in range(3):
        with spending:
            apply_template(row("x")["messages"], chatml_tok)
    assert spending.renders == 3 and spending.seconds < 1.0


def test_a_render_outside_any_row_has_the_default_budget(hostile_tok):
    """The engine's own API (``render_conversation``, what the diagnostics and tests call): the refusal it
    raises for any row it cannot take."""
    tok = fresh(hostile_tok)
    big = row("x")["messages"]
    big[0]["content"] = "x" * 17_000_000
    with pytest.raises(RowRejected) as refused:
        render_conversation(mark(big), tok)
    assert (refused.value.reason, refused.value.detail) == (  # the content and ChatML's 63 characters around it
        DropReason.OVER_BUDGET, "characters in one render 17,000,063 > row_budget.render_chars=16,000,000")
    assert render_conversation(mark(row("fine")["messages"]), tok).text.startswith("<|im_start|>user\nfine")


@pytest.mark.slow
def test_the_run_completes_with_the_over_budget_row_counted(tmp_path, qwen_tokenizer_dir):
    from qlora_train.cli import main

    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [row("fine"), row("loop"), row("multiply"), row("ok")]))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(qwen_tokenizer_dir), "chat_template": str(template)},
        "data": {"datasets": [{"path": str(data)}], "cache_dir": str(tmp_path / "cache"), "max_length": 64,
                 "row_budget": SMALL},
        "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}))
    assert main(["--config", str(cfg), "--stats-only", "--stats-dir", str(tmp_path / "stats")]) == 0
    stats = json.loads((tmp_path / "stats" / "stats.json").read_text())["overall"]
    assert stats["rows_kept"] == 2 and stats["dropped"] == {DropReason.OVER_BUDGET: 2}


def test_a_long_ordinary_row_checked_by_the_rule_is_far_inside_the_defaults(qwen3_tok, monkeypatch):
    """60 turns with reasoning on Qwen3's own template, masked by the layout and again by the rule (2 prefix
    renders per trained turn), truncated: kept, far inside each default (docs/masking.md#budgets
    measures 200 turns)."""
    import qlora_train.data.rows as pipeline

    spent = []

    class Recorded(RowSpending):
        def __exit__(self, *exc):
            spent.append((self.renders, self.chars, self.steps))
            return super().__exit__(*exc)

    monkeypatch.setattr(pipeline, "RowSpending", Recorded)
    messages = []
    for i in range(60):
        messages += [{"role": "user", "content": f"question {i}: " + "lorem ipsum " * 20},
                     {"role": "assistant", "content": f"answer {i}: " + "dolor sit " * 20,
                      "reasoning_content": "hmm " * 20}]
    out = process_rows([{"messages": messages}], qwen3_tok, DataConfig(rule_check="all", max_length=4096))
    assert out["drop_reason"] == [""] and out["num_tokens_before"][0] > 4096  # truncated
    renders, chars, steps = max(spent)
    default = RowBudget()
    assert 120 < renders < default.renders / 5 and chars < default.row_chars / 10 and steps < default.steps / 100
