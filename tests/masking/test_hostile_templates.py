"""Hostile chat templates: an exception of the template's own code, whatever its type, is that template's refusal
of the row (``template_error``, counted, the run goes on) or, at probe time, a layout fact left unknown; an
exception of our code stays loud. The sandbox's decided-once reads keep no name made of row data."""

from __future__ import annotations

import copy
import json
import pickle
import re

import pytest
import yaml
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qlora_train.config import DataConfig
from qlora_train.data import process_rows
from qlora_train.masking import TemplateRaised, call_template
from qlora_train.masking import apply_template as at

CHATML = ("<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HOSTILE = {  # each raises on some rows only (or on the probe's only), a type jinja does not raise itself
    "zero_division": "{% for m in messages %}{% if m.content == 'boom' %}{{ 1 / 0 }}{% endif %}" + CHATML,
    "endless_macro": "{% macro deeper(x) %}{{ deeper(x) }}{% endmacro %}"
                     "{% for m in messages %}{% if m.content == 'boom' %}{{ deeper(1) }}{% endif %}" + CHATML,
    "with_tools": "{% if tools %}{{ 'abc'.index(tools[0].type) }}{% endif %}{% for m in messages %}" + CHATML,
    "probe_only": "{% macro deeper(x) %}{{ deeper(x) }}{% endmacro %}"
                  "{% for m in messages %}{% if 'probe' in m.content %}{{ deeper(1) }}{% endif %}" + CHATML,
}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def row(question: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "a"}], **extra}


# 1 row in 7 raises (more than the 1% of unexpected exceptions that stops a run as our bug); the rows after it render
ROWS = [row("boom" if i % 7 == 3 else f"q{i}", **({"tools": TOOLS} if i % 7 == 5 else {})) for i in range(14)]
REFUSED = {  # template -> (rows refused, the first one's detail)
    "zero_division": ([3, 10], "row 3: TemplateRaised: ZeroDivisionError: division by zero (line 1 of the template)"),
    "endless_macro": ([3, 10], "row 3: TemplateRaised: RecursionError: maximum recursion depth exceeded"),
    "with_tools": ([5, 12], "row 5: TemplateRaised: ValueError: substring not found (line 1 of the template)"),
    "probe_only": ([], ""),
}


def with_template(tok, template: str):
    """A copy of ``tok`` (the session's, loaded once) with another chat template."""
    tok = copy.copy(tok)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def hostile_tokenizers(qwen3_tok):
    return {name: with_template(qwen3_tok, template) for name, template in HOSTILE.items()}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_templates_own_exception_refuses_only_its_rows(hostile_tokenizers, name):
    """Rendered twice over: in the first renders of a template (checked against ``apply_chat_template``) and
    after them (the direct render); each raising row is a ``template_error`` with the template's exception named,
    and every other row, those after a recursion included, is kept."""
    tok = hostile_tokenizers[name]
    refused, detail = REFUSED[name]
    for _ in range(2):
        out = process_rows(ROWS, tok, DataConfig(max_length=64))
        assert [i for i, r in enumerate(out["drop_reason"]) if r] == refused
        assert {out["drop_reason"][i] for i in refused} <= {"template_error"}
        assert all(out["input_ids"][i] for i in range(len(ROWS)) if i not in refused)
        if refused:
            assert out["drop_detail"][refused[0]].startswith(detail), out["drop_detail"][refused[0]]


def test_an_exception_at_probe_time_is_an_unknown_layout_fact(hostile_tokenizers):
    from qlora_train.masking import probe_layout

    layout = probe_layout(hostile_tokenizers["probe_only"])
    assert layout.layout_class == "unknown"
    assert layout.unknown == ("assistant_header", "turn_openers", "end_markers")


def test_a_recursion_in_the_template_leaves_the_next_render_as_it_was(hostile_tokenizers):
    tok = hostile_tokenizers["endless_macro"]
    want = tok.apply_chat_template(ROWS[0]["messages"], tokenize=False)
    for _ in range(at.CHECKED_RENDERS + 2):  # the checked renders, then the direct ones
        with pytest.raises(TemplateRaised, match="^RecursionError: maximum recursion depth exceeded"):
            at.apply_template(ROWS[3]["messages"], tok)
        assert at.apply_template(ROWS[0]["messages"], tok) == want


def _raise(kind):
    raise kind("from a global")


