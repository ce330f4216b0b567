"""reasoning_history: every assistant turn's reasoning trained exactly once (expand), or counted (drop)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_train.data import DataConfig, process_rows
from qlora_train.masking import IGNORE_INDEX


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def trained(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])


def examples(tok, row, **options) -> tuple[list[str], dict]:
    """A row -> the trained text of its primary example then of its extra ones, and its parse report."""
    out = process_rows([row], tok, DataConfig(**options))
    assert out["drop_reason"] == [""], out["drop_detail"]
    texts = [trained(tok, out["input_ids"][0], out["labels"][0])]
    texts += [trained(tok, i, lab) for i, lab in zip(out["expanded_input_ids"][0], out["expanded_labels"][0])]
    assert out["expanded_tokens"][0] == sum(len(i) for i in out["expanded_input_ids"][0])
    return texts, json.loads(out["parse_report"][0])


def block(reasoning: str, answer: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>"


TWO = {"messages": [
    {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
]}


def test_expand_trains_the_dropped_turn_in_its_own_prefix(qwen3_tok):
    texts, report = examples(qwen3_tok, TWO)
    assert texts == [block("R2", "A2"), block("R1", "A1")]
    assert report["reasoning_expanded_turns"] == 1 and report["expanded_examples"] == 1
    assert "reasoning_dropped_turns" not in report  # nothing left trained without its reasoning


def test_the_extra_example_is_the_prompt_the_model_sees(qwen3_tok):
    out = process_rows([TWO], qwen3_tok, DataConfig())
    assert qwen3_tok.decode(out["expanded_input_ids"][0][0]) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n" + block("R1", "A1") + "\n")


def test_drop_trains_without_it_and_counts_it(qwen3_tok):
    texts, report = examples(qwen3_tok, TWO, reasoning_history="drop")
    assert texts == ["A1<|im_end|>" + block("R2", "A2")]
    assert report["reasoning_dropped_rows"] == 1 and report["reasoning_dropped_turns"] == 1
    assert report["reasoning_dropped_tokens"] == len(qwen3_tok("R1", add_special_tokens=False)["input_ids"])


def test_one_prefix_serves_every_turn_it_renders(qwen3_tok):
    # a1 (a tool call) and a2 answer the same question: one prefix, ending at a2, renders both reasonings
    row = {"messages": [
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "", "reasoning_content": "use add", "tool_calls": [call("add", a=3)]},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "6", "reasoning_content": "tool said 6"},
        {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "ok", "reasoning_content": "bye"},
    ]}
    texts, report = examples(qwen3_tok, row, tools_columns=[])
    tool_call = '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call><|im_end|>'
    assert texts == [block("bye", "ok"), "<think>\nuse add\n</think>\n\n" + tool_call + block("tool said 6", "6")]
    assert report["reasoning_expanded_turns"] == 2 and report["expanded_examples"] == 1


def test_cap_leaves_the_rest_counted(qwen3_tok):
    msgs = []
    for k in range(4):
        msgs += [{"role": "user", "content": f"Q{k}"},
                 {"role": "assistant", "content": f"A{k}", "reasoning_content": f"R{k}"}]
    texts, report = examples(qwen3_tok, {"messages": msgs}, reasoning_history_max_examples=2)
    # the latest dropped turns are served first; the oldest stays in the full conversation without reasoning
    assert texts == ["A0<|im_end|>" + block("R3", "A3"), block("R2", "A2"), block("R1", "A1")]
    assert report["reasoning_dropped_turns"] == 1 and report["expanded_examples"] == 2


def test_a_template_that_never_renders_reasoning_is_counted_not_expanded(family_tokenizers):
    texts, report = examples(family_tokenizers["llama3"], TWO)
    assert texts == ["A1<|eot_id|>A2<|eot_id|>"]
    assert report["reasoning_dropped_turns"] == 2 and "expanded_examples" not in report


# ---------------------------------------------------------------- exactly once, over random conversations
words = st.text(alphabet="abcdefghij", min_size=1, max_size=6)


@st.composite
def reasoning_conversations(draw):
    msgs = []
    for k in range(draw(st.integers(1, 5))):
        msgs.append({"role": "user", "content": f"Q{k}"})
        if draw(st.booleans()):
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call("add", a=k)],
                      **({"reasoning_content": f"T{k}" + draw(words)} if draw(st.booleans()) else {})},
                     {"role": "tool", "content": f"R{k}"}]
        msgs.append({"role": "assistant", "content": f"A{k}" + draw(words),
                     **({"reasoning_content": f"W{k}" + draw(words)} if draw(st.booleans()) else {})})
    return msgs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msgs=reasoning_conversations())
def test_property_every_turn_and_its_reasoning_trained_exactly_once(qwen3_tok, msgs):
    texts, report = examples(qwen3_tok, {"messages": msgs}, tools_columns=[])
    joined = "".join(texts)
    for m in msgs:
        if m["role"] != "assistant":
            continue
        if m["content"]:
            assert joined.count(m["content"]) == 1, m["content"]
        if m.get("reasoning_content"):
            assert joined.count(m["reasoning_content"]) == 1, m["reasoning_content"]
    assert "Q" not in joined and "R" not in joined.replace("</think>", "")  # no user or tool text trained
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    dropped = [i for i, m in enumerate(msgs) if i < last_user and m.get("reasoning_content")]
    assert report.get("reasoning_expanded_turns", 0) == len(dropped)
    assert len(texts) == 1 + report.get("expanded_examples", 0)
