"""Prompt rows (GRPO, ``data.objective: prompt``): the row shapes, what is refused and why, the prompt's ids (the
render with the generation prompt, as ``apply_chat_template`` tokenizes it), the reward columns, truncation, and the
dataset's counts; the real Qwen vocabulary."""

from __future__ import annotations

import json

import pytest

from qlora_train.config import Config, DataConfig, DatasetSource
from qlora_train.data.dataset import WrongRowsError, build_datasets
from qlora_train.data.drops import DropReason
from qlora_train.data.pipeline import process_rows
from qlora_train.data.prompts import canonicalize_prompt, fit_prompt
from qlora_train.masking import RowRejected, render_prompt

SYSTEM = {"role": "system", "content": "Be brief."}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
GOOD = [  # every shape of a prompt row, the answer beside it
    {"prompt": "What is 2 + 2?", "answer": "4"},
    {"prompt": [SYSTEM, {"role": "user", "content": "Capital of Peru?"}], "answer": "Lima", "tools": [WEATHER]},
    {"instruction": "Add the numbers.", "input": "3 and 4", "answer": "7"},
    {"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                                         {"role": "user", "content": "Colour of the sky?"}], "answer": "blue"},
    {"conversations": [{"from": "human", "value": "Name a fruit."}], "tests": [1, 2]},
]


def test_each_shape_reads_its_prompt_and_keeps_the_other_columns_for_the_rewards():
    rows = [canonicalize_prompt(r) for r in GOOD]
    assert [r.format for r in rows] == ["prompt", "prompt", "instruction", "messages", "messages"]
    assert rows[0].prompt == [{"role": "user", "content": "What is 2 + 2?"}]
    assert rows[1].prompt[0] == SYSTEM and rows[1].tools == [WEATHER]
    assert rows[2].prompt == [{"role": "user", "content": "Add the numbers.\n\n3 and 4"}]
    assert [m["role"] for m in rows[3].prompt] == ["system", "user", "assistant", "user"]
    assert rows[4].prompt == [{"role": "user", "content": "Name a fruit."}]
    # the prompt's own column (prompt, or the message list it was read from) is the rewards' `prompts`
    assert [r.columns for r in rows] == [{"answer": "4"}, {"answer": "Lima", "tools": [WEATHER]},
                                         {"instruction": "Add the numbers.", "input": "3 and 4", "answer": "7"},
                                         {"system": "Be brief.", "answer": "blue"}, {"tests": [1, 2]}]


@pytest.mark.parametrize(("row", "reason", "detail"), [
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     DropReason.PROMPT_ENDS_WITH_ASSISTANT, "messages[1]: the prompt ends with an assistant turn"),
    ({"prompt": ""}, DropReason.EMPTY_USER_TURN, "prompt: messages[0]: a user turn without content"),
    ({"question_text": "Hi?"}, DropReason.UNKNOWN_SCHEMA, "a prompt row (train.method: grpo) needs 'prompt'"),
    ({"prompt": "Hi", "completions": "x"}, DropReason.BAD_ROW, "column 'completions' has the name of an argument"),
    ({"prompt": "Hi", "images": ["a.png"]}, DropReason.BAD_IMAGE, "column 'images': images in prompt rows"),
])
def test_what_is_refused(row, reason, detail):
    with pytest.raises(RowRejected) as exc:
        canonicalize_prompt(row)
    assert exc.value.reason == reason and exc.value.detail.startswith(detail), exc.value.detail


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gemma", "chatml"])
def test_the_ids_are_the_generation_prompt_render_tokenized_as_at_inference(family_tokenizers, family):
    """What a sampler continues: ``apply_chat_template(..., add_generation_prompt=True)`` tokenized in one piece;
    the generation prompt is what that render adds to the conversation's own."""
    tok = family_tokenizers[family]
    for row in GOOD[:4]:
        canon = canonicalize_prompt({k: v for k, v in row.items() if k != "tools"})  # gemma's has none
        got = render_prompt(canon.prompt, tok, tools=canon.tools)
        text = tok.apply_chat_template(canon.prompt, tools=canon.tools, add_generation_prompt=True, tokenize=False)
        own = tok.apply_chat_template(canon.prompt, tools=canon.tools, tokenize=False)
        assert got.text == text
        assert got.input_ids == tok(text, add_special_tokens=False)["input_ids"]
        assert text.startswith(own) and got.generation_prompt == text[len(own):]
        assert tok.decode(got.input_ids[-got.generation_prompt_tokens:]) == got.generation_prompt


