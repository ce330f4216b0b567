"""Layout discovery and the walk on small templates of each layout class, checked by hand."""

from __future__ import annotations

import json

import pytest

from qlora_train.data import DataConfig, process_rows
from qlora_train.masking.layout import pieces, probe_layout
from qlora_train.masking.policy import LossPolicy
from qlora_train.masking.render import render_conversation

mark = LossPolicy().mark  # messages written by hand get their train flags as the parse stage gives them

# header written at the end of the user turn; the generation prompt appends nothing; system ignored (Phi-3)
IN_USER_TURN = ("{% for m in messages %}{% if m.role == 'user' %}{{ '<|user|>\\n' + m.content + '<|end|>\\n"
                "<|assistant|>\\n' }}{% elif m.role == 'assistant' %}{{ m.content + '<|end|>\\n' }}{% endif %}"
                "{% endfor %}")
# no header: the answer follows [/INST] and ends with the eos token (Mistral v1 / Llama 2 without system)
NO_HEADER = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}"
             "{% elif m.role == 'assistant' %}{{ ' ' + m.content + eos_token }}{% endif %}{% endfor %}")
# two end markers (a response end, then the end of turn) and an answer marker written with or without
# reasoning, like Command A; tool results JSON-encoded; unknown roles rendered as user turns
TWO_MARKERS = (
    "{% for m in messages %}<|T|>{% if m.role == 'assistant' %}<|BOT|>{% if m.reasoning_content %}<|THINK|>"
    "{{ m.reasoning_content }}<|/THINK|>{% endif %}<|RESP|>{{ m.content }}<|/RESP|>"
    "{% elif m.role == 'tool' %}<|TOOL|>{{ m.content | tojson }}{% else %}<|USER|>{{ m.content }}{% endif %}"
    "<|/T|>{% endfor %}{% if add_generation_prompt %}<|T|><|BOT|>{% endif %}")
SPECIALS = ["<|user|>", "<|assistant|>", "<|end|>", "[INST]", "[/INST]", "<s>", "</s>", "<|T|>", "<|/T|>",
            "<|BOT|>", "<|THINK|>", "<|/THINK|>", "<|RESP|>", "<|/RESP|>", "<|TOOL|>", "<|USER|>"]


@pytest.fixture(scope="module")
def make_tok(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    def make(template):
        tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
        tok.add_special_tokens({"additional_special_tokens": SPECIALS, "bos_token": "<s>", "eos_token": "</s>"})
        tok.chat_template = template
        return tok
    return make


def trained(r) -> str:
    return "".join(c for c, m in zip(r.text, r.char_mask) if m)


CONVO = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
         {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
         {"role": "assistant", "content": "A2"}]


def test_pieces():
    assert pieces("<|end|>\n<|user|>hi there", ["<|end|>", "<|user|>"]) == [
        "<|end|>", "\n", "<|user|>", "hi", " ", "there"]


def test_header_in_the_user_turn(make_tok):
    tok = make_tok(IN_USER_TURN)
    layout = probe_layout(tok)
    assert (layout.assistant_header, layout.turn_openers, layout.end_markers) == (
        "", ("<|end|>\n<|assistant|>\n",), ("<|end|>",))
    r = render_conversation(mark(CONVO), tok)
    assert r.text == "<|user|>\nQ1<|end|>\n<|assistant|>\nA1<|end|>\n<|user|>\nQ2<|end|>\n<|assistant|>\nA2<|end|>\n"
    assert trained(r) == "A1<|end|>A2<|end|>"  # the header the user turn writes is never trained
    assert r.unrendered == ("system",)  # the template drops the system prompt: counted, not refused


def test_no_header(make_tok):
    tok = make_tok(NO_HEADER)
    layout = probe_layout(tok)
    assert (layout.assistant_header, layout.turn_openers, layout.end_markers) == ("", ("[/INST]",), ("</s>",))
    r = render_conversation(mark(CONVO[1:]), tok)
    assert r.text == "<s>[INST] Q1 [/INST] A1</s>[INST] Q2 [/INST] A2</s>"
    # the model writes " A1</s>" after the prompt "... [/INST]": the space is its first character
    assert trained(r) == " A1</s> A2</s>"


def test_user_text_holding_the_opener_is_verified_by_prefix_renders(make_tok):
    # the layout cannot tell the user's '[/INST]' from the template's; the rule applied with prefix renders can
    tok = make_tok(NO_HEADER)
    msgs = [{"role": "user", "content": "say [/INST] x"}, {"role": "assistant", "content": "x"}]
    r = render_conversation(mark(msgs), tok)
    assert r.text == "<s>[INST] say [/INST] x [/INST] x</s>"
    assert (r.verified_by, trained(r)) == ("prefix_renders", " x</s>")


def test_two_end_markers_and_an_answer_marker(make_tok):
    tok = make_tok(TWO_MARKERS)
    layout = probe_layout(tok)
    assert layout.assistant_header == "<|T|><|BOT|>"
    assert layout.end_markers == ("<|/RESP|><|/T|>",)  # everything the model emits to stop
    assert (layout.think_open, layout.think_close, layout.answer_open) == ("<|THINK|>", "<|/THINK|>", "<|RESP|>")
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "B"}]
    r = render_conversation(mark(msgs), tok)
    assert trained(r) == "<|THINK|>R<|/THINK|><|RESP|>A<|/RESP|><|/T|><|RESP|>B<|/RESP|><|/T|>"
    r = render_conversation(mark(msgs), tok, policy=LossPolicy(think_loss="answer_only"))
    assert trained(r) == "<|RESP|>A<|/RESP|><|/T|><|RESP|>B<|/RESP|><|/T|>"


