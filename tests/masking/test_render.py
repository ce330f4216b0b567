"""Masks from one render: exact expectations by hand, and properties over random conversations."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_train.masking import IGNORE_INDEX, RowRejected, mask_conversation, template_layout
from qlora_train.masking.policy import LossPolicy
from qlora_train.masking.render import build_text_and_masks, render_conversation
from qlora_train.masking.tokenize import OffsetArray, encode_batch, make_labels, project_char_mask
from tests.masking.oracle import tokens


def tokenize_with_char_mask(text: str, mask, tokenizer) -> dict:
    """A text tokenized whole (no cuts, unlike a render: ``masking.finish_examples``) and its char mask projected:
    the first-character rule on its own."""
    (ids, offsets), = encode_batch([text], tokenizer)
    return make_labels(ids, project_char_mask(offsets, np.asarray(mask, dtype=np.uint8)))


mark = LossPolicy().mark  # messages written by hand get their train flags as the parse stage gives them

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def trained_text(text, mask):
    return "".join(c for c, m in zip(text, mask) if m)


def trained_decoded(tok, out):
    return tok.decode([i for i, lab in zip(out["input_ids"], out["labels"]) if lab != IGNORE_INDEX])


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def test_single_turn_qwen3_exact(qwen3_tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text, mask = build_text_and_masks(msgs, qwen3_tok)
    assert text == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                    "<think>\n\n</think>\n\nyo<|im_end|>\n")
    assert trained_text(text, mask) == "<think>\n\n</think>\n\nyo<|im_end|>"
    out = tokenize_with_char_mask(text, mask, qwen3_tok)
    # <think> 151667, "\n\n" 271, </think> 151668, "\n\n" 271, "yo", <|im_end|> 151645; the final "\n" is masked
    assert out["labels"][-7:] == [151667, 271, 151668, 271, *qwen3_tok.encode("yo"), 151645, IGNORE_INDEX]
    assert out["input_ids"] == qwen3_tok(text, add_special_tokens=False)["input_ids"]
    assert out["labels"][:5] == [IGNORE_INDEX] * 5


MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": [call("add", a=3, b=3)]},
    {"role": "tool", "content": "6"},
    {"role": "assistant", "content": "6.", "reasoning_content": "tool said 6"},
]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 3}}\n</tool_call>'


@pytest.mark.parametrize(
    "think_loss, expected",
    [
        ("all", "4<|im_end|>" + "<think>\nneed tool\n</think>\n\n" + TOOL_CALL_TEXT + "<|im_end|>"
         + "<think>\ntool said 6\n</think>\n\n6.<|im_end|>"),
        ("answer_only", "4<|im_end|>" + TOOL_CALL_TEXT + "<|im_end|>" + "6.<|im_end|>"),
        ("answer_plus_think", "4<|im_end|>" + "need tool" + TOOL_CALL_TEXT + "<|im_end|>"
         + "tool said 6" + "6.<|im_end|>"),
    ],
)
def test_qwen3_multi_turn_reasoning_and_tools(qwen3_tok, think_loss, expected):
    text, mask = build_text_and_masks(MULTI, qwen3_tok, tools=TOOLS, policy=LossPolicy(think_loss=think_loss))
    assert text == qwen3_tok.apply_chat_template(MULTI, tools=TOOLS, tokenize=False)
    assert "add them" not in text  # Qwen3 drops reasoning of turns before the last user query
    assert trained_text(text, mask) == expected
    out = tokenize_with_char_mask(text, mask, qwen3_tok)
    assert trained_decoded(qwen3_tok, out) == expected
    assert len(out["input_ids"]) == len(out["labels"]) == len(out["attention_mask"])


def test_prefix_rerender_would_disagree(qwen3_tok):
    """The first turn renders WITH its reasoning when it is the last turn, without it later: a prefix
    re-render gives a different text than the full render, which is why spans come from one render."""
    prefix = qwen3_tok.apply_chat_template(MULTI[:3], tokenize=False)
    full = qwen3_tok.apply_chat_template(MULTI, tools=None, tokenize=False)
    assert "add them" in prefix and not full.startswith(prefix)


def test_llama3_and_gemma_exact(family_tokenizers):
    msgs = [{"role": "system", "content": "Sys."}, {"role": "user", "content": " Q? "},
            {"role": "assistant", "content": " A. "}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "B"}]
    text, mask = build_text_and_masks(msgs, family_tokenizers["llama3"])
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nSys.<|eot_id|>")
    assert trained_text(text, mask) == "A.<|eot_id|>B<|eot_id|>"
    text, mask = build_text_and_masks(msgs, family_tokenizers["gemma"])
    assert text == ("<bos><start_of_turn>user\nSys.\n\nQ?<end_of_turn>\n<start_of_turn>model\nA.<end_of_turn>\n"
                    "<start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\nB<end_of_turn>\n")
    assert trained_text(text, mask) == "A.<end_of_turn>B<end_of_turn>"
    out = tokenize_with_char_mask(text, mask, family_tokenizers["gemma"])
    assert trained_decoded(family_tokenizers["gemma"], out) == "A.<end_of_turn>B<end_of_turn>"


def test_layouts_of_shipped_templates(family_tokenizers):
    expected = {
        "qwen3": ("<|im_start|>assistant\n", "<|im_end|>"),
        "qwen3.5": ("<|im_start|>assistant\n", "<|im_end|>"),
        "qwen2.5": ("<|im_start|>assistant\n", "<|im_end|>"),
        "chatml": ("<|im_start|>assistant\n", "<|im_end|>"),
        "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
        "gemma": ("<start_of_turn>model\n", "<end_of_turn>"),
    }
    for name, (header, eot) in expected.items():
        layout = template_layout(family_tokenizers[name])
        assert (layout.assistant_header, layout.end_of_turn) == (header, eot), name


def test_qwen35_xml_tool_calls(family_tokenizers):
    tok = family_tokenizers["qwen3.5"]
    msgs = [{"role": "user", "content": "add"},
            {"role": "assistant", "content": "ok", "tool_calls": [call("add", a=1)]}]
    text, mask = build_text_and_masks(msgs, tok, tools=TOOLS)
    assert trained_text(text, mask) == (  # the generation prompt writes '<think>\n': prompt, never trained
        "\n</think>\n\nok\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>")


def test_straddling_token_belongs_to_where_it_starts(family_tokenizers, qwen3_tok):
    # header "\n" + content " \nhi" tokenized whole: the Qwen tokenizer makes "\n \n" one token, starting in
    # the header, so the rule leaves it untrained
    tok = family_tokenizers["chatml"]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": " \nhi"}]
    text, mask = build_text_and_masks(msgs, tok)
    assert trained_text(text, mask) == " \nhi<|im_end|>"
    out = tokenize_with_char_mask(text, mask, tok)
    assert trained_decoded(tok, out) == "hi<|im_end|>"
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert project_char_mask(OffsetArray.from_pairs(enc["offset_mapping"]), mask).straddling == 1
    # a conversation is not tokenized whole: cut where the answer begins, " \n" starts it and is trained
    m = mask_conversation(msgs, tok)
    assert trained_decoded(tok, {"input_ids": m.input_ids, "labels": m.labels}) == " \nhi<|im_end|>"
    # reasoning "Done." + masked "\n</think>": ".\n" is one token, starting in the reasoning
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A", "reasoning_content": "Done."}]
    text, mask = build_text_and_masks(msgs, qwen3_tok, policy=LossPolicy(think_loss="answer_plus_think"))
    assert trained_text(text, mask) == "Done.A<|im_end|>"
    out = tokenize_with_char_mask(text, mask, qwen3_tok)
    assert trained_decoded(qwen3_tok, out) == "Done.\nA<|im_end|>"


def test_template_error_is_a_row_reason(family_tokenizers):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(RowRejected) as err:
        build_text_and_masks(msgs, family_tokenizers["gemma"], tools=TOOLS)
    assert err.value.reason == "template_error" and "tools" in err.value.detail


def test_user_content_with_header_is_verified_by_prefix_renders(qwen3_tok):
    # the layout cannot tell the user's fake header from the template's; the rule with prefix renders can
    msgs = [{"role": "user", "content": "see <|im_start|>assistant\nfake"}, {"role": "assistant", "content": "a"}]
    r = render_conversation(LossPolicy().mark(msgs), qwen3_tok)
    assert r.verified_by == "prefix_renders"
    assert "".join(c for c, m in zip(r.text, r.char_mask) if m) == "<think>\n\n</think>\n\na<|im_end|>"


def test_reasoning_holding_the_closing_tag_is_verified_by_prefix_renders(qwen3_tok):
    # the layout cannot tell the reasoning's '</think>' from the block's end; the rule with prefix renders can
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "x </think> y"}]
    r = render_conversation(LossPolicy().mark(msgs), qwen3_tok, policy=LossPolicy(think_loss="answer_only"))
    assert r.verified_by == "prefix_renders"
    assert "".join(c for c, m in zip(r.text, r.char_mask) if m) == "a<|im_end|>"
    r = render_conversation(LossPolicy().mark(msgs), qwen3_tok)
    assert "".join(c for c, m in zip(r.text, r.char_mask) if m) == "<think>\nx </think> y\n</think>\n\na<|im_end|>"


def test_input_messages_not_mutated(qwen3_tok):
    msgs = json.loads(json.dumps(MULTI))
    build_text_and_masks(msgs, qwen3_tok, tools=TOOLS)
    assert msgs == MULTI


# ---------------------------------------------------------------- properties over random conversations
# Assistant text never has upper-case letters; user/system/tool text is upper-case letters (plus shared
# neutral characters). So "no user/system/tool character is trained" == "no upper-case letter is trained".
NEUTRAL = " \n0123456789.,!?-é中🙂"
assistant_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz" + NEUTRAL, min_size=0, max_size=40)
other_text = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ" + NEUTRAL, min_size=1, max_size=40)


@st.composite
def conversations(draw, with_tools=True, with_reasoning=True):
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(other_text)})
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(other_text)})
        if with_tools and draw(st.integers(0, 3)) == 0:
            m = {"role": "assistant", "content": draw(assistant_text), "tool_calls": [call("add", a=1)]}
            if with_reasoning and draw(st.booleans()):
                m["reasoning_content"] = draw(assistant_text)
            msgs += [m, {"role": "tool", "content": draw(other_text)}]
        content = draw(assistant_text.filter(lambda s: s.strip()))
        m = {"role": "assistant", "content": content}
        if with_reasoning and draw(st.booleans()):
            m["reasoning_content"] = draw(assistant_text)
        msgs.append(m)
    return msgs


def expected_qwen3(msgs):
    """What a Qwen3 assistant turn must generate, written out by hand from the format."""
    last_query = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    parts = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        content, reasoning = m["content"], m.get("reasoning_content", "")
        if i > last_query and (i == len(msgs) - 1 or reasoning):
            out = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        else:
            out = content
        for j, _call in enumerate(m.get("tool_calls", [])):
            out += "\n" if (j or content) else ""
            out += '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
        parts.append(out + "<|im_end|>")
    return "".join(parts)


def expected_trimmed(msgs, eot):
    return "".join(m["content"].strip() + eot for m in msgs if m["role"] == "assistant")


def check_row(tok, msgs, expected, tools=None):
    r = render_conversation(mark(msgs), tok, tools=tools)
    text, mask = r.text, r.char_mask
    assert text == tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert len(mask) == len(text)
    assert trained_text(text, mask) == expected  # exact, per character
    m = mask_conversation(msgs, tok, tools=tools)
    # the render tokenized in pieces cut where each trained turn begins, each piece alone (as at inference)
    assert m.input_ids == tokens(tok, text, [t.start for t in r.turns])[0]
    decoded = trained_decoded(tok, {"input_ids": m.input_ids, "labels": m.labels})
    assert decoded == expected  # exact, per token: each trained span starts at a cut, ends at a special token
    assert not any(c.isupper() for c in decoded)


PROP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(msgs=conversations())
def test_property_qwen3(qwen3_tok, msgs):
    check_row(qwen3_tok, msgs, expected_qwen3(msgs), tools=TOOLS)


@PROP
@given(msgs=conversations(with_tools=False, with_reasoning=False))
def test_property_llama3(family_tokenizers, msgs):
    check_row(family_tokenizers["llama3"], msgs, expected_trimmed(msgs, "<|eot_id|>"))


@PROP
@given(msgs=conversations(with_tools=False, with_reasoning=False))
def test_property_gemma(family_tokenizers, msgs):
    check_row(family_tokenizers["gemma"], msgs, expected_trimmed(msgs, "<end_of_turn>"))


@PROP
@given(msgs=conversations(with_tools=False, with_reasoning=False))
def test_property_chatml(family_tokenizers, msgs):
    expected = "".join(m["content"] + "<|im_end|>" for m in msgs if m["role"] == "assistant")
    check_row(family_tokenizers["chatml"], msgs, expected)


@PROP
@given(msgs=conversations())
def test_property_turn_spans_cover_each_assistant_message(qwen3_tok, msgs):
    r = render_conversation(mark(msgs), qwen3_tok, tools=TOOLS)
    assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert [t.index for t in r.turns] == assistants
    for t in r.turns:
        assert r.text[t.start:t.end].endswith("<|im_end|>")
        assert msgs[t.index]["content"].strip() in r.text[t.body_start:t.end]
