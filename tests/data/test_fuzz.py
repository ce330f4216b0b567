"""Fuzz: random and mutated rows through process_rows with the real tokenizer.

Whatever comes in, no exception escapes, one output per input row, and each row is either kept (ids,
attention mask and labels of one length <= max_length, at least one trained token, every label equal
to its id or IGNORE_INDEX) or dropped with a known DropReason and a detail naming the row.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_train.config import DataConfig
from qlora_train.data import process_rows
from qlora_train.data.processed import OUTPUT_COLUMNS
from qlora_train.masking.messages import KNOWN_DROP_REASONS
from qlora_train.masking.tokenize import IGNORE_INDEX

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])

# text with what breaks parsers and templates: think tags, template markers, lone surrogates, huge strings
PIECES = ["<think>", "</think>", "<|im_end|>", "<|im_start|>assistant\n", "<tool_call>", "{{", "{%", "\n", " ",
          "\ud800", "\udcff", "é", "🙂", "\x00", "\\u", "answer", "x" * 5000]
texts = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(PIECES) | st.text(max_size=8), max_size=6).map("".join),
    st.just("word " * 2000),
)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | texts
garbage = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)

roles = st.sampled_from(["system", "user", "assistant", "tool", "narrator", "", "ASSISTANT"]) | garbage
contents = texts | st.none() | garbage | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                                  max_size=2)
arguments = garbage | st.just('{"a": 1}') | st.just("{not json") | st.dictionaries(st.text(max_size=4), scalars)
tool_call = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"),
                           "function": st.fixed_dictionaries({"name": st.text(max_size=8) | garbage,
                                                              "arguments": arguments})}),
    st.fixed_dictionaries({"name": st.text(max_size=8)}, optional={"arguments": arguments, "id": garbage}),
    garbage,
)
tool_calls = st.lists(tool_call, max_size=2) | st.just("[{]") | st.just('[{"name": "f", "arguments": "{}"}]') | garbage
message = st.fixed_dictionaries(
    {"role": roles, "content": contents},
    optional={"reasoning_content": texts | garbage, "thinking": texts, "tool_calls": tool_calls,
              "name": garbage, "tool_call_id": garbage},
)
sharegpt_turn = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt", "system", "function", "bot"]) | garbage,
                                       "value": contents})
tools = st.none() | garbage | st.just("[{") | st.lists(st.dictionaries(st.text(max_size=5), garbage, max_size=2),
                                                       max_size=2)
random_rows = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(message, max_size=5)}, optional={"tools": tools}),
    st.fixed_dictionaries({"conversations": st.lists(sharegpt_turn, max_size=4)}),
    st.fixed_dictionaries({"prompt": contents, "response": contents}, optional={"system": garbage,
                                                                                "reasoning": garbage}),
    st.dictionaries(st.text(max_size=10), garbage, max_size=4),
    garbage,  # not even a mapping
)

VALID = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "<think>add</think>4"}]},
    {"messages": [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "get", "arguments": {"city": "Oslo"}}}]},
                  {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}],
     "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"prompt": "q", "response": "a", "reasoning": "because"},
]


def _paths(node, path=()):
    """Every (path, value) inside a JSON-like row."""
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield from _paths(child, path + (key,))


@st.composite
def mutated_rows(draw):
    """A valid row with one to three places replaced by garbage or removed."""
    row = copy.deepcopy(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(row) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = row
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()):
            parent[path[-1]] = draw(garbage | texts)
        elif isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    return row


configs = st.builds(
    DataConfig,
    max_length=st.integers(8, 160),
    truncate_side=st.sampled_from(["left", "right"]),
    think_loss=st.sampled_from(["all", "answer_only"]),
    think_mode=st.sampled_from(["keep", "drop"]),
    on_too_long=st.sampled_from(["truncate", "drop"]),
    extract_think_tags=st.booleans(),
)


def check_every_row_accounted_for(rows, tok, cfg):
    out = process_rows(rows, tok, cfg)  # must not raise
    assert all(len(out[col]) == len(rows) for col in OUTPUT_COLUMNS)
    for i in range(len(rows)):
        reason, ids, labels = out["drop_reason"][i], out["input_ids"][i], out["labels"][i]
        if reason:
            assert reason in KNOWN_DROP_REASONS, reason
            assert out["drop_detail"][i].startswith(f"row {i}: ")
            assert ids == labels == []
        else:
            assert len(ids) == len(labels) == len(out["attention_mask"][i]) <= cfg.max_length
            trained = [lab for lab in labels if lab != IGNORE_INDEX]
            assert trained and len(trained) == out["num_trained_tokens"][i]
            assert all(lab in (IGNORE_INDEX, tid) for lab, tid in zip(labels, ids))
    return out


@FUZZ
@given(rows=st.lists(random_rows, min_size=1, max_size=4), cfg=configs)
def test_random_rows_are_kept_or_dropped_with_a_reason(qwen3_tok, rows, cfg):
    check_every_row_accounted_for(rows, qwen3_tok, cfg)


@FUZZ
@given(rows=st.lists(mutated_rows(), min_size=1, max_size=4), cfg=configs)
def test_mutated_rows_are_kept_or_dropped_with_a_reason(qwen3_tok, rows, cfg):
    check_every_row_accounted_for(rows, qwen3_tok, cfg)


def test_the_unmutated_rows_are_kept(qwen3_tok):
    out = check_every_row_accounted_for(VALID, qwen3_tok, DataConfig(max_length=512))
    assert out["drop_reason"] == [""] * len(VALID)
