"""Multi-turn tool rollouts, token in, token out: the ids the model saw and sampled, and which of them it generated.

``agent_rollout(prompt, policy, tokenizer, tools=..., call_format=...)`` runs one rollout::

    ids = render_prompt(prompt).input_ids                  the prompt, as at inference (masking.render_prompt; in
                                                           training, the prepared prompt row's ids: data.prompts)
    loop, at most max_turns times:
        completion = policy(ids)                           sampled ids, kept unchanged: never decoded and re-encoded
        ids += completion                                  trained (its end-of-turn marker included)
        calls = parse_calls(decode(completion))            the template's own call format (rl.tool_calls)
        no call: the rollout ends; a malformed call: it ends, counted (``parse_error``)
        results = the tools called (rl.tools: limits, errors returned to the model, counted)
        ids += encode(tool_glue(...))                      never trained: what the template writes from the end of
                                                           the model's turn through the next generation prompt

**The glue** (``tool_glue``): the template renders the conversation through the model's turn (``A``) and through
the tool results with the generation prompt (``B``); the glue is ``B`` after the end marker that closes the model's
turn, tokenized on its own, as a server that keeps the token history would tokenize what it appends. Where ``B``
does not begin with ``A`` (a template that renders a turn differently once another message follows it), the model's
turn end is found in ``B`` by counting end markers from where they part. A turn the model ended by writing the
tool result's own opener (GLM's ``<|observation|>``) keeps it: the glue starts after it.

**Verified**: the rollout's text (its ids decoded) is compared with the template's render of the same conversation
(the messages rebuilt from the completions and the tool results): equal (a prefix of it) where the template is
append-only; where it is not (earlier reasoning dropped, a tool result written differently once the model answers
it) ``render_differs`` is set, the first difference kept in ``difference`` (``--debug-samples`` shows it), and the
rollout keeps the ids the model saw: nothing is re-rendered.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from qlora_train.masking import TEMPLATE_ERRORS, TemplateLayout, render_prompt, render_text, template_layout
from qlora_train.rl.tool_calls import CallFormat, ParsedCalls, parse_calls
from qlora_train.rl.tools import DEFAULT_MAX_CHARS, DEFAULT_TIMEOUT_S, Tool, call_tool

log = logging.getLogger(__name__)

Policy = Callable[[list[int]], list[int]]  # the ids so far -> the next completion's ids (through its stop token)
SegmentKind = Literal["prompt", "generated", "tool"]
STOPS = ("answer", "truncated", "parse_error", "max_turns")  # why a rollout ended


@dataclass(frozen=True)
class Segment:
    """A run of a rollout's ids: the prompt, a completion (trained), or the glue of a tool turn (never trained)."""

    kind: SegmentKind
    start: int
    end: int


@dataclass(frozen=True)
class AgentLimits:
    """``rl.max_turns`` (completions per rollout), the per-call time and output limits of a tool."""

    max_turns: int = 4
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_chars: int = DEFAULT_MAX_CHARS


@dataclass(frozen=True)
class AgentRollout:
    """One rollout (see the module doc)."""

    input_ids: list[int]
    segments: tuple[Segment, ...]
    messages: list[dict]  # the prompt's, then each completion's (rebuilt) and each tool result
    stop: str  # one of STOPS
    calls: int = 0  # tool calls run
    tool_errors: dict[str, int] = field(default_factory=dict)  # ToolResult.error -> count
    parse_error: str | None = None
    render_differs: bool = False  # the text is not the template's render of ``messages`` (see the module doc)
    difference: str | None = None  # where they part: "at char N: rollout '...' / render '...'"

    @property
    def prompt_length(self) -> int:
        return self.segments[0].end

    @property
    def trained(self) -> list[int]:
        """1 at each generated id, 0 elsewhere (one per ``input_ids``)."""
        mask = [0] * len(self.input_ids)
        for s in self.segments:
            if s.kind == "generated":
                mask[s.start:s.end] = [1] * (s.end - s.start)
        return mask

    @property
    def completions(self) -> list[list[int]]:
        return [self.input_ids[s.start:s.end] for s in self.segments if s.kind == "generated"]

    @property
    def turns(self) -> int:
        return len(self.completions)


def _ends_with_marker(text: str, layout: TemplateLayout) -> str | None:
    return next((m for m in sorted(layout.end_markers, key=len, reverse=True) if m and text.endswith(m)), None)


