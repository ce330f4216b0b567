"""Agent rollouts token in, token out, over the families we test (tests/masking/families.py) on three vocabularies,
markers as tokens and as plain text: a scripted policy emits each turn's ids, tokenized as the tokenizer never would
(``tests.rl.scripted.odd_ids``); the rollout runs the calculator for each call (3 turns: two calls, an answer).

For each: the trained ids are exactly the emitted ids, in order, each completion where the policy was shown the ids
before it (nothing sampled re-encoded); every other id (prompt, tool results, the template's glue) is untrained;
the text is the template's render where the template is append-only, and the difference is counted where it is not
(a tool result written differently once the model answers it, reasoning the template drops from earlier turns).
"""

from __future__ import annotations

import pytest

from qlora_train.rl.agent import AgentLimits, agent_rollout
from qlora_train.rl.tool_calls import CallFormatError, call_format
from qlora_train.rl.tools import load_tools
from tests.rl.scripted import ScriptedPolicy, conversation, odd_ids, script_turns

TOOLS = load_tools(["qlora_train.rl.calculator:calculate"])
SCHEMAS = [t.schema for t in TOOLS]

# append-only for this conversation: the rollout's text is the template's render (12 layouts and call formats:
# json objects and lists, DeepSeek's and the channel's name + JSON, GLM's XML arguments, Llama 4's calls back to back)
APPEND_ONLY = ("mistral-v3", "mistral-tekken", "command-r7b-tools", "deepseek-v3", "exaone4", "llama4", "glm4.5",
               "structured-elements", "results-inside-assistant", "trailer-prompt-extends", "opener-prompt",
               "channel-second-header")
# (also append-only here, left out for time: mistral-v7, qa-space-header (on Llama 3 below), prefilled-empty-think,
# call-block-after-end)
# not append-only: a tool result written differently once another message follows it (tool-last-differs), a tool
# result written inside an assistant turn the next answer does not open again (falcon3), a generation prompt's
# preamble the render of the turn does not write (preamble-prompt-tools)
NOT_APPEND_ONLY = ("tool-last-differs", "falcon3", "preamble-prompt-tools")
# a subset on the other vocabularies (each costs a vocabulary's tokenizer per family)
LLAMA3_TEXT = ("mistral-v3", "deepseek-v3", "qa-space-header", "exaone4", "opener-prompt", "tool-last-differs")
GEMMA3 = ("mistral-tekken", "glm4.5", "tool-last-differs")

