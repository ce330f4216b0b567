"""Preference pairs (issue 20, data side): every row format to the exact prompt / chosen / rejected; each side's
ids and labels equal to SFT's for the same conversation with only the response trained; the shared prompt, cut where
the response begins; refusals with their reasons, never a crash."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from qlora_train.data import DataConfig, build_preference_example, canonicalize_pair, process_rows
from qlora_train.masking import IGNORE_INDEX, RowRejected
from qlora_train.masking.policy import LossPolicy
from tests.masking.families import FAMILIES
from tests.masking.oracle import DECIDED, check_kept_row, pair_oracle
from tests.masking.test_family_masks import TOOLS as FAMILY_TOOLS
from tests.masking.test_family_masks import _call, _specials_removed, answer, upper

U = {"role": "user", "content": "What is 2+2?"}
A4 = {"role": "assistant", "content": "4"}
A5 = {"role": "assistant", "content": "5"}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}, "id": "c1"}]}
RESULT = {"role": "tool", "content": "4", "tool_call_id": "c1"}


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX])


def sft_side(tok, prompt, response, *, tools=None, **cfg) -> dict:
    """SFT's row for prompt + response with the prompt's messages marked untrained (the parse stage's per-message
    ``training`` flag): what a side of the pair must equal."""
    row = {"messages": [{**m, "training": False} for m in prompt] + response, **({"tools": tools} if tools else {})}
    out = process_rows([row], tok, DataConfig(max_length=8192, reasoning_history="drop", **cfg))
    assert out["drop_reason"] == [""], out["drop_detail"]
    return {k: v[0] for k, v in out.items()}


# ------------------------------------------------------------------------------------------ sides, by hand


def test_qwen3_pair_by_hand(qwen3_tok):
    ex = build_preference_example([U], [A4], [A5], qwen3_tok)
    prompt = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert qwen3_tok.decode(ex["chosen_input_ids"][:ex["prompt_length"]]) == prompt
    assert ex["chosen_input_ids"][:ex["prompt_length"]] == ex["rejected_input_ids"][:ex["prompt_length"]]
    assert trained_text(qwen3_tok, ex["chosen_input_ids"], ex["chosen_labels"]) == "<think>\n\n</think>\n\n4<|im_end|>"
    assert trained_text(qwen3_tok, ex["rejected_input_ids"], ex["rejected_labels"]) == (
        "<think>\n\n</think>\n\n5<|im_end|>")
    assert ex["chosen_labels"][:ex["prompt_length"]] == [IGNORE_INDEX] * ex["prompt_length"]
    assert (ex["boundary_merges"], ex["reasoning_dropped_turns"]) == (0, 0)
    assert ex["chosen_attention_mask"] == [1] * len(ex["chosen_input_ids"])


def test_multi_turn_prompt_and_tool_response_equal_sft(qwen3_tok):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"}, U]
    chosen = [{**CALL, "reasoning_content": "use the tool"}, RESULT, {"role": "assistant", "content": "It is 4."}]
    rejected = [{"role": "assistant", "content": "5", "reasoning_content": "guess"}]
    ex = build_preference_example(prompt, chosen, rejected, qwen3_tok, tools=TOOLS)
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        sft = sft_side(qwen3_tok, prompt, response, tools=TOOLS)
        assert ex[f"{side}_input_ids"] == sft["input_ids"]
        assert ex[f"{side}_labels"] == sft["labels"]
    trained = trained_text(qwen3_tok, ex["chosen_input_ids"], ex["chosen_labels"])
    assert trained == ('<think>\nuse the tool\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n'
                       "</tool_call><|im_end|><think>\n\n</think>\n\nIt is 4.<|im_end|>")
    assert "Hello." not in trained and "greet" not in trained and "Be brief." not in trained
    assert "use the tool" in trained and '"name": "add"' in trained and trained.endswith("It is 4.<|im_end|>")
    assert trained_text(qwen3_tok, ex["rejected_input_ids"], ex["rejected_labels"]) == (
        "<think>\nguess\n</think>\n\n5<|im_end|>")


@pytest.mark.parametrize(("policy", "chosen_trained"), [
    (LossPolicy(think_loss="answer_only"), "4<|im_end|>"),
    (LossPolicy(think_loss="answer_plus_think"), "r4<|im_end|>"),
    (LossPolicy(train_on_eos="none"), "<think>\nr\n</think>\n\n4"),
    # all: the end markers of the prompt's messages stay untrained (a prompt character is never trained)
    (LossPolicy(train_on_eos="all"), "<think>\nr\n</think>\n\n4<|im_end|>"),
    (LossPolicy(last_turn_only=True), "<think>\nr\n</think>\n\n4<|im_end|>"),
])
def test_policy_parts_of_the_response(qwen3_tok, policy, chosen_trained):
    ex = build_preference_example([U], [{**A4, "reasoning_content": "r"}], [A5], qwen3_tok, policy=policy)
    assert trained_text(qwen3_tok, ex["chosen_input_ids"], ex["chosen_labels"]) == chosen_trained


def test_the_boundary_is_a_cut_on_both_sides(family_tokenizers):
    # ChatML's header ends with "\n"; content " \nx" would make Qwen merge "\n \n" across the boundary on chosen
    # only: the render is cut where the response begins, so both sides keep the prompt's "\n" and train " \n"
    tok = family_tokenizers["chatml"]
    ex = build_preference_example([U], [{"role": "assistant", "content": " \nx"}],
                                  [{"role": "assistant", "content": "y"}], tok)
    n = ex["prompt_length"]
    assert tok.decode(ex["chosen_input_ids"][:n]) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n] and ex["boundary_merges"] == 0
    assert [tok.decode([i]) for i in ex["chosen_input_ids"][n:n + 2]] == [" \n", "x"]
    assert [tok.decode([i]) for i in ex["rejected_input_ids"][n:n + 1]] == ["y"]
    assert ex["chosen_labels"][n:n + 2] == ex["chosen_input_ids"][n:n + 2]  # the response's first token trained
    assert ex["rejected_labels"][n] == ex["rejected_input_ids"][n]
    for side, content in (("chosen", " \nx"), ("rejected", "y")):
        sft = sft_side(tok, [U], [{"role": "assistant", "content": content}])
        assert (ex[f"{side}_input_ids"], ex[f"{side}_labels"]) == (sft["input_ids"], sft["labels"])


# ------------------------------------------------------------------------------------------ refusals of a pair

CHATML_LOOP = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_prompt_rendered_by_what_follows_is_refused(qwen_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.chat_template = ("{% if messages|selectattr('role', 'equalto', 'tool')|list %}<|im_start|>system\nTools."
                         "<|im_end|>\n{% endif %}" + CHATML_LOOP)
    with pytest.raises(RowRejected) as err:
        build_preference_example([U], [A4, {"role": "tool", "content": "R"}, A5], [A5], tok)
    assert err.value.reason == "pair_prompt_differs"
    assert err.value.detail == ("the template renders the prompt differently for chosen and rejected (first "
                                "difference at char 12: 'system\\nTools.<|im_en' vs 'user\\nWhat is 2+2?<|i')")


def test_sides_the_template_renders_alike_are_identical(family_tokenizers):
    # the Llama 3 template trims content: "4" and " 4 " are the same tokens
    with pytest.raises(RowRejected) as err:
        build_preference_example([U], [A4], [{"role": "assistant", "content": " 4 "}], family_tokenizers["llama3"])
    assert (err.value.reason, err.value.detail) == ("pair_identical", "chosen and rejected render to the same tokens")


@pytest.mark.parametrize(("prompt", "chosen", "rejected", "reason", "detail"), [
    ([U], [A4], [dict(A4)], "pair_identical", "chosen and rejected are the same response"),
    ([U], [], [A5], "pair_empty_response", "chosen: no response"),
    ([U], [A4], [{"role": "assistant", "content": "  "}], "pair_empty_response",
     "rejected[0]: empty assistant turn"),
    ([U], [A4, U], [A5], "pair_bad_response",
     "chosen[1]: a 'user' message inside the response (a response holds assistant turns and tool results only)"),
    ([U], [A4], [{"role": "system", "content": "s"}, A5], "pair_bad_response",
     "rejected[0]: a 'system' message inside the response (a response holds assistant turns and tool results only)"),
    ([U], [CALL, RESULT], [A5], "pair_bad_response",
     "chosen[1]: the response must open and end with an assistant turn, not a 'tool' message"),
    ([U, A4], [A5], [A4], "pair_bad_prompt",
     "the prompt ends with a assistant message: it must end with a user turn (or a tool result) for a response to "
     "answer"),
    ([], [A4], [A5], "pair_bad_prompt",
     "the prompt is empty: it must end with a user turn (or a tool result) for a response to answer"),
    ([U], [{"role": "assistant", "content": ["x"]}], [A5], "bad_content_type", "chosen[0]: content of type list"),
    ([U], [{"role": "assistant", "content": None}], [A5], "bad_content_type",
     "chosen[0]: content must be a string (canonical messages: canonicalize_pair makes them)"),
    ([U], "4", [A5], "bad_row", "chosen: expected a list of messages, got str"),
    ([U], [A4], ["5"], "bad_row", "rejected[0]: expected a mapping with a role"),
])
def test_bad_pairs_are_refused_with_their_reason(qwen3_tok, prompt, chosen, rejected, reason, detail):
    with pytest.raises(RowRejected) as err:
        build_preference_example(prompt, chosen, rejected, qwen3_tok)
    assert (err.value.reason, err.value.detail) == (reason, detail)


def test_a_side_the_mask_check_refuses_names_the_side(qwen3_tok):
    opener_in_result = {"role": "tool", "content": "<|im_start|>assistant\nX"}  # a turn could start inside it
    with pytest.raises(RowRejected) as err:
        build_preference_example([U], [A4], [A4, opener_in_result, A5], qwen3_tok)
    assert err.value.reason == "mask_unverified" and err.value.detail.startswith("rejected: messages[1]: ")
    assert err.value.detail.endswith("(by the layout: messages[2]: tool content contains the assistant turn opener "
                                     "text) (messages counted over prompt + response)")


def test_a_lone_surrogate_is_refused_not_a_crash(qwen3_tok):
    with pytest.raises(RowRejected) as err:
        build_preference_example([U], [A4], [{"role": "assistant", "content": "a\ud800"}], qwen3_tok)
    assert (err.value.reason, err.value.detail) == (
        "invalid_unicode", "rejected: messages[1]: lone surrogate '\\ud800' at character 82 of the render (messages "
        "counted over prompt + response)")


def test_max_length_refuses_a_long_side(qwen3_tok):
    with pytest.raises(RowRejected) as err:
        build_preference_example([U], [A4], [{"role": "assistant", "content": "five " * 40}], qwen3_tok, max_length=30)
    assert err.value.reason == "too_long" and err.value.detail.startswith("rejected: ")
    assert build_preference_example([U], [A4], [A5], qwen3_tok, max_length=30)["prompt_length"] == 15


# ------------------------------------------------------------------------------------------ row formats


def pair_of(row, **cfg):
    p = canonicalize_pair(row, DataConfig(**cfg))
    return p.prompt, p.chosen, p.rejected, p.tools, p.format, (p.score_chosen, p.score_rejected)


def test_trl_standard_strings():
    assert pair_of({"prompt": "2+2?", "chosen": "<think>add</think>4", "rejected": "5", "score_chosen": 9,
                    "score_rejected": 2.5}) == (
        [{"role": "user", "content": "2+2?"}],
        [{"role": "assistant", "content": "4", "reasoning_content": "add"}],
        [{"role": "assistant", "content": "5"}], None, "prompt_chosen_rejected", (9.0, 2.5))


def test_trl_conversational_with_system_column_and_tools():
    row = {"prompt": [{"role": "user", "content": "Add 2"}], "system": "S",
           "chosen": [{"role": "assistant", "content": None, "tool_calls": [
               {"function": {"name": "add", "arguments": '{"a": 2}'}, "id": "c1"}]},
                      {"role": "tool", "content": "2", "tool_call_id": "c1"},
                      {"role": "assistant", "content": "2"}],
           "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "no"}]}],
           "tools": '[{"type": "function", "function": {"name": "add"}}]'}
    assert pair_of(row) == (
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Add 2"}],
        [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}, "id": "c1"}]},
         {"role": "tool", "content": "2", "tool_call_id": "c1"}, {"role": "assistant", "content": "2"}],
        [{"role": "assistant", "content": "no"}],
        [{"type": "function", "function": {"name": "add"}}], "prompt_chosen_rejected", (None, None))


def test_prompt_messages_with_their_own_system_keep_it():
    row = {"prompt": [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}], "system": "column",
           "chosen": "a", "rejected": "b"}
    assert pair_of(row)[0] == [{"role": "system", "content": "mine"}, {"role": "user", "content": "q"}]
    # the column is read in one place for every schema (parse.with_row_system): the conflict is counted
    assert canonicalize_pair(row).report.system_column_conflicts == 1


def test_implicit_prompt_ultrafeedback_style():
    row = {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}],
           "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "bad"}]}
    assert pair_of(row) == ([{"role": "user", "content": "q"}], [{"role": "assistant", "content": "good"}],
                            [{"role": "assistant", "content": "bad"}], None, "implicit_prompt", (None, None))


def test_ultrafeedback_binarized_prompt_column_repeated_in_whole_conversations():
    # the shape of HuggingFaceH4/ultrafeedback_binarized: a prompt string and whole conversations opening with it
    chosen = [{"role": "user", "content": "q "}, {"role": "assistant", "content": "good"}]
    rejected = [{"role": "user", "content": "q "}, {"role": "assistant", "content": "bad"}]
    row = {"prompt": "q ", "prompt_id": "ab12", "chosen": chosen, "rejected": rejected, "messages": chosen,
           "score_chosen": 8.0, "score_rejected": 3.5}
    expected = ([{"role": "user", "content": "q "}], [{"role": "assistant", "content": "good"}],
                [{"role": "assistant", "content": "bad"}], None, "implicit_prompt", (8.0, 3.5))
    assert pair_of(row) == expected
    assert pair_of({**row, "prompt": "q"}) == expected  # whitespace at the ends aside: the conversation's turn
    assert pair_of({**row, "prompt": [{"role": "user", "content": "q "}]}) == expected  # a message-list prompt
    # a system turn before the user turn: the string is the first user turn's content, the system stays in
    system = {"role": "system", "content": "s"}
    prompt, *_ = pair_of({**row, "chosen": [system, *chosen], "rejected": [system, *rejected]})
    assert prompt == [system, {"role": "user", "content": "q "}]


def test_a_side_that_is_a_number_or_text_parts_is_its_text_as_in_sft_rows():
    from qlora_train.data.parse import canonicalize_row

    assert pair_of({"prompt": 6, "chosen": 42, "rejected": [{"type": "text", "text": "41"}]})[:3] == (
        [{"role": "user", "content": "6"}], [{"role": "assistant", "content": "42"}],
        [{"role": "assistant", "content": "41"}])
    assert [m["content"] for m in canonicalize_row({"prompt": 6, "response": 42}).messages] == ["6", "42"]


def test_implicit_prompt_keeps_a_shared_tool_call_and_sharegpt_roles():
    call = {"from": "gpt", "value": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2}}}]}
    shared = [{"from": "human", "value": "q"}, call, {"from": "observation", "value": "4"}]
    row = {"chosen": [*shared, {"from": "gpt", "value": "four"}], "rejected": [*shared, {"from": "gpt", "value": "5"}]}
    prompt, chosen, rejected, *_ = pair_of(row)
    assert [m["role"] for m in prompt] == ["user", "assistant", "tool"] and prompt[2]["content"] == "4"
    assert (chosen, rejected) == ([{"role": "assistant", "content": "four"}], [{"role": "assistant", "content": "5"}])


def test_implicit_prompt_walks_back_to_an_assistant_turn_on_both_sides():
    # shared: user, call; then the tool results differ: the prompt is the user turn, each response from its call
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    row = {"chosen": [{"role": "user", "content": "q"}, call, {"role": "tool", "content": "A"},
                      {"role": "assistant", "content": "a"}],
           "rejected": [{"role": "user", "content": "q"}, call, {"role": "tool", "content": "B"},
                        {"role": "assistant", "content": "b"}]}
    prompt, chosen, rejected, *_ = pair_of(row)
    assert prompt == [{"role": "user", "content": "q"}]
    assert [m["role"] for m in chosen] == [m["role"] for m in rejected] == ["assistant", "tool", "assistant"]
    assert (chosen[1]["content"], rejected[1]["content"]) == ("A", "B")


def test_hh_rlhf_transcripts():
    row = {"chosen": "\n\nHuman: Hi?\n\nAssistant: Hello!\n\nHuman: And now?\n\nAssistant: Still here.",
           "rejected": "\n\nHuman: Hi?\n\nAssistant: Hello!\n\nHuman: And now?\n\nAssistant: Go away."}
    assert pair_of(row) == (
        [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "And now?"}],
        [{"role": "assistant", "content": "Still here."}], [{"role": "assistant", "content": "Go away."}],
        None, "hh_rlhf", (None, None))


def test_instruction_form_with_input_and_system():
    row = {"instruction": "Translate", "input": "chat", "chosen": "cat", "rejected": "dog", "system": "S"}
    assert pair_of(row) == ([{"role": "system", "content": "S"}, {"role": "user", "content": "Translate\n\nchat"}],
                            [{"role": "assistant", "content": "cat"}], [{"role": "assistant", "content": "dog"}],
                            None, "instruction", (None, None))


def test_field_mappings_apply():
    row = {"question_text": "q", "good": "a", "bad": "b"}
    assert pair_of(row, field_mappings={"prompt": "question_text", "chosen": "good", "rejected": "bad"})[:3] == (
        [{"role": "user", "content": "q"}], [{"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "b"}])


MAP_HINT = ("; columns named otherwise are mapped with data.field_mappings, e.g. {chosen: good, rejected: bad} "
            "(docs/preference.md#columns-named-otherwise-datafield_mappings)")


@pytest.mark.parametrize(("row", "reason", "detail"), [
    ({"prompt": "q", "chosen": "a"}, "pair_missing_side",
     "a preference row needs 'chosen' and 'rejected'; it has chosen (keys ['chosen', 'prompt'])" + MAP_HINT),
    ({"prompt": "q", "chosen": None, "rejected": None}, "pair_missing_side",
     "a preference row needs 'chosen' and 'rejected'; it has neither, and 'chosen' and 'rejected' are null (keys "
     "['chosen', 'prompt', 'rejected'])" + MAP_HINT),
    ({"prompt": "q", "chosen": "a", "rejected": None}, "pair_missing_side",
     "a preference row needs 'chosen' and 'rejected'; it has chosen, and 'rejected' is null (keys ['chosen', "
     "'prompt', 'rejected'])" + MAP_HINT),
    ({"prompt": "q", "completion": "a", "label": True}, "unpaired_preference",
     "an unpaired preference row (prompt, completion, label): train.method: kto trains it (data.objective: "
     "unpaired); dpo and orpo need a chosen and a rejected response to the same prompt"),
    ({"prompt": "q", "chosen": True, "rejected": "b"}, "bad_content_type", "chosen: messages[0]: content of type bool"),
    ({"prompt": "q", "chosen": float("nan"), "rejected": "b"}, "bad_content_type",
     "chosen: messages[0]: content nan is not a finite number"),
    ({"prompt": [{"role": "user", "content": None}], "chosen": "a", "rejected": "b"}, "empty_user_turn",
     "prompt: messages[0]: a user turn without content (nothing for a response to answer)"),
    ({"prompt": None, "chosen": "a", "rejected": "b"}, "empty_user_turn",
     "prompt: messages[0]: a user turn without content (nothing for a response to answer)"),
    ({"chosen": "\n\nHuman:  \n\nAssistant: a", "rejected": "\n\nHuman:\n\nAssistant: b"}, "empty_user_turn",
     "chosen: messages[0]: a user turn without content (nothing for a response to answer)"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}, "pair_prompt_differs",
     "chosen is a whole conversation that does not open with the row's prompt: its first user turn is 'other', the "
     "prompt 'q'"),
    ({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
      "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}, "pair_prompt_differs",
     "chosen is a whole conversation that does not open with the row's prompt: its first 2 messages are not the "
     "prompt's 2 messages"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": True}], "rejected": "b"}, "bad_content_type",
     "chosen: messages[0]: content of type bool"),
    ({"prompt": "q", "chosen": "", "rejected": "b"}, "pair_empty_response", "chosen[0]: empty assistant turn"),
    ({"prompt": "q", "chosen": [], "rejected": "b"}, "pair_empty_response", "chosen: no response"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "pair_identical", "chosen and rejected are the same response"),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "more?"}]}, "pair_bad_response",
     "rejected[1]: a 'user' message inside the response (a response holds assistant turns and tool results only)"),
    ({"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
     "pair_prompt_differs", "chosen and rejected share no messages that both continue with an assistant turn: "
                            "there is no common prompt"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "q"}]},
     "pair_identical", "chosen and rejected are the same conversation"),
    ({"chosen": "a", "rejected": "b"}, "unknown_schema",
     "'chosen' and 'rejected' without a prompt must be whole conversations (message lists) or HH-RLHF transcripts "
     "('\\n\\nHuman: …\\n\\nAssistant: …'); got str and str (keys ['chosen', 'rejected'])"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "score_chosen": "high"}, "bad_row",
     "score_chosen: expected a finite number, got 'high'"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "score_rejected": float("nan")}, "bad_row",
     "score_rejected: expected a finite number, got nan"),
    ({"prompt": ["q"], "chosen": "a", "rejected": "b"}, "bad_row",
     "prompt: messages[0]: expected a mapping, got str"),
    (["not", "a", "mapping"], "bad_row", "row is a list, not a mapping"),
])
def test_bad_rows_are_refused_with_their_reason(row, reason, detail):
    with pytest.raises(RowRejected) as err:
        canonicalize_pair(row)
    assert (err.value.reason, err.value.detail) == (reason, detail)


def test_every_format_builds_on_qwen3(qwen3_tok):
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"},
            {"instruction": "Add", "input": "2 and 2", "chosen": "4", "rejected": "5"},
            {"chosen": [U, A4], "rejected": [U, A5]},
            {"chosen": "\n\nHuman: What is 2+2?\n\nAssistant: 4",
             "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: 5"}]
    for row in rows:
        p = canonicalize_pair(row)
        ex = build_preference_example(p.prompt, p.chosen, p.rejected, qwen3_tok, tools=p.tools)
        assert trained_text(qwen3_tok, ex["chosen_input_ids"], ex["chosen_labels"]).endswith("4<|im_end|>"), row



# ------------------------------------------------------------------------------------------ every family, random pairs
# Every family template (tests/masking/family_templates/), its markers as tokens on the real Qwen and the real Llama 3
# vocabularies. Prompt text (system, user, the prompt's own assistant turns) and tool results are upper-case, response
# text lower-case: "no prompt character is trained" == "no upper-case letter is trained" (markers removed first).
# Each side must equal SFT's row for the same conversation with the prompt marked untrained, ids and labels, and the
# prefix-render oracle's trained tokens of the response's turns where it decides; a refusal must be SFT's own on that
# side, two sides with the same ids, or a prompt whose untrained tokens differ beyond one boundary token.
VOCABS = ("qwen", "llama3")
PAIR_PROPS = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(scope="module")
def family_tok(family_vocab_tokenizer):
    """(family, "qwen" | "llama3") -> the family's tokenizer on that real vocabulary, its markers as tokens."""
    return lambda name, vocab: family_vocab_tokenizer(name, "qwen+tok" if vocab == "qwen" else "llama3+tok")