@pytest.mark.parametrize("kind", [MemoryError, ZeroDivisionError, KeyError])
def test_call_template_wraps_what_the_templates_code_raises_whatever_its_type(kind):
    env = ImmutableSandboxedEnvironment()
    template = env.from_string("line one\n{{ boom(kind) }}", globals={"boom": _raise, "kind": kind})
    with pytest.raises(TemplateRaised) as err:
        call_template(template.render)
    assert str(err.value) == f"{kind.__name__}: {kind('from a global')} (line 2 of the template)"
    assert err.value.kind == kind.__name__ and err.value.line == 2
    assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)


def test_a_long_message_is_cut():
    raised = TemplateRaised("KeyError", "x" * 1000, 3)
    assert str(raised) == f"KeyError: {'x' * TemplateRaised.DETAIL_MAX}... (1000 characters) (line 3 of the template)"


def test_call_template_leaves_what_no_template_raised_loud(hostile_tokenizers):
    """Our code (or transformers' checks) raising around a render is not the template's: raised as it was."""
    with pytest.raises(ZeroDivisionError):
        call_template(lambda: 1 / 0)
    with pytest.raises(ValueError, match="empty conversation"):  # transformers' own check, before the template
        call_template(hostile_tokenizers["zero_division"].apply_chat_template, [], tokenize=False)


def _stats_config(tmp_path, tokenizer_dir, template: str, rows: list[dict]):
    (tmp_path / "t.jinja").write_text(template)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tokenizer_dir), "chat_template": str(tmp_path / "t.jinja")},
        "data": {"datasets": [{"path": str(data)}], "cache_dir": str(tmp_path / "cache"), "max_length": 64},
        "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}))
    return cfg


@pytest.mark.parametrize("name", ["zero_division", pytest.param("endless_macro", marks=pytest.mark.slow),
                                  pytest.param("probe_only", marks=pytest.mark.slow)])
def test_stats_only_counts_the_templates_refusals_and_exits_0(tmp_path, qwen_tokenizer_dir, name, capsys):
    """The issue's cases through the CLI: ZeroDivisionError on one row in 7 (was: internal error, exit 70), a macro
    that recurses without end on the same rows and one on the probe's conversations only (was: a RecursionError
    traceback from the layout probe)."""
    from qlora_train.cli import main

    cfg = _stats_config(tmp_path, qwen_tokenizer_dir, HOSTILE[name], ROWS)
    assert main(["--config", str(cfg), "--stats-only", "--stats-dir", str(tmp_path / "stats")]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    stats = json.loads((tmp_path / "stats" / "stats.json").read_text())["overall"]
    refused = len(REFUSED[name][0])
    assert stats["dropped"] == ({"template_error": refused} if refused else {}), stats["dropped"]
    assert stats["rows_in"] == len(ROWS) and stats["rows_kept"] == len(ROWS) - refused


# --- the decided-once cache: names a template spells, never the data's ---

FORMATTING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
              "{{ ('{0.' ~ m.content ~ '}').format(m) }}{{ m | attr(m.content) }}<|im_end|>\n{% endfor %}")


def test_names_made_of_row_data_are_decided_not_kept(qwen3_tok):
    """A template that reads an attribute named by each row's content (``str.format``, ``attr``): 300 distinct
    names leave the cache as one row left it, and render what ``apply_chat_template`` renders."""
    tok = with_template(qwen3_tok, FORMATTING)
    for i in range(at.CHECKED_RENDERS + 1):  # past the checked renders: the direct render alone
        at.apply_template([{"role": "user", "content": f"warmup{i}"}], tok)
    kept = dict(at._DECIDED)
    assert kept[dict, "content"] == at._ITEM and kept[dict, "role"] == at._ITEM  # spelled: kept
    for i in range(300):
        messages = [{"role": "user", "content": f"name{i}_" + "x" * 1000}]
        assert at.apply_template(messages, tok) == tok.apply_chat_template(messages, tokenize=False)
    assert at._DECIDED == kept
    assert not [name for _, name in at._DECIDED if not isinstance(name, str) or "warmup" in name
                or re.fullmatch(r"name\d+_x+", name)]  # ``name`` itself a template may spell (``tool.name``)


def test_the_cache_stops_at_its_size(monkeypatch):
    """Past ``DECIDED_MAX`` entries a read is decided on each read, with the same outcome."""
    env = at._compile("{{ {'a': 1}.brand_new_name }}{{ 'x'.upper() }}").environment
    monkeypatch.setattr(at, "_DECIDED", {})
    monkeypatch.setattr(at, "DECIDED_MAX", 1)
    template = env.from_string("{{ {'a': 1}.brand_new_name }}|{{ {'brand_new_key': 2}.brand_new_key }}")
    assert template.render() == "|2" and template.render() == "|2"
    assert list(at._DECIDED) == [(dict, "brand_new_name")]
