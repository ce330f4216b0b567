"""One rule for content, in chat rows and preference pairs alike (docs/datasets.md#canonicalization-rules-chat-formats):
the same value in a user turn or an answer is the same text, or the same refusal, whether the row is an SFT row
or a pair. No tokenizer: the parse stage only."""

from __future__ import annotations

import pytest

from qlora_train.data.pairs import canonicalize_pair
from qlora_train.data.parse import canonicalize_row
from qlora_train.masking.messages import RowRejected

NAN = float("nan")
# a value -> the text it becomes, or the reason it is refused with in a user turn / in an answer
CASES = [
    ("plain", "plain", "plain"),
    (5, "5", "5"),
    (2.5, "2.5", "2.5"),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "ab", "ab"),
    ({"k": 1}, '{"k": 1}', '{"k": 1}'),
    (None, "empty_user_turn", "empty_assistant_turn|pair_empty_response"),
    ("", "empty_user_turn", "empty_assistant_turn|pair_empty_response"),
    (" \n", "empty_user_turn", "empty_assistant_turn|pair_empty_response"),
    (True, "bad_content_type", "bad_content_type"),
    (NAN, "bad_content_type", "bad_content_type"),
    (float("inf"), "bad_content_type", "bad_content_type"),
    ([{"type": "image"}], "bad_image", "bad_image"),  # an image part: no image to read (or not read: pairs)
]


def outcome(make, value, index: int) -> str:
    """The text of message ``index`` of what ``make(value)`` parses to, or the refusal's reason."""
    try:
        return make(value)[index]["content"]
    except RowRejected as rej:
        return rej.reason


def sft_user(value):
    return canonicalize_row({"messages": [{"role": "user", "content": value},
                                          {"role": "assistant", "content": "a"}]}).messages


def sft_prompt_column(value):
    return canonicalize_row({"prompt": value, "response": "a"}).messages


def sft_answer(value):
    return canonicalize_row({"messages": [{"role": "user", "content": "q"},
                                          {"role": "assistant", "content": value}]}).messages


def sft_response_column(value):
    return canonicalize_row({"prompt": "q", "response": value}).messages


def pair_prompt_message(value):
    return canonicalize_pair({"prompt": [{"role": "user", "content": value}], "chosen": "a", "rejected": "b"}).prompt


def pair_prompt_column(value):
    return canonicalize_pair({"prompt": value, "chosen": "a", "rejected": "b"}).prompt


def pair_answer(value):
    return canonicalize_pair({"prompt": "q", "chosen": [{"role": "assistant", "content": value}],
                              "rejected": "b"}).chosen


def pair_chosen_column(value):
    return canonicalize_pair({"prompt": "q", "chosen": value, "rejected": "b"}).chosen


@pytest.mark.parametrize(("value", "as_user", "as_answer"), CASES, ids=[repr(v) for v, *_ in CASES])
def test_a_content_value_means_the_same_in_chat_rows_and_pairs(value, as_user, as_answer):
    if value is None:  # a null side is a missing side (the column is absent in that row), not an empty answer
        assert outcome(pair_chosen_column, value, 0) == "pair_missing_side"
    # a list in a pair's prompt or side column is a message list (TRL's conversational form), unless text parts
    columns = not isinstance(value, list) or value[0].get("type") == "text"
    users = {f.__name__: outcome(f, value, 0) for f in (sft_user, sft_prompt_column, pair_prompt_message,
                                                        pair_prompt_column) if columns or f is not pair_prompt_column}
    assert users == dict.fromkeys(users, as_user)
    answers = {f.__name__: outcome(f, value, 1 if f.__name__.startswith("sft") else 0)
               for f in (sft_answer, sft_response_column, pair_answer, pair_chosen_column)
               if f is not pair_chosen_column or (columns and value is not None)}
    assert all(a in as_answer.split("|") for a in answers.values()), answers
    assert len({a.replace("pair_empty_response", "empty_assistant_turn") for a in answers.values()}) == 1, answers


def test_an_empty_user_turn_is_refused_in_a_pair_built_directly(qwen3_tok):
    from qlora_train.data.pairs import build_preference_example

    with pytest.raises(RowRejected) as err:
        build_preference_example([{"role": "user", "content": " "}], [{"role": "assistant", "content": "a"}],
                                 [{"role": "assistant", "content": "b"}], qwen3_tok)
    assert (err.value.reason, err.value.detail) == (
        "empty_user_turn", "prompt[0]: a user turn without content (nothing for a response to answer)")
