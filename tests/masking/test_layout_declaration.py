"""``model.template_layout``: the resolved layout printed as YAML, pasted back as a declaration, gives the same
masks; a wrong declaration refuses rows with the reason and trains nothing; a declaration travels with the
tokenizer (baked into its template as a comment that renders nothing)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qlora_train.chat_templates import (
    get_chat_template,
    split_template_kwargs,
    split_template_layout,
    with_template_kwargs,
    with_template_layout,
)
from qlora_train.config import ConfigError, ModelConfig
from qlora_train.data import DataConfig, process_rows
from qlora_train.masking import layout_declaration as declaration_module
from qlora_train.masking.layout import TemplateLayout
from qlora_train.masking.layout_declaration import (
    ResolvedLayout,
    check_declaration,
    declarable_parts,
    layout_dict,
    layout_yaml,
    required_parts,
    resolve_layout,
    template_layout,
)
from qlora_train.tokenizer import load_tokenizer
from tests.masking.families import FAMILIES, family_tokenizer
from tests.masking.test_family_masks import NO_VERIFIABLE_TOOL_CALLS, TOOLS, conversations

# declared layouts round-tripped on every family template: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
QUICKSTART_ROWS = [json.loads(line) for line in (REPO / "configs/data/quickstart.jsonl").read_text().splitlines()]


def declared_copy(tok, declaration: dict):
    """A copy of ``tok`` with ``declaration`` (as a config gives it) checked and baked into its template (a
    shallow copy: only the template, an attribute of its own, is set; a deep one takes a second)."""
    return get_chat_template(copy.copy(tok), None, None, check_declaration(declaration))


def pasted(tok) -> dict:
    """What a user pastes: the YAML ``--stats-only`` prints for ``tok``, read back as a config would be."""
    return yaml.safe_load(layout_yaml(resolve_layout(tok)))["model"]["template_layout"]


def masks(tok, rows: list[dict]) -> dict:
    out = process_rows(rows, tok, DataConfig(max_length=8192))
    return {k: out[k] for k in ("input_ids", "labels", "drop_reason", "drop_detail")}


# --- the block printed -----------------------------------------------------------------------------------------


def test_the_printed_block_names_every_part_and_where_it_came_from(qwen3_tok):
    text = layout_yaml(resolve_layout(qwen3_tok))
    block = yaml.safe_load(text)["model"]["template_layout"]
    descriptions = ["layout_class", "unknown", "declared"]  # about the layout, in the head: not declared
    assert list(block) == list(declarable_parts()) == [f.name for f in dataclasses.fields(TemplateLayout)
                                                       if f.name not in descriptions]
    assert text.startswith("# the chat template's layout") and "\n# class: header_from_generation_prompt\n" in text
    assert check_declaration(block) == {p: getattr(template_layout(qwen3_tok), p) for p in block}
    assert '    end_markers: ["<|im_end|>"]' in text and text.count("# probed") == len(block)
    tok = declared_copy(qwen3_tok, {"end_markers": ["<|im_end|>", "<|endoftext|>"], "answer_open": ""})
    lines = layout_yaml(resolve_layout(tok)).splitlines()
    assert any(line.startswith('    end_markers: ["<|im_end|>", "<|endoftext|>"]') and
               line.endswith('# declared; the probe found ["<|im_end|>"]') for line in lines)
    assert any(line.startswith('    answer_open: ""') and line.endswith("# declared") for line in lines)
    assert sum(line.endswith("# probed") for line in lines) == len(block) - 2


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_marker_text_reads_back_from_the_yaml(text):
    layout = TemplateLayout(assistant_header=text, turn_openers=(text, "x"), end_markers=())
    block = yaml.safe_load(layout_yaml(ResolvedLayout(layout, {}, layout)))["model"]["template_layout"]
    assert check_declaration(block) == {p: getattr(layout, p) for p in declarable_parts()}


# --- print -> paste -> the same masks ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5", "qwen2.5", "chatml", "llama3", "gemma"])
def test_round_trip_on_the_shipped_templates_with_the_quickstart_rows(family_tokenizers, name):
    plain = family_tokenizers[name]
    tok = declared_copy(plain, pasted(plain))
    assert template_layout(tok) == template_layout(plain)
    assert set(resolve_layout(tok).declared) == set(declarable_parts())  # every part declared now
    expected = masks(plain, QUICKSTART_ROWS)
    assert expected["drop_reason"].count("") >= 30  # the rows train: a real comparison
    assert masks(tok, QUICKSTART_ROWS) == expected


def test_a_full_declaration_stands_in_for_a_probe_that_fails(qwen3_tok, monkeypatch):
    tok = declared_copy(qwen3_tok, pasted(qwen3_tok))
    expected, probed = masks(qwen3_tok, QUICKSTART_ROWS), template_layout(qwen3_tok)

    def failing(tokenizer):
        raise ValueError("chat template: nothing marks where an assistant answer starts")

    monkeypatch.setattr(declaration_module, "_LAYOUTS", {})
    monkeypatch.setattr(declaration_module, "probe_layout", failing)
    resolved = resolve_layout(tok, failing)
    assert resolved.probed is None and resolved.layout == probed
    assert "# the probe failed (ValueError: chat template: nothing marks" in layout_yaml(resolved)
    assert masks(tok, QUICKSTART_ROWS) == expected
    with pytest.raises(ValueError, match="nothing marks"):  # nothing declared: the probe's error stands
        resolve_layout(qwen3_tok, failing)


@pytest.mark.parametrize("part", required_parts() or [None])
def test_a_declaration_missing_a_required_part_where_the_probe_fails_says_so(qwen3_tok, part):
    if part is None:
        pytest.skip("every part of a layout has a default")
    block = {k: v for k, v in pasted(qwen3_tok).items() if k != part}

    def failing(tokenizer):
        raise ValueError("no probe today")

    with pytest.raises(ConfigError) as err:
        resolve_layout(declared_copy(qwen3_tok, block), failing)
    assert err.value.problems[0].startswith("model.template_layout: the probe could not read the chat template "
                                            "(ValueError: no probe today); declare ")
    assert part in err.value.problems[0]


def test_a_template_the_probe_cannot_read_trains_with_a_declared_layout(qwen3_tok):
    """Plain text lines, nothing between the question and the answer but a newline: the probe finds no
    opener; declared, the answer is what the model writes after the prompt 'question\\n' (the rule)."""
    tok = copy.copy(qwen3_tok)
    tok.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    rows = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                          {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}]
    try:
        template_layout(tok)
        probed = True
    except ValueError:
        probed = False
    declared = declared_copy(tok, {"assistant_header": "", "turn_openers": ["\n"], "end_markers": ["\n"]})
    out = masks(declared, rows)
    assert out["drop_reason"] == [""], out["drop_detail"]
    trained = [i for i, lab in zip(out["input_ids"][0], out["labels"][0]) if lab != -100]
    assert declared.decode(trained) == "4\n6\n"
    assert probed or resolve_layout(declared).probe_error.startswith("ValueError: chat template: nothing marks")


FAMILY_PROPS = settings(max_examples=4, deadline=None, derandomize=True, database=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# a family of each layout class, and one for each part that most templates leave at its default: two openers
# (mistral-v3), leads (command-r7b-tools), reasoning delimiters, an answer marker and three end markers (gpt-oss),
# tool arguments as a string (deepseek-r1), an unmarked last turn (glm4.5)
ROUND_TRIP_FAMILIES = ["phi3", "mistral-v3", "command-r7b-tools", "gpt-oss", "deepseek-r1", "glm4.5"]


@pytest.mark.parametrize("name", ROUND_TRIP_FAMILIES)
def test_round_trip_on_family_templates(qwen_tokenizer_dir, name):
    """Printed, pasted, baked: random conversations (reasoning, tool calls, several turns) get identical rows."""
    fam = FAMILIES[name]
    tok = family_tokenizer(qwen_tokenizer_dir, name)
    declared = declared_copy(tok, pasted(tok))
    assert template_layout(declared) == template_layout(tok)
    tools = fam.supports_tools and name not in NO_VERIFIABLE_TOOL_CALLS

    @FAMILY_PROPS
    @given(st.lists(conversations(fam, reasoning=True, tools=tools), min_size=6, max_size=6))
    def check(convos):
        rows = [{"messages": m, **({"tools": TOOLS} if tools else {})} for m in convos]
        assert masks(declared, rows) == masks(tok, rows)

    check()


# --- a wrong declaration: refused row by row, with the reason ---------------------------------------------------


@pytest.mark.parametrize(("declaration", "why"), [
    ({"end_markers": ["<|wrong|>"]}, "end-of-turn marker ['<|wrong|>'] not found"),
    ({"assistant_header": "<|im_start|>bot\n", "turn_openers": ["<|im_start|>bot\n"]},
     "no assistant turn opener ['<|im_start|>bot\\n'] after char"),
    ({"think_open": "<reason>", "think_close": "</reason>"}, "content does not follow the turn opener"),
])
def test_a_wrong_declaration_refuses_every_row_it_does_not_fit(qwen3_tok, declaration, why):
    out = masks(declared_copy(qwen3_tok, declaration), QUICKSTART_ROWS)
    right = masks(qwen3_tok, QUICKSTART_ROWS)
    kept = [i for i, reason in enumerate(out["drop_reason"]) if not reason]
    for i, reason in enumerate(out["drop_reason"]):
        if reason and not right["drop_reason"][i]:
            assert reason == "mask_unverified" and why in out["drop_detail"][i], out["drop_detail"][i]
    assert all(out["labels"][i] == right["labels"][i] for i in kept)  # what still verifies trains the same
    assert len(kept) < right["drop_reason"].count("") // 4


def test_a_declaration_that_only_some_rows_contradict(qwen3_tok):
    # an end marker list without the tool-call closer a template would need is not wrong for Qwen3, whose
    # calls end with <|im_end|> too; declaring '\n' first closes turns at their first newline: refused where
    # a turn's text has one (the reasoning rows), kept with the right labels elsewhere
    out = masks(declared_copy(qwen3_tok, {"end_markers": ["\n", "<|im_end|>"]}), QUICKSTART_ROWS)
    right = masks(qwen3_tok, QUICKSTART_ROWS)
    kept = [i for i, reason in enumerate(out["drop_reason"]) if not reason]
    refused = [i for i, reason in enumerate(out["drop_reason"]) if reason and not right["drop_reason"][i]]
    assert kept and refused
    assert all(out["labels"][i] == right["labels"][i] for i in kept)
    assert all(out["drop_reason"][i] == "mask_unverified" for i in refused)


# --- checking a declaration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("declaration", "problem"), [
    ({"end_marker": ["<|im_end|>"]}, "model.template_layout.end_marker: unknown key (did you mean 'end_markers'?)"),
    ({"end_markers": "<|im_end|>"}, 'model.template_layout.end_markers: expected a list of strings, got "<|im_end|>"'),
    ({"end_markers": ["<|im_end|>", 3]}, "model.template_layout.end_markers: expected a list of strings, got "
                                         '["<|im_end|>", 3]'),
    ({"reasoning_key": 1}, "model.template_layout.reasoning_key: expected a string or null, got 1"),
    ({"last_turn_unmarked": "yes"}, 'model.template_layout.last_turn_unmarked: expected true or false, got "yes"'),
    ({"zzz": 1}, "model.template_layout.zzz: unknown key (the parts: assistant_header, "),
])
def test_a_declaration_is_checked_naming_the_key(declaration, problem):
    with pytest.raises(ConfigError) as err:
        check_declaration(declaration)
    assert err.value.problems[0].startswith(problem), err.value.problems


def test_every_probed_part_passes_the_check_as_printed(family_tokenizers):
    for tok in family_tokenizers.values():
        layout = template_layout(tok)
        assert TemplateLayout(**check_declaration(layout_dict(layout))) == layout


def test_load_tokenizer_checks_the_declaration_first(qwen_tokenizer_dir):
    cfg = ModelConfig(name_or_path="/nowhere", template_layout={"end_markerz": []})
    with pytest.raises(ConfigError, match=r"model.template_layout.end_markerz: unknown key \(did you mean"):
        load_tokenizer(cfg)  # before the missing tokenizer: the config's own mistake first
    tok = load_tokenizer(ModelConfig(name_or_path=str(qwen_tokenizer_dir), chat_template="qwen3",
                                     template_layout={"end_markers": ["<|im_end|>", "<|endoftext|>"]}))
    assert template_layout(tok).end_markers == ("<|im_end|>", "<|endoftext|>")


# --- the declaration travels with the tokenizer ---------------------------------------------------------------


def test_the_declaration_is_a_comment_that_renders_nothing(family_tokenizers):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]
    for name, plain in family_tokenizers.items():
        tok = get_chat_template(copy.copy(plain), None, {"flag": True}, {"end_markers": ["#}{{ x }}"]})
        for gen in (False, True):
            assert (tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                    == plain.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)), name
        assert split_template_layout(tok.chat_template)[0] == {"end_markers": ["#}{{ x }}"]}
        kwargs = {**split_template_kwargs(plain.chat_template)[0], "flag": True}
        assert split_template_kwargs(tok.chat_template)[0] == kwargs  # the kwargs prelude stays first
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)  # as every chat template render
    for body in ("\n\nfirst {{ messages | length }}\n", "  x", "{%- if 1 %}y{% endif %}"):
        baked = with_template_layout(body, {"answer_open": ""})
        assert env.from_string(baked).render(messages=[]) == env.from_string(body).render(messages=[])


def test_baking_again_or_after_a_save_does_not_stack(qwen3_tok, tmp_path):
    from transformers import AutoTokenizer

    tok = declared_copy(qwen3_tok, {"end_markers": ["<|im_end|>"]})
    once = tok.chat_template
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == once and template_layout(loaded).end_markers == ("<|im_end|>",)
    assert get_chat_template(loaded, None, None, {"end_markers": ["<|im_end|>"]}).chat_template == once
    both = get_chat_template(loaded, None, {"enable_thinking": False}, {"answer_open": ""}).chat_template
    assert both.count("qlora-train template_layout") == 1
    assert split_template_layout(both)[0] == {"end_markers": ["<|im_end|>"], "answer_open": ""}
    assert split_template_layout(both)[1] == with_template_kwargs(split_template_layout(once)[1],
                                                                  {"enable_thinking": False})
    assert split_template_layout(qwen3_tok.chat_template) == ({}, qwen3_tok.chat_template)


def test_the_block_in_the_docs_is_what_qwen3_prints(qwen3_tok):
    doc = (REPO / "docs/masking.md").read_text().split("### Seeing and declaring the layout", 1)[1]
    shown = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert shown == layout_yaml(resolve_layout(qwen3_tok))
