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
# issue 34, shape 1: every render, generation prompt or not, ends with an assistant turn's opener <|T|><|BOT|> (the
# trailer), the generation prompt adds <|R|> after it; a default system turn first when none is given
TRAILER_EXTENDED = (
    "{% if messages[0].role != 'system' %}<|T|><|SYS|>Be kind.<|E|>{% endif %}"
    "{% for m in messages %}<|T|>{% if m.role == 'assistant' %}<|BOT|><|R|>{{ m.content }}<|/R|>"
    "{% elif m.role == 'system' %}<|SYS|>{{ m.content }}{% else %}<|USR|>{{ m.content }}{% endif %}<|E|>"
    "{% endfor %}<|T|><|BOT|>{% if add_generation_prompt %}<|R|>{% endif %}")
# issue 34, shape 4: the generation prompt opens reasoning, <|A|><think>; an answer after the last user message with
# reasoning is <|A|><think>..</think>answer, every other one <|A|></think>answer (an empty block, closed only)
TAG_PROMPT = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}{% if m.role == 'assistant' %}<|A|>"
    "{% if loop.index0 > ns.last and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% else %}</think>{% endif %}{{ m.content }}<|/A|>{% else %}<|U|>{{ m.content }}<|/U|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|A|><think>{% endif %}")
# issue 24's class C, reasoning dropped before the last user message: a preamble only the generation prompt writes,
# reasoning without an opener that ends at a plain-text [[FINAL]], no end marker after the last message
PREAMBLE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
    "{% endif %}{% endfor %}{% for m in messages %}<|M|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last %}{{ m.reasoning_content }}"
    "\n[[FINAL]]\n{% endif %}{{ m.content }}{% if not loop.last %}<|/M|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{% if messages %}<|/M|>\n{% endif %}<|M|>assistant\nHere is my plan:\n{% endif %}")
SPECIALS = ["<|user|>", "<|assistant|>", "<|end|>", "[INST]", "[/INST]", "<s>", "</s>", "<|T|>", "<|/T|>",
            "<|BOT|>", "<|THINK|>", "<|/THINK|>", "<|RESP|>", "<|/RESP|>", "<|TOOL|>", "<|USER|>",
            "<|SYS|>", "<|USR|>", "<|R|>", "<|/R|>", "<|E|>", "<|A|>", "<|/A|>", "<|U|>", "<|/U|>", "<|M|>", "<|/M|>"]


@pytest.fixture(scope="module")
def make_tok(qwen_tokenizer_dir):
    """A template on the Qwen vocabulary with ``SPECIALS`` added as tokens (``markers=False``: left as plain text,
    several tokens each)."""
    from transformers import AutoTokenizer

    def make(template, markers: bool = True):
        tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
        if markers:
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


@pytest.mark.parametrize("markers", [True, False], ids=["tokens", "plain"])
def test_a_trailer_the_generation_prompt_extends(make_tok, markers):
    """Issue 34, shape 1: the end marker was read as ``<|/R|><|E|><|T|><|BOT|>`` (the next turn's opener in it) and
    the header as ``<|R|>``: single-turn rows trained the trailer, multi-turn rows were refused, every preference
    pair trained it on both sides. The trailer is never trained and never part of an end marker."""
    tok = make_tok(TRAILER_EXTENDED, markers)
    layout = probe_layout(tok)
    assert (layout.trailer, layout.assistant_header, layout.turn_openers, layout.end_markers) == (
        "<|T|><|BOT|>", "<|T|><|BOT|><|R|>", ("<|T|><|BOT|><|R|>",), ("<|/R|><|E|>",))
    assert layout.layout_class == "header_after_every_render"
    r = render_conversation(mark(CONVO[1:]), tok)
    assert r.text == ("<|T|><|SYS|>Be kind.<|E|><|T|><|USR|>Q1<|E|><|T|><|BOT|><|R|>A1<|/R|><|E|><|T|><|USR|>Q2<|E|>"
                      "<|T|><|BOT|><|R|>A2<|/R|><|E|><|T|><|BOT|>")
    assert (r.verified_by, trained(r)) == ("layout", "A1<|/R|><|E|>A2<|/R|><|E|>")
    pair = {"prompt": CONVO[:2], "chosen": [{"role": "assistant", "content": "Yes."}],
            "rejected": [{"role": "assistant", "content": "No."}]}
    out = process_rows([pair], tok, DataConfig(objective="preference"))
    assert out["drop_reason"] == [""], out["drop_detail"]
    for side, answer in (("chosen", "Yes."), ("rejected", "No.")):
        ids, labels = out[f"{side}_input_ids"][0], out[f"{side}_labels"][0]
        text = f"<|T|><|SYS|>S<|E|><|T|><|USR|>Q1<|E|><|T|><|BOT|><|R|>{answer}<|/R|><|E|><|T|><|BOT|>"
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids == enc["input_ids"]
        starts = [a for (a, _), lab in zip(enc["offset_mapping"], labels) if lab != -100]
        # as tokens, exactly the answer and its end marker; as plain text the end marker's last '>' and the
        # trailer's first '<' are one token, trained where it starts (the first-character rule): no token that
        # starts in the trailer is trained on either side
        assert text[starts[0]:].startswith(answer) and max(starts) < len(text) - len("<|T|><|BOT|>")
        if markers:
            assert tok.decode([i for i, lab in zip(ids, labels) if lab != -100]) == f"{answer}<|/R|><|E|>"


