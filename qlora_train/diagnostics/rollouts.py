"""``--debug-samples`` on an agent config (``rl.tools``): under each prompt row, what a rollout's tool turn adds.

``--debug-samples`` loads no model, so it samples nothing; what it shows instead is a **scripted example rollout**
from the row's prepared prompt ids (the ids training starts each rollout from): a first completion that calls the
first tool with example arguments read from its schema (``example_arguments``), written as the template itself
writes that call (``scripted_call_text``: the render of the prompt with an assistant turn holding the call, from
the generation prompt through the turn's end marker), the call run through the real tool (its limits, its error
message where it fails), the glue the template writes after it, tokenized on its own (``rl.agent.tool_glue``), and a
scripted answer. It is ``rl.agent.agent_rollout`` itself, with a policy that emits those ids, so its segments,
its trained ids and its render check are the ones training uses. The model's own rollouts are in the training log
(``agent rollout (first, step N)``).

    >>> example_arguments({"function": {"name": "calculate", "parameters": {"type": "object", "properties": {
    ...     "expression": {"type": "string", "description": 'The expression, e.g. "12 * (3 + 4)".'}},
    ...     "required": ["expression"]}}})
    {'expression': '12 * (3 + 4)'}
"""

from __future__ import annotations

import os
import re

from qlora_train.masking import render_text, template_layout
from qlora_train.rl.agent import AgentLimits, AgentRollout, agent_rollout
from qlora_train.rl.tool_calls import CallFormat
from qlora_train.rl.tools import Tool

SCRIPTED_ANSWER = "(scripted answer)"
_EXAMPLE = re.compile(r"""e\.g\.,?\s*(?:"([^"]*)"|'([^']*)'|(\S+?))[.,;)]?\s*$""")
_BY_TYPE = {"string": "example", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}


def example_arguments(schema: dict) -> dict:
    """A tool's JSON schema -> arguments for an example call: each required parameter (the first one where none
    is required), its value the description's ``e.g. ...`` where it gives one, else one of its ``enum``, else a
    value of its type."""
    params = schema["function"].get("parameters", {}).get("properties", {})
    names = schema["function"].get("parameters", {}).get("required") or list(params)[:1]
    out = {}
    for name in names:
        spec = params.get(name, {})
        found = _EXAMPLE.search(spec.get("description", ""))
        if found and spec.get("type", "string") == "string":
            out[name] = next(g for g in found.groups() if g is not None)
        elif spec.get("enum"):
            out[name] = spec["enum"][0]
        else:
            out[name] = _BY_TYPE.get(spec.get("type", "string"), "example")
    return out


def scripted_call_text(prompt: list[dict], tool: Tool, tokenizer, *, tools: list[dict], layout) -> str:
    """The text the template writes for an assistant turn that calls ``tool`` with ``example_arguments``, after
    the prompt's generation prompt, through the turn's end marker (what a model that calls it would generate)."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call0", "function": {
        "name": tool.name, "arguments": example_arguments(tool.schema)}}]}
    before = render_text(prompt, tokenizer, tools=tools, add_generation_prompt=True, layout=layout)
    whole = render_text([*prompt, call], tokenizer, tools=tools, layout=layout)
    text = whole[len(os.path.commonprefix([before, whole])):]
    ends = [(text.find(m), m) for m in layout.end_markers if m and m in text]
    if ends:
        at, marker = min(ends, key=lambda e: (e[0], -len(e[1])))
        text = text[:at + len(marker)]
    return text


def example_rollout(prompt: list[dict], prompt_ids: list[int], tokenizer, *, tools: list[Tool],
                    call_format: CallFormat, limits: AgentLimits | None = None) -> AgentRollout:
    """A prompt row (its messages and prepared ids) -> the scripted example rollout (see the module doc): a call
    to the first tool, its result, a scripted answer."""
    layout, limits = template_layout(tokenizer), limits or AgentLimits()
    schemas = [t.schema for t in tools]
    end = layout.end_markers[0] if layout.end_markers else ""
    turns = [scripted_call_text(prompt, tools[0], tokenizer, tools=schemas, layout=layout), SCRIPTED_ANSWER + end]
    emitted = iter([tokenizer.encode(text, add_special_tokens=False) for text in turns])
    return agent_rollout(prompt, lambda ids: next(emitted), tokenizer, tools=tools, call_format=call_format,
                         limits=AgentLimits(2, limits.timeout_s, limits.max_chars), layout=layout,
                         prompt_ids=prompt_ids)


def format_example_rollout(rollout: AgentRollout, tokenizer, *, tool: str) -> str:
    """The rollout after its prompt, each segment marked with its kind and token count; a heading that says it is
    scripted and where the model's own rollouts are shown."""
    lines = [f"example rollout (scripted, not the model's sampling: a call to {tool} with example arguments from its "
             "schema, run through the real tool, then a scripted answer; the model's own rollouts are in the training "
             "log as 'agent rollout'): [generated] is trained, [prompt] and [tool] never are"]
    parts = []
    for s in rollout.segments:
        n = s.end - s.start
        if s.kind == "prompt":
            parts.append(f"[prompt: {n} tokens, shown above]")
            continue
        text = tokenizer.decode(rollout.input_ids[s.start:s.end], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        parts.append(f"[{s.kind} {n} tokens]{text}[/{s.kind}]")
    lines.append("".join(parts))
    status = f"stop: {rollout.stop}, {rollout.calls} calls"
    status += f", tool errors {rollout.tool_errors}" if rollout.tool_errors else ""
    status += f", parse error: {rollout.parse_error}" if rollout.parse_error else ""
    status += (f"; differs from the template's render {rollout.difference} (counted in training as "
               "agent/render_differs; the rollout keeps the ids the model saw)") if rollout.render_differs else \
        "; equal to the template's render"
    lines.append(f"({status}; trained {sum(rollout.trained)} of {len(rollout.input_ids)} tokens)")
    return "\n".join(lines)
