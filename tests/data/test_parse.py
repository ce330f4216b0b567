"""canonicalize_row: schemas, reasoning normalisation, tools, reports."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlora_train.data import DataConfig, ParseReport, canonicalize_row
from qlora_train.masking import RowRejected


def test_openai_messages_with_reasoning_key_moved():
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a", "thinking": "t"}]}
    out = canonicalize_row(row)
    assert out.messages == [{"role": "user", "content": "q", "train": False},
                            {"role": "assistant", "content": "a", "reasoning_content": "t", "train": True}]
    assert out.report.schema == "messages" and out.report.moved_reasoning_keys == {"thinking": 1}


def test_sharegpt_roles_mapped():
    row = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}]}
    out = canonicalize_row(row)
    assert [m["role"] for m in out.messages] == ["system", "user", "assistant"]
    assert out.report.schema == "sharegpt"


@pytest.mark.parametrize("key", ["response", "completion", "answer"])
def test_prompt_response(key):
    out = canonicalize_row({"prompt": "q", key: "<think>\nr\n</think>\n\na", "system": "s"})
    assert out.messages == [{"role": "system", "content": "s", "train": False},
                            {"role": "user", "content": "q", "train": False},
                            {"role": "assistant", "content": "a", "reasoning_content": "r", "train": True}]
    assert out.report.extracted_think_from_content == 1


SYS = {"role": "system", "content": "Be brief.", "train": False}
USER_ASSISTANT = [{"role": "user", "content": "q", "train": False},
                  {"role": "assistant", "content": "a", "train": True}]


@pytest.mark.parametrize("row", [
    {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},  # ShareGPT
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},  # OpenAI
    {"conversation": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    {"prompt": "q", "response": "a"},
    {"instruction": "q", "output": "a"},  # Alpaca
], ids=["sharegpt", "messages", "conversation", "prompt_response", "alpaca"])
def test_the_system_column_opens_every_chat_schema(row):
    out = canonicalize_row({**row, "system": "Be brief."})
    assert out.messages == [SYS, *USER_ASSISTANT]
    assert (out.report.system_from_column, out.report.system_column_conflicts) == (1, 0)


def test_a_conversations_own_system_message_wins_and_a_different_column_is_counted():
    own = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}]}
    for column, conflicts in (("Be brief.", 0), ("You are a pirate.", 1), ("", 0), (None, 0)):
        out = canonicalize_row({**own, "system": column})
        assert out.messages == [SYS, *USER_ASSISTANT], column
        assert (out.report.system_from_column, out.report.system_column_conflicts) == (0, conflicts), column


def test_the_system_column_is_text_by_the_content_rule_and_mapped_like_any_column():
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    assert canonicalize_row({**row, "system": parts}).messages == [SYS, *USER_ASSISTANT]
    out = canonicalize_row({**row, "persona": "Be brief."}, DataConfig(field_mappings={"system": "persona"}))
    assert out.messages == [SYS, *USER_ASSISTANT]
    with pytest.raises(RowRejected, match="bad_content_type: column 'system': content of type bool"):
        canonicalize_row({**row, "system": True})


def test_close_tag_only_counts_as_reasoning():
    out = canonicalize_row({"prompt": "q", "response": "step one</think>answer"})
    assert out.messages[-1] == {"role": "assistant", "content": "answer", "reasoning_content": "step one",
                                "train": True}


def test_unbalanced_think_is_kept_and_reported():
    out = canonicalize_row({"prompt": "q", "response": "<think>never closed"})
    assert out.messages[-1]["content"] == "<think>never closed"
    assert out.report.unbalanced_think_tags == 1


def test_extract_think_tags_off():
    out = canonicalize_row({"prompt": "q", "response": "<think>r</think>a"}, DataConfig(extract_think_tags=False))
    assert out.messages[-1] == {"role": "assistant", "content": "<think>r</think>a", "train": True}


def test_think_mode_drop():
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": "<think>r</think>a", "reasoning": "r2"}]}
    out = canonicalize_row(row, DataConfig(think_mode="drop"))
    assert out.messages[-1] == {"role": "assistant", "content": "a", "train": True}
    assert out.report.dropped_think_messages == 1


def test_think_max_tokens(qwen3_tok):
    row = {"prompt": "q", "response": "a", "reasoning": "one two three four five six"}
    out = canonicalize_row(row, DataConfig(think_max_tokens=3), tokenizer=qwen3_tok)
    assert out.messages[-1]["reasoning_content"] == "one two three"
    assert out.report.think_capped_messages == 1


def test_tools_as_json_string_and_dict():
    base = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    out = canonicalize_row({**base, "functions": '[{"name": "f"}]'})
    assert out.tools == [{"name": "f"}] and out.report.tools_parsed_from_string == 1
    out = canonicalize_row({**base, "tools": {"name": "g"}})
    assert out.tools == [{"name": "g"}] and out.report.tools_present == 1
    with pytest.raises(RowRejected) as err:
        canonicalize_row({**base, "tools": "[{not json"})
    assert err.value.reason == "tools_unparseable" and "'tools'" in err.value.detail


def test_tool_call_arguments_string_parsed():
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]}
    call = canonicalize_row(row).messages[-1]["tool_calls"][0]
    assert call == {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}, "id": "c1"}


def test_unknown_roles_kept_and_counted():
    row = {"messages": [{"role": "knowledge", "content": "k"}, {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"}]}
    out = canonicalize_row(row)
    assert out.messages[0]["role"] == "knowledge" and out.report.unknown_roles == {"knowledge": 1}


@pytest.mark.parametrize("row, reason", [
    ({"foo": 1}, "unknown_schema"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}, "empty_assistant_turn"),
    ({"messages": [{"role": "user", "content": {1, 2}}, {"role": "assistant", "content": "a"}]}, "bad_content_type"),
    ({"messages": ["nope", {"role": "assistant", "content": "a"}]}, "bad_row"),
])
def test_rejections_name_the_reason(row, reason):
    with pytest.raises(RowRejected) as err:
        canonicalize_row(row)
    assert err.value.reason == reason


@pytest.mark.parametrize("role, detail", [
    (5, "messages[1]: the role (key 'role') is not a string: int 5"),
    (["user"], "messages[1]: the role (key 'role') is not a string: list ['user']"),
    (None, "messages[1]: missing role (key 'role')"),
    ("", "messages[1]: missing role (key 'role')"),
])
def test_a_role_that_is_not_a_string_is_said_so(role, detail):
    row = {"messages": [{"role": "user", "content": "q"}, {"role": role, "content": "a"}]}
    with pytest.raises(RowRejected) as err:
        canonicalize_row(row)
    assert (err.value.reason, err.value.detail) == ("bad_row", detail)


def test_reports_add_up():
    a = canonicalize_row({"prompt": "q", "response": "<think>r</think>a"}).report
    b = canonicalize_row({"messages": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a", "reasoning": "r"}]}).report
    total = ParseReport.total([a, b, b])
    assert total.rows == 3 and total.schemas == {"prompt_response": 1, "messages": 2}
    assert total.extracted_think_from_content == 1 and total.moved_reasoning_keys == {"reasoning": 2}
    assert ParseReport.from_dict(total.to_dict()) == total


row_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["role", "content", "from", "value", "reasoning", "tool_calls", "messages", "prompt", "response"]),
        inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(row=st.dictionaries(st.sampled_from(["messages", "conversations", "prompt", "response", "tools", "x"]),
                           row_values, max_size=4))
def test_fuzz_never_crashes_never_mutates(row):
    before = copy.deepcopy(row)
    try:
        out = canonicalize_row(row)
        assert all(isinstance(m["content"], str) for m in out.messages)
    except RowRejected as rej:
        assert rej.reason and rej.detail
    assert row == before


_REPORT_DICT = st.fixed_dictionaries({}, optional={
    "schema": st.sampled_from(["messages", "sharegpt", "unknown", "alpaca"]), "rows": st.integers(0, 2),
    "tools_present": st.integers(0, 3), "unknown_roles": st.dictionaries(st.sampled_from("ab"), st.integers(1, 3)),
    "schemas": st.dictionaries(st.sampled_from(["messages", "alpaca"]), st.integers(1, 2))})


@settings(max_examples=200, deadline=None)
@given(dicts=st.lists(_REPORT_DICT, max_size=6))
def test_summing_report_dicts_in_place_equals_adding_reports(dicts):
    """The report sums the rows' JSON dicts in place (no object per row): the same as adding ParseReports."""
    expected = ParseReport.total(ParseReport.from_dict(d) for d in dicts).to_dict()
    assert ParseReport.total_of_dicts(dicts).to_dict() == expected