def test_transformed_tool_results_are_not_a_reason_to_refuse(make_tok):
    tok = make_tok(TWO_MARKERS)
    result = 'line "one"\nline two'  # rendered JSON-encoded: quotes and newline escaped
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "calling"},
            {"role": "tool", "content": result}, {"role": "assistant", "content": "done"}]
    r = render_conversation(mark(msgs), tok)
    assert json.dumps(result) in r.text and result not in r.text
    assert trained(r) == "<|RESP|>calling<|/RESP|><|/T|><|RESP|>done<|/RESP|><|/T|>"
    assert r.message_ends[2] == r.text.index(json.dumps(result)[1:-1]) + len(json.dumps(result)[1:-1])


def test_unknown_role_the_template_does_not_render_names_the_fix(make_tok):
    tok = make_tok(IN_USER_TURN)
    row = {"messages": [{"role": "knowledge", "content": "K"}, *CONVO[1:]]}
    out = process_rows([row], tok, DataConfig())
    assert out["drop_reason"] == ["unrendered_role"]
    assert "role 'knowledge'" in out["drop_detail"][0] and "data.roles: {system: [knowledge]}" in out["drop_detail"][0]
    out = process_rows([row], tok, DataConfig(roles={"user": ["knowledge"]}))
    assert out["drop_reason"] == [""]  # mapped to a role the template writes


def test_unknown_role_the_template_renders_is_kept(make_tok):
    tok = make_tok(TWO_MARKERS)
    row = {"messages": [{"role": "knowledge", "content": "K"}, *CONVO[1:]]}
    out = process_rows([row], tok, DataConfig())
    assert out["drop_reason"] == [""]
    assert json.loads(out["parse_report"][0]).get("unrendered_messages") is None


def test_unrendered_known_role_is_counted(make_tok):
    out = process_rows([{"messages": CONVO}], make_tok(IN_USER_TURN), DataConfig())
    assert out["drop_reason"] == [""]
    assert json.loads(out["parse_report"][0])["unrendered_messages"] == {"system": 1}


def test_named_templates_dict_is_probed(make_tok):
    # tokenizers may carry several named templates (Command R: default, tool_use, rag); the probe must not
    # choke on the dict, and transformers renders with "default" when no tools are given
    tok = make_tok({"default": NO_HEADER, "tool_use": IN_USER_TURN})
    assert probe_layout(tok).turn_openers == ("[/INST]",)
    assert trained(render_conversation(mark(CONVO[1:]), tok)) == " A1</s> A2</s>"