def assistant_message(text: str, parsed: ParsedCalls, layout: TemplateLayout, *, turn: int) -> dict:
    """A completion's text and its calls -> the assistant message the template would render for it: reasoning
    (before the layout's ``think_close``) under ``reasoning_content``, the content (before the first call, or the
    text less its end marker), the calls with ids ``qlora{turn}{k}`` where the model wrote none."""
    content = parsed.content if parsed.calls else text
    marker = _ends_with_marker(content, layout)
    if marker:
        content = content[:-len(marker)]
    message: dict = {"role": "assistant", "content": content}
    if layout.think_close and layout.think_close in content:
        reasoning, _, answer = content.partition(layout.think_close)
        if layout.think_open and layout.think_open in reasoning:
            reasoning = reasoning.split(layout.think_open, 1)[1]
        message["reasoning_content"] = reasoning.strip("\n")
        message["content"] = answer.lstrip("\n") if layout.think_separator.strip() == "" else answer
    for marker in layout.before_content:  # generated markers the template writes before the content
        if message["content"].startswith(marker):
            message["content"] = message["content"][len(marker):]
    if parsed.calls:
        message["tool_calls"] = [{"type": "function", "id": call.get("id") or f"qlora{turn:02d}{k:02d}",
                                  "function": {"name": call["name"], "arguments": call["arguments"]}}
                                 for k, call in enumerate(parsed.calls)]
    return message


def _marker_ends(text: str, markers: Sequence[str], start: int = 0) -> list[tuple[int, int]]:
    """(start, end) of each end-marker occurrence in ``text`` from ``start``, in order, not overlapping."""
    out, at = [], start
    while True:
        found = [(text.find(m, at), m) for m in markers if m]
        found = [(i, m) for i, m in found if i >= 0]
        if not found:
            return out
        i, m = min(found, key=lambda f: (f[0], -len(f[1])))
        out.append((i, i + len(m)))
        at = i + len(m)


def tool_glue(before: list[dict], assistant: dict, results: list[dict], tokenizer, *, tools: list[dict] | None,
              layout: TemplateLayout, ended_with: str | None) -> str:
    """The text the template writes from the end of the model's turn (``assistant``, answering ``before``) through
    the tool ``results`` and the next generation prompt (see the module doc)."""
    a = render_text([*before, assistant], tokenizer, tools=tools, layout=layout)
    b = render_text([*before, assistant, *results], tokenizer, tools=tools, add_generation_prompt=True, layout=layout)
    c = render_text(before, tokenizer, tools=tools, add_generation_prompt=True, layout=layout)
    starts_at = len(os.path.commonprefix([a, c]))
    in_turn = _marker_ends(a, layout.end_markers, starts_at)
    turn_end = in_turn[-1][1] if in_turn else len(a.rstrip())
    parted = len(os.path.commonprefix([a[:turn_end], b]))
    if parted >= turn_end:
        glue_at = turn_end
    else:  # B writes something before the turn's end differently: its end is as many markers on from where they part
        skip = len(_marker_ends(a[:turn_end], layout.end_markers, parted))
        found = _marker_ends(b, layout.end_markers, parted)
        glue_at = found[skip - 1][1] if 0 < skip <= len(found) else parted
    glue = b[glue_at:]
    if ended_with and glue.startswith(ended_with):  # the model wrote the result's opener to end its turn (GLM)
        glue = glue[len(ended_with):]
    return glue


def _difference(rollout: str, render: str, ended_with: str | None) -> str | None:
    """None where the rollout's text is the render (a prefix of it: the render's own text after the last turn's
    end is not sampled; the end marker the model wrote where the template's last turn has none, GLM's, is the
    model's); else where they part."""
    if render.startswith(rollout) or ended_with and render.startswith(rollout[:-len(ended_with)]) and \
            render[len(rollout) - len(ended_with):].strip() == "":
        return None
    at = len(os.path.commonprefix([rollout, render]))
    return f"at char {at}: rollout {rollout[at:at + 40]!r} / render {render[at:at + 40]!r}"


