"""``--debug-samples`` on an agent config (``rl.tools``): each prompt row is followed by a scripted example rollout
from its prepared ids (a call to the first tool with example arguments from its schema, run through the real tool,
the template's glue, a scripted answer), its segments marked with their token counts."""

from __future__ import annotations

from pathlib import Path

from qlora_train.cli import main
from qlora_train.data.prompts import tool_schemas
from qlora_train.diagnostics.rollouts import example_arguments, example_rollout, format_example_rollout
from qlora_train.masking import render_prompt
from qlora_train.rl.tool_calls import call_format
from qlora_train.rl.tools import load_tools

REPO = Path(__file__).resolve().parents[2]
CALCULATOR = "qlora_train.rl.calculator:calculate"


def _param(spec: dict, required=("x",)) -> dict:
    return {"function": {"name": "f", "parameters": {"type": "object", "properties": {"x": spec},
                                                     "required": list(required)}}}


def test_example_arguments_from_a_schema():
    assert example_arguments(_param({"type": "string", "description": "A city, e.g. Lima."})) == {"x": "Lima"}
    assert example_arguments(_param({"type": "string", "description": "e.g. 'a b'"})) == {"x": "a b"}
    assert example_arguments(_param({"type": "string", "enum": ["c", "f"]})) == {"x": "c"}
    assert example_arguments(_param({"type": "integer", "description": "How many."})) == {"x": 1}
    assert example_arguments(_param({"type": "boolean"}, required=())) == {"x": True}  # none required: the first


def test_the_example_rollout_is_the_agent_rollout_of_a_scripted_call(qwen3_tok):
    tools = load_tools([CALCULATOR])
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = render_prompt(prompt, qwen3_tok, tools=tool_schemas((CALCULATOR,))).input_ids
    rollout = example_rollout(prompt, ids, qwen3_tok, tools=tools, call_format=call_format(qwen3_tok))
    assert rollout.input_ids[:len(ids)] == ids and [s.kind for s in rollout.segments] == [
        "prompt", "generated", "tool", "generated"]
    call, answer = (qwen3_tok.decode(c) for c in rollout.completions)
    assert call.endswith('<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * (3 + 4)"}}\n'
                         "</tool_call><|im_end|>")
    assert answer == "(scripted answer)<|im_end|>"
    assert (rollout.stop, rollout.calls, rollout.tool_errors) == ("answer", 1, {})
    assert rollout.messages[-2] == {"role": "tool", "content": "84", "tool_call_id": "qlora0100", "name": "calculate"}
    assert sum(rollout.trained) == sum(map(len, rollout.completions))
    shown = format_example_rollout(rollout, qwen3_tok, tool="calculate")
    assert shown.startswith("example rollout (scripted, not the model's sampling: a call to calculate")
    tool = rollout.segments[2]
    assert (f"[prompt: {len(ids)} tokens, shown above][generated {len(rollout.completions[0])} tokens]<think>"
            in shown)
    assert f"[/generated][tool {tool.end - tool.start} tokens]\n<|im_start|>user\n<tool_response>\n84\n" in shown
    # Qwen3 drops an earlier turn's empty <think></think>: the difference is shown, the ids kept
    assert rollout.render_differs and "differs from the template's render at char" in shown


def test_debug_samples_on_the_agent_quickstart_shows_an_example_rollout(tmp_path, tiny_model_dir, monkeypatch,
                                                                       capsys):
    monkeypatch.chdir(REPO / "configs")
    args = ["--config", str(REPO / "configs" / "quickstart-agent.yaml"), "--set",
            f"model.name_or_path={tiny_model_dir}", "--debug-samples", "1", "--stats-dir", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    prompt = out.index("quickstart-agent.jsonl:1  (source")
    example = out.index("example rollout (scripted, not the model's sampling", prompt)
    assert "# Tools" in out[prompt:example]  # the prompt row is rendered with rl.tools' schemas
    assert "the model's own rollouts are in the training log as 'agent rollout'" in out[example:]
    assert "<tool_response>\n84\n</tool_response>" in out[example:] and "(stop: answer, 1 calls" in out[example:]
