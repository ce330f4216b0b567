"""Mask rules beyond assistant_roles, checked by hand on the real Qwen3 template and tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_train.data import DataConfig, canonicalize_row, process_rows
from qlora_train.masking import IGNORE_INDEX, RowRejected
from qlora_train.masking.policy import LossPolicy
from qlora_train.masking.render import build_text_and_masks

ROW = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                    {"role": "assistant", "content": "a2"}]}
EMPTY_THINK = "<think>\n\n</think>\n\n"  # Qwen3 writes it in the last assistant turn


def trained(row, tok, **options) -> str:
    """The trained characters of a row, and (checked equal) the decoded trained tokens."""
    cfg = DataConfig(**options)
    canon = canonicalize_row(row, cfg)
    text, mask = build_text_and_masks(canon.messages, tok, policy=LossPolicy.of(cfg))
    chars = "".join(c for c, m in zip(text, mask) if m)
    out = process_rows([row], tok, cfg)
    assert out["drop_reason"] == [""], out["drop_detail"]
    ids = [i for i, lab in zip(out["input_ids"][0], out["labels"][0]) if lab != IGNORE_INDEX]
    assert tok.decode(ids) == chars
    return chars


@pytest.mark.parametrize("options, expected", [
    ({}, "a1<|im_end|>" + EMPTY_THINK + "a2<|im_end|>"),
    ({"mask": {"user": "train", "assistant": "train"}},
     "q1<|im_end|>a1<|im_end|>q2<|im_end|>" + EMPTY_THINK + "a2<|im_end|>"),
    ({"mask": {"system": "train", "user": "mask"}, "mask_default": "train"},
     "S<|im_end|>a1<|im_end|>" + EMPTY_THINK + "a2<|im_end|>"),
    ({"mask": {"assistant": "train"}, "mask_default": "mask"}, "a1<|im_end|>" + EMPTY_THINK + "a2<|im_end|>"),
], ids=["default", "user+assistant", "default-train", "explicit-assistant"])
def test_per_role_mask_rules(qwen3_tok, options, expected):
    assert trained(ROW, qwen3_tok, **options) == expected


@pytest.mark.parametrize("train_on_eos, expected", [
    ("turn", "a1<|im_end|>" + EMPTY_THINK + "a2<|im_end|>"),
    ("all", "<|im_end|><|im_end|>a1<|im_end|><|im_end|>" + EMPTY_THINK + "a2<|im_end|>"),
    ("last", "a1" + EMPTY_THINK + "a2<|im_end|>"),
    ("none", "a1" + EMPTY_THINK + "a2"),
])
def test_train_on_eos(qwen3_tok, train_on_eos, expected):
    assert trained(ROW, qwen3_tok, train_on_eos=train_on_eos) == expected


def test_last_turn_only(qwen3_tok):
    assert trained(ROW, qwen3_tok, last_turn_only=True) == EMPTY_THINK + "a2<|im_end|>"


def test_last_turn_only_walks_past_an_untrained_tool_call_turn(qwen3_tok):
    row = {"messages": [{"role": "user", "content": "3+3?"},
                        {"role": "assistant", "content": "", "tool_calls": [
                            {"type": "function", "function": {"name": "add", "arguments": {"a": 3}}}]},
                        {"role": "tool", "content": "6"}, {"role": "assistant", "content": "six"}]}
    assert trained(row, qwen3_tok, last_turn_only=True) == EMPTY_THINK + "six<|im_end|>"


@pytest.mark.parametrize("key, value", [("training", True), ("weight", 1)])
def test_message_override_trains_a_user_turn(qwen3_tok, key, value):
    row = {"messages": [*ROW["messages"][:3], {**ROW["messages"][3], key: value}, ROW["messages"][4]]}
    assert trained(row, qwen3_tok) == "a1<|im_end|>q2<|im_end|>" + EMPTY_THINK + "a2<|im_end|>"


@pytest.mark.parametrize("key, value", [("training", False), ("weight", 0)])
def test_message_override_masks_an_assistant_turn(qwen3_tok, key, value):
    row = {"messages": [*ROW["messages"][:2], {**ROW["messages"][2], key: value}, *ROW["messages"][3:]]}
    assert trained(row, qwen3_tok) == EMPTY_THINK + "a2<|im_end|>"


def test_override_beats_role_rule_and_bad_override_names_the_message():
    msgs = [{"role": "user", "content": "q", "training": True}, {"role": "assistant", "content": "a"}]
    out = canonicalize_row({"messages": msgs}, DataConfig(mask={"user": "mask", "assistant": "train"}))
    assert [m["train"] for m in out.messages] == [True, True]  # every message carries its decision
    out = canonicalize_row({"messages": msgs}, DataConfig(mask={"user": "mask"}))  # mask_default masks assistant
    assert [m.get("train") for m in out.messages] == [True, False]
    with pytest.raises(RowRejected) as err:
        canonicalize_row({"messages": [msgs[0], {**msgs[1], "weight": 0.5}]})
    assert err.value.reason == "bad_row" and err.value.detail.startswith("messages[1].weight")


def test_no_trained_message_is_refused():
    with pytest.raises(RowRejected) as err:
        canonicalize_row(ROW, DataConfig(mask={"assistant": "mask"}))
    assert err.value.reason == "no_assistant_turn" and "mask rules" in err.value.detail


WORDS = st.text(alphabet="abcdefgh ", min_size=1, max_size=8).map(lambda s: "w" + s.strip())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(WORDS, WORDS, st.booleans(), st.booleans()), min_size=1, max_size=4),
       eos=st.sampled_from(["turn", "none"]))
def test_trained_text_is_the_flagged_messages(qwen3_tok, turns, eos):
    """Any mix of per-message flags: the trained text is each flagged message's content (+ its marker), in order."""
    msgs, expected = [], ""
    for i, (q, a, train_q, train_a) in enumerate(turns):
        msgs += [{"role": "user", "content": q, "training": train_q},
                 {"role": "assistant", "content": a, "training": train_a or i == len(turns) - 1}]
    end = "<|im_end|>" if eos == "turn" else ""
    for i, m in enumerate(msgs):
        if m["training"]:
            think = EMPTY_THINK if i == len(msgs) - 1 else ""
            expected += think + m["content"] + end
    assert trained({"messages": msgs}, qwen3_tok, train_on_eos=eos) == expected


@pytest.mark.parametrize("family, options, expected", [
    ("llama3", {"mask": {"user": "train", "assistant": "train"}}, "q1<|eot_id|>a1<|eot_id|>q2<|eot_id|>a2<|eot_id|>"),
    ("llama3", {"train_on_eos": "all"}, "<|eot_id|><|eot_id|>a1<|eot_id|><|eot_id|>a2<|eot_id|>"),
    # Gemma folds the system prompt into the first user turn: the system message has no marker of its own
    ("gemma", {"train_on_eos": "all"}, "<end_of_turn>a1<end_of_turn><end_of_turn>a2<end_of_turn>"),
    ("gemma", {"mask": {"user": "train", "assistant": "train"}, "train_on_eos": "none"}, "q1a1q2a2"),
])
def test_rules_on_other_template_families(family_tokenizers, family, options, expected):
    assert trained(ROW, family_tokenizers[family], **options) == expected