def agent_rollout(prompt: list[dict], policy: Policy, tokenizer, *, tools: Sequence[Tool], call_format: CallFormat,
                  limits: AgentLimits = AgentLimits(), layout: TemplateLayout | None = None,
                  prompt_ids: list[int] | None = None) -> AgentRollout:
    """A prompt (messages ending with a user turn) and a policy -> its ``AgentRollout`` (see the module doc).
    ``prompt_ids``: the prompt's ids as the data prepared them (``data.prompts``: rendered with the same tools'
    schemas, ``data.prompt_tools``); else rendered here."""
    layout = template_layout(tokenizer) if layout is None else layout
    schemas = [t.schema for t in tools] or None
    by_name = {t.name: t for t in tools}
    ids = list(render_prompt(prompt, tokenizer, tools=schemas, layout=layout).input_ids if prompt_ids is None
               else prompt_ids)
    segments = [Segment("prompt", 0, len(ids))]
    messages = [dict(m) for m in prompt]
    stop, calls, errors, parse_error = "max_turns", 0, {}, None
    for turn in range(1, limits.max_turns + 1):
        completion = list(policy(list(ids)))
        segments.append(Segment("generated", len(ids), len(ids) + len(completion)))
        ids += completion
        text = tokenizer.decode(completion, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        ended_with = _ends_with_marker(text, layout)
        parsed = parse_calls(text, call_format)
        message = assistant_message(text, parsed, layout, turn=turn)
        if parsed.error:
            stop, parse_error = "parse_error", parsed.error
            messages.append(message)
            break
        if not parsed.calls or ended_with is None:
            stop = "answer" if ended_with else "truncated"
            messages.append(message)
            break
        if turn == limits.max_turns:
            messages.append(message)
            break
        results = []
        for call in message["tool_calls"]:
            result = call_tool(by_name, call["function"]["name"], call["function"]["arguments"],
                               timeout_s=limits.timeout_s, max_chars=limits.max_chars)
            calls += 1
            if result.error:
                errors[result.error] = errors.get(result.error, 0) + 1
            results.append({"role": "tool", "content": result.text, "tool_call_id": call["id"],
                            "name": call["function"]["name"]})
        glue = tool_glue(messages, message, results, tokenizer, tools=schemas, layout=layout, ended_with=ended_with)
        glue_ids = tokenizer.encode(glue, add_special_tokens=False)
        segments.append(Segment("tool", len(ids), len(ids) + len(glue_ids)))
        ids += glue_ids
        messages += [message, *results]
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    try:
        difference = _difference(text, render_text(messages, tokenizer, tools=schemas, layout=layout), ended_with)
    except TEMPLATE_ERRORS as exc:  # the rebuilt messages are not the template's to render (harmony's channels)
        difference = f"the template refuses the rebuilt messages: {type(exc).__name__}: {exc}"[:300]
    return AgentRollout(ids, tuple(segments), messages, stop, calls, errors, parse_error, difference is not None,
                        difference)


def marked_text(rollout: AgentRollout, tokenizer) -> str:
    """The rollout's text with each segment marked (what ``--debug-samples`` and the training log show): the
    prompt as it is, each completion between ``[generated]`` and ``[/generated]`` (trained), each tool turn's glue
    between ``[tool]`` and ``[/tool]`` (never trained)."""
    out = []
    for s in rollout.segments:
        text = tokenizer.decode(rollout.input_ids[s.start:s.end], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
        out.append(text if s.kind == "prompt" else f"[{s.kind}]{text}[/{s.kind}]")
    status = f"stop: {rollout.stop}, {rollout.turns} turns, {rollout.calls} calls"
    status += f", tool errors {rollout.tool_errors}" if rollout.tool_errors else ""
    status += f", parse error: {rollout.parse_error}" if rollout.parse_error else ""
    status += f"; differs from the template's render {rollout.difference}" if rollout.render_differs else \
        "; equal to the template's render"
    return "".join(out) + "\n(" + status + ")"


def rl_tools(cfg) -> list:
    """A config's ``rl.tools`` imported, their schemas read (``ToolError`` naming the one that cannot be); none
    without."""
    if cfg.train.method != "grpo" or not cfg.rl.tools:
        return []
    from qlora_train.rl.tools import load_tools

    return load_tools(cfg.rl.tools)


def rl_call_format(cfg, tokenizer):
    """How the template writes a tool call (``rl.tool_call_format`` or the probe's): ``CallFormatError`` naming the
    template and the option when it cannot be read."""
    from qlora_train.rl.tool_calls import call_format

    m = cfg.model
    name = "the tokenizer's own" if m.chat_template in (None, "tokenizer") else f"the {m.chat_template!r}"
    fmt = call_format(tokenizer, cfg.rl.tool_call_format, template_name=name)
    log.info("tool calls: read as %s (rl.tools: %s)", fmt.kind, ", ".join(cfg.rl.tools))
    return fmt