# our own ChatML-like template that drops the reasoning of every assistant turn but the last
DROPS_REASONING = """\
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.last and m.reasoning_content -%}
{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- m.content -}}
{%- for c in m.tool_calls or [] -%}
{{- '<tool_call>\\n' + {'name': c.function.name, 'arguments': c.function.arguments} | tojson + '\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def run_scripted(tok, *, reasoning: bool = False):
    """The 3-turn rollout of ``conversation()`` with the scripted policy -> (rollout, emitted ids, policy)."""
    messages = conversation(reasoning=reasoning)
    texts = script_turns(messages, tok, SCHEMAS)
    emitted = [odd_ids(text, tok, seed=k) for k, text in enumerate(texts)]
    policy = ScriptedPolicy(emitted)
    rollout = agent_rollout(messages[:1], policy, tok, tools=TOOLS, call_format=call_format(tok),
                            limits=AgentLimits(max_turns=3))
    return rollout, emitted, policy


def check_token_in_token_out(tok, rollout, emitted, policy):
    assert rollout.stop == "answer" and rollout.turns == 3 and rollout.calls == 2 and not rollout.tool_errors
    trained = [t for t, m in zip(rollout.input_ids, rollout.trained, strict=True) if m]
    assert trained == [t for ids in emitted for t in ids]  # exactly the emitted ids, nothing else
    generated = [s for s in rollout.segments if s.kind == "generated"]
    for k, segment in enumerate(generated):
        assert rollout.input_ids[segment.start:segment.end] == emitted[k]
        assert policy.shown[k] == rollout.input_ids[:segment.start]  # what it saw is what the rollout keeps
    kinds = [s.kind for s in rollout.segments]
    assert kinds == ["prompt", "generated", "tool", "generated", "tool", "generated"]
    for segment, result in zip([s for s in rollout.segments if s.kind == "tool"], ("84", "89"), strict=True):
        glue = tok.decode(rollout.input_ids[segment.start:segment.end], skip_special_tokens=False)
        assert result in glue and not any(rollout.trained[segment.start:segment.end])
    # the policy's ids are not the tokenizer's own encoding of the text: the rollout never re-encoded them
    assert any(ids != tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False)
               for ids in emitted)


@pytest.mark.parametrize("name", APPEND_ONLY + NOT_APPEND_ONLY)
def test_scripted_rollouts_on_the_qwen_vocabulary(family_vocab_tokenizer, name):
    tok = family_vocab_tokenizer(name, "qwen+tok")
    rollout, emitted, policy = run_scripted(tok)
    check_token_in_token_out(tok, rollout, emitted, policy)
    assert rollout.render_differs == (name in NOT_APPEND_ONLY), rollout.difference


@pytest.mark.parametrize("name", LLAMA3_TEXT)
def test_scripted_rollouts_markers_as_plain_text_on_llama3(family_vocab_tokenizer, name):
    tok = family_vocab_tokenizer(name, "llama3 text")
    rollout, emitted, policy = run_scripted(tok)
    check_token_in_token_out(tok, rollout, emitted, policy)
    assert rollout.render_differs == (name in NOT_APPEND_ONLY), rollout.difference


@pytest.fixture(scope="module")
def gemma3_base(real_vocab_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_vocab_dir("gemma3"))


@pytest.mark.parametrize("name", GEMMA3)
def test_scripted_rollouts_on_gemma3(gemma3_base, name):
    from tests.masking.families import family_tokenizer

    tok = family_tokenizer(gemma3_base, name)
    rollout, emitted, policy = run_scripted(tok)
    check_token_in_token_out(tok, rollout, emitted, policy)
    assert rollout.render_differs == (name in NOT_APPEND_ONLY), rollout.difference


def test_the_qwen3_template_drops_an_earlier_empty_reasoning_block(qwen3_tok):
    """Qwen3's template writes the empty ``<think>\n\n</think>\n\n`` of the last answer only: the first turn's,
    which the model generated, is not in the full render (counted), and the rollout keeps it."""
    rollout, emitted, policy = run_scripted(qwen3_tok)
    check_token_in_token_out(qwen3_tok, rollout, emitted, policy)
    assert qwen3_tok.decode(rollout.completions[0]).startswith("<think>\n\n</think>\n\n<tool_call>")
    assert rollout.render_differs and "</think>" in rollout.difference


def test_a_tool_result_written_differently_when_last_keeps_what_the_model_saw(family_vocab_tokenizer):
    tok = family_vocab_tokenizer("tool-last-differs", "qwen+tok")
    rollout, emitted, policy = run_scripted(tok)
    check_token_in_token_out(tok, rollout, emitted, policy)
    # the model saw the result as the last message (no newline before the close); the full render writes it with
    assert "</tool_response><|msg_close|>" in tok.decode(rollout.input_ids)
    assert rollout.render_differs and "'<|msg_close|>" in rollout.difference


def test_reasoning_the_template_drops_from_earlier_turns_stays_as_generated(qwen_tokenizer_dir):
    from tests.vocabularies import tokenizer_with_template

    tok = tokenizer_with_template(qwen_tokenizer_dir, DROPS_REASONING)
    rollout, emitted, policy = run_scripted(tok, reasoning=True)
    check_token_in_token_out(tok, rollout, emitted, policy)
    text = tok.decode(rollout.input_ids)
    assert text.count("First the product.") == 1 and text.count("Then the sum.") == 1  # kept as the model wrote
    assert rollout.render_differs and "First the product." in rollout.difference


def test_the_same_rollout_without_reasoning_equals_the_render(qwen_tokenizer_dir):
    from tests.vocabularies import tokenizer_with_template

    tok = tokenizer_with_template(qwen_tokenizer_dir, DROPS_REASONING)
    rollout, emitted, policy = run_scripted(tok)
    check_token_in_token_out(tok, rollout, emitted, policy)
    assert not rollout.render_differs, rollout.difference


# --- calls that fail: a malformed call, a tool that raises, an unknown tool, one past its time limit ------------


def _one_turn(tok, text: str, tools=TOOLS, **limits):
    ids = tok.encode(text, add_special_tokens=False)
    answer = tok.encode("Done.<|im_end|>", add_special_tokens=False)
    policy = ScriptedPolicy([ids, answer])
    return agent_rollout([{"role": "user", "content": "Go."}], policy, tok, tools=tools,
                         call_format=call_format(tok), limits=AgentLimits(max_turns=3, **limits))


def test_a_malformed_call_ends_the_rollout_counted(qwen3_tok):
    rollout = _one_turn(qwen3_tok, '<tool_call>\n{"name": "calculate", "arguments": {"expression": }\n'
                                   '</tool_call><|im_end|>')
    assert rollout.stop == "parse_error" and rollout.turns == 1 and rollout.calls == 0
    assert "JSON does not parse" in rollout.parse_error


def test_tool_errors_go_back_to_the_model(qwen3_tok):
    rollout = _one_turn(qwen3_tok, '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 / 0"}}\n'
                                   '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
                                   '<|im_end|>')
    assert rollout.stop == "answer" and rollout.calls == 2
    assert rollout.tool_errors == {"raised": 1, "unknown_tool": 1}
    glue = qwen3_tok.decode(rollout.input_ids[rollout.segments[2].start:rollout.segments[2].end])
    assert "error: ZeroDivisionError: division by zero" in glue and "error: no tool named 'search'" in glue


def test_a_tool_past_its_time_limit_returns_an_error(qwen3_tok):
    [slow] = load_tools(["tests.rl.slow_tool:wait"])
    rollout = _one_turn(qwen3_tok, '<tool_call>\n{"name": "wait", "arguments": {"seconds": 5}}\n</tool_call>'
                                   '<|im_end|>', tools=[slow], timeout_s=0.05)
    assert rollout.tool_errors == {"timeout": 1}
    assert "did not return within 0.05 s" in qwen3_tok.decode(rollout.input_ids)


def test_max_turns_ends_a_rollout_that_keeps_calling(qwen3_tok):
    call = qwen3_tok.encode('<tool_call>\n{"name": "calculate", "arguments": {"expression": "1"}}\n</tool_call>'
                            '<|im_end|>', add_special_tokens=False)
    policy = ScriptedPolicy([call, call])
    rollout = agent_rollout([{"role": "user", "content": "Go."}], policy, qwen3_tok, tools=TOOLS,
                            call_format=call_format(qwen3_tok), limits=AgentLimits(max_turns=2))
    assert rollout.stop == "max_turns" and rollout.turns == 2 and rollout.calls == 1


# --- the call format: refused where it cannot be read, declared instead ------------------------------------------


def test_a_template_without_tool_calls_refuses_naming_the_option(family_vocab_tokenizer):
    with pytest.raises(CallFormatError, match="rl.tool_call_format"):
        call_format(family_vocab_tokenizer("phi3", "qwen+tok"))


def test_a_declared_format_is_checked_against_the_template(qwen3_tok):
    fmt = call_format(qwen3_tok, {"kind": "json", "prefix": "<tool_call>", "suffix": "</tool_call>"})
    assert fmt.prefix == "<tool_call>"
    with pytest.raises(CallFormatError, match="does not read the calls"):
        call_format(qwen3_tok, {"kind": "json", "prefix": "[TOOL_CALLS]"})
    with pytest.raises(CallFormatError, match="kind"):
        call_format(qwen3_tok, {"kind": "yaml", "prefix": "x"})