@st.composite
def random_pairs(draw, fam):
    prompt = []
    if fam.supports_system and draw(st.booleans()):
        prompt.append({"role": "system", "content": draw(upper)})
    for _ in range(draw(st.integers(0, 1))):
        prompt += [{"role": "user", "content": draw(upper)}, {"role": "assistant", "content": draw(upper)}]
    prompt.append({"role": "user", "content": draw(upper)})

    def response(k: int) -> list[dict]:
        msgs = []
        if fam.supports_tools and draw(st.integers(0, 2)) == 0:
            call = _call(k, fam.tool_arguments_as_string)
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": draw(upper), "tool_call_id": call["id"]}]
        m = {"role": "assistant", "content": draw(answer)}
        if draw(st.booleans()):
            m["reasoning_content"] = draw(answer)
        return [*msgs, m]

    return prompt, response(0), response(1)


def sft_or_refusal(tok, prompt, response, tools):
    row = {"messages": [{**m, "training": False} for m in prompt] + response, **({"tools": tools} if tools else {})}
    out = process_rows([row], tok, DataConfig(max_length=8192, reasoning_history="drop"))
    return {k: v[0] for k, v in out.items()}


def check_pair_properties(tok, fam, prompt, chosen, rejected):
    tools = FAMILY_TOOLS if any(m.get("tool_calls") for m in chosen + rejected) else None
    sft = {side: sft_or_refusal(tok, prompt, r, tools) for side, r in (("chosen", chosen), ("rejected", rejected))}
    try:
        ex = build_preference_example(prompt, chosen, rejected, tok, tools=tools)
    except RowRejected as rej:  # refused only where SFT refuses that side too, or the pair itself is wrong
        ids = {side: out["input_ids"] for side, out in sft.items()}
        if rej.reason == "pair_identical":
            assert ids["chosen"] == ids["rejected"]
        elif rej.reason == "pair_prompt_differs":  # more than one token before a side's response is not shared
            shared = len(os.path.commonprefix([ids["chosen"], ids["rejected"]]))
            untrained = [next(k for k, lab in enumerate(out["labels"]) if lab != IGNORE_INDEX) for out in sft.values()]
            assert max(untrained) - shared > 1, (rej, untrained, shared)
        else:
            side = rej.detail.split(":")[0]
            assert sft[side]["drop_reason"] == rej.reason, (rej, sft[side]["drop_detail"])
        return rej.reason
    n = ex["prompt_length"]
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n] and n > 0
    assert ex["boundary_merges"] == 0  # each side is cut where its response begins: no token crosses the boundary
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        assert not sft[side]["drop_reason"], sft[side]["drop_detail"]
        if ids != sft[side]["input_ids"]:  # a side that starts after the pair's prompt ends (it writes more of the
            # generation prompt's text: an empty block it pre-fills) is cut there too: its own text and trained tokens
            assert tok.decode(ids) == tok.decode(sft[side]["input_ids"])
            assert trained_text(tok, ids, labels) == trained_text(tok, sft[side]["input_ids"], sft[side]["labels"])
        else:
            assert labels == sft[side]["labels"]  # exactly SFT's side
        assert all(lab == IGNORE_INDEX for lab in labels[:n])  # the prompt never trained
        trained = trained_text(tok, ids, labels)
        assert not any(c.isupper() for c in _specials_removed(trained, tok, fam)), trained
        flat = "".join(trained.split())
        for m in response:
            if m["role"] == "assistant" and m["content"].strip():
                assert "".join(m["content"].split()) in flat
        verdict = pair_oracle(tok, prompt, {"chosen": chosen, "rejected": rejected}, tools=tools,
                              end_markers=fam.end_markers)[side]
        if verdict.kind == DECIDED:  # the rule's verdict on the response's turns, token by token
            check = check_kept_row(tok, verdict, prompt + response, ids, [lab != IGNORE_INDEX for lab in labels])
            assert not check.text_differs and (check.wrong, check.missed) == (0, 0), (check, verdict.reason)
    return "built"


# every family on both vocabularies: make test (CI) runs all of them; make test-fast two (tool calls, reasoning and
# a system prompt, one on each vocabulary)
FAST_FAMILIES = {("mistral-v7", "qwen"), ("gpt-oss", "llama3")}


@pytest.mark.parametrize(("name", "vocab"), [
    pytest.param(name, vocab, id=f"{name}-{vocab}", marks=() if (name, vocab) in FAST_FAMILIES else pytest.mark.slow)
    for name in sorted(FAMILIES) for vocab in VOCABS])
def test_property_pairs_on_every_family(family_tok, name, vocab):
    tok, fam = family_tok(name, vocab), FAMILIES[name]

    outcomes = []

    @PAIR_PROPS
    @given(pair=random_pairs(fam))
    def run(pair):
        outcomes.append(check_pair_properties(tok, fam, *pair))
    run()
    assert "built" in outcomes, outcomes  # (Falcon3 refuses a tool-call response beside a plain answer: docs)
