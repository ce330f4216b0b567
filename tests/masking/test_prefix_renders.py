"""The rule applied directly (masking/prefix.py): rows the probed layout cannot verify, checked by hand."""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from qlora_train.data import DataConfig, process_rows
from qlora_train.diagnostics.stats import compute_stats
from qlora_train.masking import RowRejected
from qlora_train.masking.layout import probe_layout
from qlora_train.masking.policy import LossPolicy
from qlora_train.masking.prefix import common_prefix_length, render_by_prefixes
from qlora_train.masking.render import render_conversation

mark = LossPolicy().mark

# nothing marks where an answer starts: a user line, then the answer and eos; no generation prompt
NO_MARKER = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content + eos_token }}"
             "{% else %}{{ m.content + '\\n' }}{% endif %}{% endfor %}")
# writes no assistant text at all (a template made for prompts only)
NO_ANSWERS = "{% for m in messages %}{% if m.role != 'assistant' %}{{ '<|u|>' + m.content }}{% endif %}{% endfor %}"
# reasoning and answer in one element each; the generation prompt writes a preamble no turn contains (class C)
PREAMBLE = ("{% for m in messages %}{% if m.role == 'assistant' %}{{ 'Bot:' + (m.reasoning_content or '') + "
            "'\\n[ANSWER]\\n' + m.content + eos_token + '\\n' }}{% else %}{{ 'User:' + m.content + '\\n' }}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'Bot:Here are my steps:\\n' }}{% endif %}")
CONVO = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
         {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]


@pytest.fixture
def make_tok(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    def make(template):
        tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
        tok.eos_token = "<|endoftext|>"
        tok.chat_template = template
        return tok
    return make


def trained(r) -> list[str]:
    out, run = [], ""
    for c, m in zip(r.text, r.char_mask):
        if m:
            run += c
        elif run:
            out, run = out + [run], ""
    return out + [run] if run else out


def test_a_template_with_no_marker_before_the_answer_trains_by_prefix_renders(make_tok):
    tok = make_tok(NO_MARKER)
    layout = probe_layout(tok)
    assert layout.layout_class == "unknown" and "turn_openers" in layout.unknown  # no run is stopped
    r = render_conversation(mark(CONVO), tok)
    assert r.text == "Q1\nA1<|endoftext|>Q2\nA2<|endoftext|>"
    assert (r.verified_by, trained(r)) == ("prefix_renders", ["A1<|endoftext|>", "A2<|endoftext|>"])
    assert r.renders == 4  # two per trained turn
    out = process_rows([{"messages": CONVO}], tok, DataConfig())
    assert out["drop_reason"] == [""]
    assert '"verified_by_prefix_renders": 1' in out["parse_report"][0]


def test_a_template_that_writes_no_answers_refuses_every_row_and_says_what_to_do(make_tok):
    tok = make_tok(NO_ANSWERS)
    out = process_rows([{"messages": CONVO}] * 3, tok, DataConfig())
    assert out["drop_reason"] == ["mask_unverified"] * 3
    assert "messages[1]: the template writes nothing for this assistant turn" in out["drop_detail"][0]
    stats = compute_stats({k: out[k] for k in out} | {"source": ["x"] * 3, "location": ["x"] * 3},
                          max_length=2048)
    assert any("model.template_layout" in line and "mask_unverified" in line for line in stats["advice"])


def test_a_generation_prompt_the_render_does_not_contain(make_tok):
    # the prompt is cut where the turn's own text starts, even when the answer begins like the preamble
    tok = make_tok(PREAMBLE)
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "Here R"}]
    r = render_by_prefixes(mark(msgs), tok)
    assert r.text == "User:Q\nBot:Here R\n[ANSWER]\nA<|endoftext|>\n"
    assert trained(r) == ["Here R\n[ANSWER]\nA<|endoftext|>"]
    assert r.turns[0].reasoning == (r.text.index("Here R"), r.text.index("Here R") + 6)
    r = render_by_prefixes(mark(msgs), tok, policy=LossPolicy(think_loss="answer_only"))
    assert trained(r) == ["A<|endoftext|>"]  # no think_close known: the answer starts where its text does


def test_a_row_the_template_renders_differently_once_later_turns_exist_is_refused_with_that_reason(make_tok):
    # the last answer gets a marker earlier ones do not: not prefix-stable, and the layout cannot tell either
    tok = make_tok("{% for m in messages %}{% if m.role == 'assistant' %}{{ ('>>' if loop.last else '') + "
                   "m.content + eos_token }}{% else %}{{ m.content + '\\n' }}{% endif %}{% endfor %}")
    with pytest.raises(RowRejected) as err:
        render_conversation(mark(CONVO), tok)
    assert err.value.reason == "mask_unverified"
    assert err.value.detail.startswith("messages[1]: the template is not prefix-stable on this row")