def test_qwen3s_generation_prompt_by_hand(qwen3_tok):
    got = render_prompt([{"role": "user", "content": "2+2?"}], qwen3_tok)
    assert qwen3_tok.convert_ids_to_tokens(got.input_ids) == [
        "<|im_start|>", "user", "Ċ", "2", "+", "2", "?", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    assert (got.generation_prompt, got.generation_prompt_tokens) == ("<|im_start|>assistant\n", 3)


def test_a_long_prompt_loses_middle_exchanges_then_is_too_long(qwen3_tok):
    turns = [SYSTEM]
    for i in range(3):
        turns += [{"role": "user", "content": f"question {i} " * 10}, {"role": "assistant", "content": "ok " * 10}]
    turns.append({"role": "user", "content": "last"})
    canon = canonicalize_prompt({"messages": turns})
    whole = render_prompt(canon.prompt, qwen3_tok).num_tokens
    fitted = fit_prompt(canon, qwen3_tok, max_prompt_length=whole - 1)
    assert fitted.dropped_turns == 1 and fitted.prompt.num_tokens < whole and fitted.tokens_before == whole
    assert [m["content"] for m in fitted.messages][1].startswith("question 1")  # the oldest exchange went first
    with pytest.raises(RowRejected, match="too_long|max_prompt_length"):
        fit_prompt(canon, qwen3_tok, max_prompt_length=10)
    with pytest.raises(RowRejected, match=r"data.on_too_long: drop"):
        fit_prompt(canon, qwen3_tok, max_prompt_length=whole - 1, on_too_long="drop")


def test_the_pipeline_columns(qwen3_tok):
    out = process_rows([*GOOD, {"prompt": [{"role": "assistant", "content": "x"}]}], qwen3_tok,
                       DataConfig(objective="prompt"))
    assert out["drop_reason"] == ["", "", "", "", "", DropReason.PROMPT_ENDS_WITH_ASSISTANT]
    assert json.loads(out["prompt"][0]) == [{"role": "user", "content": "What is 2 + 2?"}]
    assert json.loads(out["reward_columns"][4]) == {"tests": [1, 2]}
    assert out["num_trained_tokens"] == [0] * 6 and out["generation_prompt_tokens"][:5] == [3] * 5
    assert out["num_tokens"][0] == len(out["input_ids"][0]) == 16


def test_grpo_sets_the_objective_and_the_prompts_limit():
    cfg = Config.model_validate({"model": {"name_or_path": "x"}, "data": {"max_length": 512},
                                 "train": {"method": "grpo"}, "rl": {"rewards": [{"function": "a.b:c"}],
                                                                     "max_completion_length": 100}})
    assert (cfg.data.objective, cfg.data.max_prompt_length) == ("prompt", 412)


def test_rows_that_all_end_with_an_assistant_turn_are_a_usage_error(qwen3_tok, tmp_path):
    """SFT conversations given to GRPO: one line saying so, exit 2 (not every row dropped, exit 1)."""
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                                        {"role": "assistant", "content": "a"}]}) for i in range(3)))
    cfg = DataConfig(objective="prompt", datasets=[DatasetSource(path=str(path))])
    with pytest.raises(WrongRowsError) as exc:
        build_datasets(cfg, qwen3_tok)
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)
    assert str(exc.value).startswith("all 3 rows were dropped (prompt_ends_with_assistant): every prompt ends with "
                                     "an assistant turn: these are SFT conversations")


# --- an agent run (rl.tools): every prompt rendered with the tools' schemas where prompt rows are prepared ---

CALCULATOR = "qlora_train.rl.calculator:calculate"


