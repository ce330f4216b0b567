"""The prefix-render oracle (tests/masking/oracle.py) against layouts written by hand.

The oracle reads no fact from the engine, so the mask tests and the mask audit can
judge the engine by it; here it is judged itself: on every family's ``EXAMPLE`` it
gives the trained turns written by hand in families.py, and on the new layouts'
tool conversations the generated parts issue 24 describes. Templates are rendered
on a one-token stand-in vocabulary (the oracle only renders; no tokens involved).
"""

from __future__ import annotations

import pytest

from tests.masking.families import FAMILIES, example_messages
from tests.masking.oracle import (
    DECIDED,
    REFUSE,
    UNDECIDED,
    char_mask,
    located_messages,
    prefix_oracle,
    token_mask,
    trained_text,
)

# not prefix-stable on EXAMPLE: harmony ends the last answer with <|return|>, an earlier one with <|end|>; Mistral v3
# and Tekken write the system prompt in the last user turn only; open-think-prompt gives only the last answer its
# <think> block
UNSTABLE_EXAMPLE = {"gpt-oss", "mistral-v3", "mistral-tekken", "open-think-prompt"}


def renderer(name: str):
    """A tokenizer that renders with the family's template (bos/eos as the family's), on a one-token vocabulary."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[name]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.bos_token, tok.eos_token = fam.bos_token, fam.eos_token
    tok.chat_template = fam.template_text
    return tok


def verdict(name: str, messages, tools=None):
    fam = FAMILIES[name]
    return prefix_oracle(renderer(name), messages, tools=tools, end_markers=fam.end_markers)


def spans_text(v) -> list[str]:
    return [v.text[a:b] for a, b in v.spans]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_oracle_gives_the_turns_written_by_hand(name):
    v = verdict(name, example_messages(name))
    if name in UNSTABLE_EXAMPLE:
        assert v.kind == UNDECIDED, v
    else:
        assert v.kind == DECIDED, v.reason
        assert spans_text(v) == list(FAMILIES[name].example_turns)


TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def tool_row(*, content: str = "", reasoning: str | None = None, follow_up: bool = False) -> list[dict]:
    call = {"role": "assistant", "content": content, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 623, "b": 597}}, "id": "call00001"}]}
    if reasoning:
        call["reasoning_content"] = reasoning
    msgs = [{"role": "user", "content": "Please add 623 and 597."}, call,
            {"role": "tool", "content": "1220", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "it is 1220."}]
    return msgs + [{"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "welcome."}] * follow_up


CALL = '{"name": "add", "arguments": {"a": 623, "b": 597}}'


def test_a_call_in_a_block_of_its_own_after_the_end_is_generated_with_it():
    v = verdict("call-block-after-end", tool_row(), TOOLS)
    assert spans_text(v) == [f"<|msg_end|>\n\ntool call<|role_end|>\n{CALL}<|msg_end|>", "it is 1220.<|msg_end|>"]


def test_results_inside_the_assistant_block_split_it_into_call_and_answer():
    v = verdict("results-inside-assistant", tool_row(follow_up=True), TOOLS)
    assert spans_text(v) == [f"<|call_begin|>[{CALL}]<|call_end|>", "it is 1220.<|stop|>", "welcome."]
    assert "1220\n" in v.text  # the result, inside the block, untrained


def test_structured_elements_train_after_the_think_element_the_prompt_opens():
    v = verdict("structured-elements", tool_row(reasoning="sum them"), TOOLS)
    assert v.kind == DECIDED
    call_turn, answer = spans_text(v)  # the generation prompt writes the opener '<|el|>think<|gt|>': prompt
    assert call_turn == ("sum them<|/el|>think<|gt|><|el|>response<|gt|><|/el|>response<|gt|>"
                         f"<|el|>tools<|gt|>[{CALL}]<|/el|>tools<|gt|><|/el|>message<|gt|><|turn_done|>")
    assert answer.startswith("<|/el|>think<|gt|>") and answer.endswith("<|turn_done|>")


def test_a_preamble_only_the_generation_prompt_writes_is_never_trained():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "b"}]
    v = verdict("prompt-not-in-render", msgs)
    assert spans_text(v) == ["r\n[[ANSWER]]\na<|/msg|>", "b"]
    assert "Let me work through this." not in v.text


def test_the_header_appended_after_every_render_is_never_trained():
    msgs = example_messages("llama3-original")
    v = verdict("llama3-original", msgs)
    assert v.text.endswith("Rome.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert trained_text(v).endswith("Rome.<|eot_id|>")


def test_a_call_the_template_does_not_write_refuses_the_row_even_when_the_user_writes_its_name():
    v = verdict("llama3-original", tool_row(), TOOLS)
    assert v.kind == REFUSE and "messages[1]: tool call 'add'" in v.reason


def test_content_the_template_leaves_out_refuses_the_row():
    v = verdict("deepseek-r1", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "x</think>a"}])
    assert v.kind == REFUSE and "content" in v.reason  # R1 cuts everything up to </think>


def test_a_template_that_raises_refuses_the_row():
    v = verdict("vicuna", tool_row(), TOOLS)
    assert v.kind == REFUSE and "raises" in v.reason


def test_a_system_prompt_written_elsewhere_leaves_the_row_undecided():
    v = verdict("mistral-v3", example_messages("mistral-v3"))
    assert v.kind == UNDECIDED and "messages[2]" in v.reason


def test_the_first_character_rule():
    # "ab|cde|f" with "cd" trained: the token starting at c is trained, the one starting at f is not
    mask = char_mask("abcdef", [(2, 4)])
    assert token_mask([(0, 2), (2, 5), (5, 6)], mask) == [False, True, False]
    assert token_mask([(1, 3), (3, 3)], mask) == [False, False]  # an empty token is never trained


def test_located_messages_in_order():
    msgs = [{"role": "user", "content": " add "}, {"role": "assistant", "content": "add"},
            {"role": "user", "content": "missing"}]
    assert located_messages("U: add A: add", msgs) == [(0, 3, 6), (1, 10, 13)]