def test_a_tool_result_written_inside_the_answer_is_never_trained(make_tok):
    # the template writes a tool result only when the next answer follows it, inside that answer's block
    tok = make_tok("{% for m in messages %}{% if m.role == 'assistant' %}{{ 'A:' + m.content + eos_token }}"
                   "{% elif m.role == 'tool' %}{% else %}{{ 'U:' + m.content }}{% endif %}"
                   "{% if m.role == 'assistant' and loop.index0 > 1 %}{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}A:{% endif %}")
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "calling"},
            {"role": "tool", "content": "RESULT"}, {"role": "assistant", "content": "RESULT is 5"}]
    r = render_by_prefixes(mark(msgs), tok)
    assert trained(r) == ["calling<|endoftext|>", "RESULT is 5<|endoftext|>"]  # the answer may quote it


# a turn's calls in a block of their own before its content, which opens a new header (DeepSeek R1's distills
# do this); the generation prompt opens a reasoning block whose first character the calls block shares ('<')
CALLS_FIRST = ("{% for m in messages %}{% if m.role == 'user' %}{{ '<|U|>' + m.content }}"
               "{% elif m.role == 'tool' %}{{ '<|R|>' + m.content + '<|/R|>' }}"
               "{% else %}{{ '<|A|>' }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
               "{{ '<calls>' + c.function.name + ' ' + (c.function.arguments | tojson) + '</calls>' }}{% endfor %}"
               "{{ '<|end|>' }}{% if m.content %}{{ '<|A|>' }}{% endif %}{% endif %}"
               "{{ m.content + '<|end|>' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|A|><think>\\n' }}{% endif %}")


def test_calls_written_before_the_content_and_a_block_sharing_the_prompts_first_character(make_tok):
    """Regressions from held-out DeepSeek R1 distills: a call turn with content was refused ('tool call not
    written in its turn': the calls were looked for only after the content), and a call turn's first character
    ('<' of '<calls>', shared with the generation prompt's '<think>') went untrained."""
    tok = make_tok(CALLS_FIRST)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}, "id": "c1"}
    convo = [{"role": "user", "content": "Add 2."}, {"role": "assistant", "content": "let me check.",
                                                     "tool_calls": [call]},
             {"role": "tool", "content": "2", "tool_call_id": "c1"}, {"role": "assistant", "content": "It is 2."}]
    r = render_conversation(mark(convo), tok)
    assert r.verified_by == "prefix_renders"
    assert trained(r) == ['<calls>add {"a": 2}</calls><|end|><|A|>let me check.<|end|>', "It is 2.<|end|>"]


# Phi-3.5's layout (written from its documented format): eos only where the conversation ends, calls not written
EOS_AT_END = ("{% for m in messages %}{% if m.role in ('user', 'assistant') %}{{ '<|' + m.role + '|>\\n' + m.content"
              " + '<|end|>\\n' }}{% endif %}{% endfor %}"
              "{{ '<|assistant|>\\n' if add_generation_prompt else eos_token }}")


def test_what_the_template_writes_only_where_the_conversation_ends_is_never_trained(make_tok):
    """Regression from the pair audit: a pair whose prompt holds a tool call the template does not write takes
    the prefix-render path, whose last turn ran on through the eos the template appends after the last message
    (a token the model never generates after '<|end|>')."""
    from qlora_train.data.pairs import build_preference_example

    tok = make_tok(EOS_AT_END)
    tok.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}, "id": "c1"}
    prompt = [{"role": "user", "content": "Add 2."}, {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "content": "2", "tool_call_id": "c1"}, {"role": "assistant", "content": "It is 2."},
              {"role": "user", "content": "And now?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    ex = build_preference_example(prompt, [{"role": "assistant", "content": "Done."}],
                                  [{"role": "assistant", "content": "No."}], tok, tools=tools)
    for side, answer in (("chosen", "Done.<|end|>"), ("rejected", "No.<|end|>")):
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        assert tok.decode(ids).endswith(answer + "\n<|endoftext|>")
        assert tok.decode([t for t, lab in zip(ids, labels) if lab != -100]) == answer


@given(st.text("ab\U0001f600", max_size=12), st.text("ab\U0001f600", max_size=12))
@example("", "")
@example("ab", "ab")
@example("abab", "abaa")
def test_common_prefix_length_is_os_path_commonprefix(a, b):
    assert common_prefix_length(a, b) == len(os.path.commonprefix([a, b]))