def test_agent_prompts_are_rendered_with_the_tools_schemas_and_counted_by_their_limit(qwen3_tok):
    from qlora_train.data.prompts import tool_schemas

    [schema] = tool_schemas((CALCULATOR,))
    user = [{"role": "user", "content": "What is 6 * 7?"}]
    bare, with_tools = render_prompt(user, qwen3_tok), render_prompt(user, qwen3_tok, tools=[schema])
    assert with_tools.num_tokens > bare.num_tokens + 50  # the schema is in the system turn
    rows = [{"prompt": "What is 6 * 7?"}, {"prompt": "What is 6 * 7?", "tools": [WEATHER]}]
    out = process_rows(rows, qwen3_tok, DataConfig(objective="prompt", prompt_tools=[CALCULATOR]))
    assert out["drop_reason"] == ["", DropReason.TOOLS_BESIDE_RL_TOOLS]
    assert out["input_ids"][0] == with_tools.input_ids and out["num_tokens"][0] == with_tools.num_tokens
    assert "column 'tools': the row gives its own tools" in out["drop_detail"][1]
    # the limit counts the schemas: a prompt that fits without them is too long with them
    out = process_rows(rows[:1], qwen3_tok, DataConfig(objective="prompt", prompt_tools=[CALCULATOR],
                                                       max_prompt_length=with_tools.num_tokens - 1))
    assert out["drop_reason"] == [DropReason.TOO_LONG]


def test_an_agent_prompt_the_template_refuses_with_the_tools_is_dropped_and_counted(qwen3_tok):
    import copy

    tok = copy.deepcopy(qwen3_tok)
    tok.chat_template = ("{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
                         + qwen3_tok.chat_template)
    out = process_rows([{"prompt": "Hi"}], tok, DataConfig(objective="prompt", prompt_tools=[CALCULATOR]))
    assert out["drop_reason"] == [DropReason.TEMPLATE_ERROR] and "no tools here" in out["drop_detail"][0]
    assert process_rows([{"prompt": "Hi"}], tok, DataConfig(objective="prompt"))["drop_reason"] == [""]


def test_grpo_with_tools_decides_the_prompts_tools_once():
    def cfg(**data):
        return Config.model_validate({"model": {"name_or_path": "x"}, "data": {"max_length": 512, **data},
                                      "train": {"method": "grpo"},
                                      "rl": {"rewards": [{"function": "a.b:c"}], "tools": [CALCULATOR]}})

    assert cfg().data.prompt_tools == [CALCULATOR]
    with pytest.raises(ValueError, match="data.prompt_tools: .* differs from rl.tools"):
        cfg(prompt_tools=["a.b:other"])
    with pytest.raises(ValueError, match="prompt_tools: applies to prompt rows"):
        DataConfig(objective="sft", prompt_tools=[CALCULATOR])


def test_the_data_fingerprint_without_tools_is_unchanged():
    from qlora_train.data.prepared import data_identity

    cfg = Config.model_validate({"model": {"name_or_path": "x"}, "data": {"max_length": 512},
                                 "train": {"method": "grpo"}, "rl": {"rewards": [{"function": "a.b:c"}]}})
    assert "prompt_tools" not in data_identity(cfg)


def test_the_data_fingerprint_follows_the_tools_schemas(monkeypatch):
    """Prepared prompts hold the tools' schemas: a tool whose docstring changes its schema is a new fingerprint."""
    import qlora_train.data.prompts as prompts
    from qlora_train.data.prepared import data_identity

    cfg = Config.model_validate({"model": {"name_or_path": "x"}, "data": {"max_length": 512},
                                 "train": {"method": "grpo"},
                                 "rl": {"rewards": [{"function": "a.b:c"}], "tools": [CALCULATOR]}})
    before = data_identity(cfg)
    assert before["prompt_tools"]["names"] == [CALCULATOR]
    assert before["prompt_tools"]["schemas"][0]["function"]["name"] == "calculate"
    changed = [{**s, "function": {**s["function"], "description": "another"}}
               for s in before["prompt_tools"]["schemas"]]
    monkeypatch.setattr(prompts, "tool_schemas", lambda specs: changed)
    assert data_identity(cfg) != before


def test_agent_rows_that_all_bring_their_own_tools_are_a_usage_error(qwen3_tok, tmp_path):
    from qlora_train.rl.tools import ToolError

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "tools": [WEATHER]}) for i in range(2)))
    cfg = DataConfig(objective="prompt", datasets=[DatasetSource(path=str(path))], prompt_tools=[CALCULATOR])
    with pytest.raises(WrongRowsError) as exc:
        build_datasets(cfg, qwen3_tok)
    assert str(exc.value).startswith("all 2 rows were dropped (tools_beside_rl_tools): every prompt row gives tools "
                                     "of its own")
    with pytest.raises(ToolError, match=r"rl.tools\[0\]"):  # named once, before any row is read
        build_datasets(cfg.model_copy(update={"prompt_tools": ["qlora_train.rl.calculator:nope"]}), qwen3_tok)