@pytest.mark.parametrize("markers", [True, False], ids=["tokens", "plain"])
def test_reasoning_tags_the_probe_does_not_cut_through(make_tok, markers):
    """Issue 34, shape 4: the character-level common prefix of ``<|A|><think>`` and ``<|A|></think>..`` is
    ``<|A|><``; the probe took it as the header and ``<`` as the reasoning close, and refused rows with reasoning
    in an earlier and the last turn. The prompt ends at a marker boundary."""
    tok = make_tok(TAG_PROMPT, markers)
    layout = probe_layout(tok)
    assert (layout.assistant_header, layout.turn_openers, layout.end_markers) == ("<|A|>", ("<|A|>",), ("<|/A|>",))
    assert (layout.think_open, layout.think_close, layout.answer_open, layout.leads) == (
        "<think>", "</think>", "", ("</think>",))
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    r = render_conversation(mark(msgs), tok)
    assert r.text == "<|U|>Q1<|/U|><|A|></think>A1<|/A|><|U|>Q2<|/U|><|A|><think>R2</think>A2<|/A|>"
    # the generation prompt opens the block: its '<think>' is prompt; a turn without it ('</think>' shares only '<',
    # inside the marker) starts after <|A|>, the dropped block's close generated
    assert (r.verified_by, trained(r)) == ("layout", "</think>A1<|/A|>R2</think>A2<|/A|>")
    assert layout.prompt_tail == "<think>"
    assert [t.reasoning_dropped for t in r.turns] == [True, False]


@pytest.mark.parametrize("markers", [True, False], ids=["tokens", "plain"])
def test_reasoning_without_an_opener_after_a_preamble_is_read_by_the_walk(make_tok, markers):
    """Issue 24's class C, reasoning dropped before the last user message: rows with reasoning in an earlier and the
    last turn are not prefix-stable, so only the fast path can train them; it reads a block with no opener (the
    reasoning, then ``[[FINAL]]``). They were refused (a fifth of the audit's rows)."""
    tok = make_tok(PREAMBLE, markers)
    layout = probe_layout(tok)
    assert (layout.think_open, layout.think_close, layout.end_markers) == ("", "[[FINAL]]", ("<|/M|>",))
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    r = render_conversation(mark(msgs), tok)
    assert r.text == ("<|M|>user\nQ1<|/M|>\n<|M|>assistant\nA1<|/M|>\n<|M|>user\nQ2<|/M|>\n<|M|>assistant\n"
                      "R2\n[[FINAL]]\nA2")
    assert (r.verified_by, trained(r)) == ("layout", "A1<|/M|>R2\n[[FINAL]]\nA2")
    assert [t.reasoning_dropped for t in r.turns] == [True, False]
    r = render_conversation(mark(msgs), tok, policy=LossPolicy(think_loss="answer_only"))
    assert trained(r) == "A1<|/M|>A2"
