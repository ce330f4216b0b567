"""An independent oracle for loss masks: the masking rule applied directly, with prefix renders.

The rule (docs/masking.md): the generated part of assistant turn *i* is what
``render(messages[:i+1])`` adds after its longest common prefix with
``render(messages[:i], add_generation_prompt=True)``, through its end-of-turn
marker(s), without a separator after the last marker and without text the
template appends after every render. With the project's one addition: a
reasoning block the generation prompt opens (Qwen3.5's ``<think>\\n``, EXAONE's
empty block) stays in the trained part.

The oracle reads nothing from the engine (no probed layout). What it takes as
given are documented facts of the template: its end markers and the reasoning
opener its generation prompt may write. Applied to one conversation::

    verdict = prefix_oracle(tok, messages, end_markers=("<|im_end|>",))
    verdict.kind                       # "decided", "refuse" or "undecided"
    trained_text(verdict)              # the trained characters of the full render, in order

- ``decided``: ``spans`` are the trained character spans of ``text`` (the full
  render); ``token_mask`` turns them into tokens by the first-character rule
  (qlora_train/masking/tokenize.py: a token is trained when its first character is),
  the tokens of the text cut where each turn starts (``cuts``; ``tokens``: at
  inference the prompt is tokenized alone, so the answer's first token starts
  there), with plain tokenizer calls (the tokenizers tested write nothing before
  a piece of text, no SentencePiece prefix);
- ``refuse``: the row has no right mask: the template raises on it, or a part a
  turn must generate (its content, a tool call's name or argument values) is not
  inside that turn's generated part (a call the template does not write);
- ``undecided``: the template is not prefix-stable on the row (the whole
  conversation writes a turn differently from its prefix render: reasoning
  dropped from earlier turns, a system prompt moved, a header only the last turn
  gets), or a prefix cannot be rendered. Only weaker properties can be checked
  (``located_messages``).

Step by step, for each assistant message *i*:

1. ``start`` = the common prefix of the generation-prompt render of the turns
   before and the render through turn *i*, which must reach the generation
   prompt's own text (else the turns before are written differently: Mistral
   moves the system prompt into the last user turn); moved back to the reasoning
   opener where the generation prompt's own text writes one before that point;
2. the generated part is the rest of the render through turn *i*, cut after its
   last end marker (what follows is a separator, or text the template appends
   after every render such as the first Llama 3 template's assistant header);
   an end marker inside the turn's own content is the answer's text, not its end
   (assistant text holding markers is trained as written);
3. it must stand at ``start`` in the full render (prefix stability); where it
   has no end marker of its own, an end marker the full render writes right
   after it is the turn's (GLM's next header; an end marker written only where a
   user turn follows), whitespace before that marker included; without one,
   trailing whitespace is cut;
4. the turn's content (up to surrounding whitespace), its tool calls' names and
   scalar argument values must lie inside the span; spans are in order.

The character-level common prefix can reach into a turn's own text where the
generation prompt's last characters equal the answer's first ones (a preamble
"Let me ..." and an answer "Let ..."): the rule as stated does not train them,
and neither does the oracle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from jinja2 import TemplateError

DECIDED, REFUSE, UNDECIDED = "decided", "refuse", "undecided"
# what rendering a template can raise on a row: raise_exception, undefined values (TemplateError), a dict
# concatenated to a string (TypeError)
TEMPLATE_ERRORS = (TemplateError, TypeError)


@dataclass(frozen=True)
class Verdict:
    kind: str  # DECIDED, REFUSE or UNDECIDED
    text: str = ""  # the full render ("" when it raised)
    spans: tuple[tuple[int, int], ...] = ()  # trained character spans of text (DECIDED only)
    reason: str = ""  # why REFUSE / UNDECIDED, naming the message
    turns: tuple[int, ...] = field(default=())  # message index of each span
    cuts: tuple[int, ...] = ()  # where each judged turn starts in text: the text is tokenized cut there (tokens)


def _render(tok, messages, tools, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def _scalars(arguments) -> list[str]:
    """A tool call's scalar argument values as text (what any template writes of them somewhere)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return [arguments]
    if not isinstance(arguments, dict):
        return []
    return [v if isinstance(v, str) else json.dumps(v) for v in arguments.values()
            if isinstance(v, (str, int, float)) and not isinstance(v, bool)]


def _missing_part(message: dict, span: str) -> str | None:
    """What the turn must generate that is not inside its span, or None."""
    content = (message.get("content") or "").strip()
    if content and content not in span:
        return f"content {content[:40]!r}"
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        if fn["name"] not in span:
            return f"tool call {fn['name']!r}"
        for value in _scalars(fn.get("arguments")):
            if value.strip() and value not in span:
                return f"tool call {fn['name']!r} argument {value[:40]!r}"
    return None


def _content_end(message: dict, generated: str) -> int:
    """Where the message's content (stripped) first ends in its generated part (0 when it is not written there;
    not its last occurrence: a one-letter answer is also inside the markers after it)."""
    content = (message.get("content") or "").strip()
    k = generated.find(content) if content else -1
    return k + len(content) if k >= 0 else 0


def prefix_oracle(tok, messages: Sequence[dict], *, tools: list | None = None, end_markers: Sequence[str],
                  think_open: str = "<think>", trained: range | None = None) -> Verdict:
    """The trained spans of every assistant message of ``messages`` per the rule (see the module doc); with
    ``trained``, only of the assistant messages whose index is in it (a preference pair's response), the others
    judged as context like any untrained message. The verdict's ``cuts`` are where the full render is cut before
    it is tokenized (``tokens``): each judged turn's start, where the oracle can place it."""
    messages = list(messages)
    try:
        full = _render(tok, messages, tools, False)
    except TEMPLATE_ERRORS as err:
        return Verdict(REFUSE, reason=f"the template raises: {type(err).__name__}: {err}")
    spans, turns, cuts, cursor = [], [], [], 0
    failed: tuple[str, str] | None = None  # the first (kind, reason) that leaves the row not decided

    def fail(kind: str, reason: str) -> None:
        nonlocal failed
        failed = failed or (kind, reason)

    for i, message in enumerate(messages):
        if message["role"] != "assistant" or (trained is not None and i not in trained):
            continue
        try:
            prompt = _render(tok, messages[:i], tools, True)
            turn = _render(tok, messages[: i + 1], tools, False)
            bare = _render(tok, messages[:i], tools, False)
        except TEMPLATE_ERRORS as err:
            fail(UNDECIDED, f"messages[{i}]: a prefix render raises: {err}")
            continue
        start = len(os.path.commonprefix([prompt, turn]))
        prompt_own = len(os.path.commonprefix([bare, prompt]))  # where the generation prompt's own text starts
        if start < prompt_own:
            fail(UNDECIDED, f"messages[{i}]: the render through the turn writes the conversation before it "
                            "differently from the prompt")
            aligned = _aligned_end(prompt, full, cuts[-1] if cuts else 0, len(prompt) - prompt_own)
            opened = prompt.find(think_open, prompt_own) if think_open else -1
            if aligned is not None:  # back to a reasoning block the generation prompt opens, as below
                cuts.append(aligned - (len(prompt) - opened if opened >= 0 else 0))
            continue
        opened = prompt.find(think_open, prompt_own) if think_open else -1
        if 0 <= opened < start:
            start = opened  # a reasoning block the generation prompt opens is trained
        if full.startswith(turn[:start]):  # the full render has the turn's prompt where its own render has it
            cuts.append(start)
        else:  # written elsewhere in the full render (tools before the last user message): where it ends there
            aligned = _aligned_end(turn[:start], full, cuts[-1] if cuts else 0, start - prompt_own)
            if aligned is not None:
                cuts.append(aligned)
        if failed:
            continue  # only where the turns after it start (the tokens are compared even where not decided)
        generated = turn[start:]
        after = _content_end(message, generated)  # an end marker inside the content is the answer's own text
        last_end = max((generated.rfind(e) + len(e) for e in end_markers if generated.find(e, after) >= 0),
                       default=-1)
        if last_end >= 0:
            candidates = [generated[:last_end]]
        else:  # no end marker of its own: one the full render writes right after it (or after its whitespace)
            candidates = [generated, generated.rstrip()]
        end = -1
        for text in candidates:
            if full.startswith(turn[:start] + text):
                end = start + len(text)
                if last_end < 0:
                    marker = next((e for e in end_markers if full.startswith(e, end)), None)
                    if marker is None and text is candidates[0]:
                        continue
                    end += len(marker or "")
                break
        if end < 0:
            fail(UNDECIDED, f"messages[{i}]: the full render writes the turn differently from its prefix render")
            continue
        if start < cursor:
            fail(UNDECIDED, f"messages[{i}]: the turn starts inside the previous one")
            continue
        missing = _missing_part(message, full[start:end])
        if missing is not None:
            fail(REFUSE, f"messages[{i}]: {missing} not inside the turn's generated part {full[start:end][:80]!r}")
            continue
        if end > start:
            spans.append((start, end))
            turns.append(i)
        cursor = end
    if failed:
        return Verdict(failed[0], full, reason=failed[1], cuts=tuple(cuts))
    return Verdict(DECIDED, full, tuple(spans), turns=tuple(turns), cuts=tuple(cuts))


def _aligned_end(prompt: str, full: str, after: int, own: int) -> int | None:
    """Where a turn's prompt ends in the full render, where the two write the conversation before the turn
    differently (a system prompt or tools written with the last user message): the end of the longest text the
    prompt ends with that the full render has (after ``after``), longer than the generation prompt's own ``own``
    characters; the first such place. None where there is none."""
    best, where = own, None
    if not prompt:
        return None
    for t in range(after + 1, len(full) + 1):
        if full[t - 1] != prompt[-1]:
            continue
        k = 1
        while k < len(prompt) and k < t and full[t - 1 - k] == prompt[-1 - k]:
            k += 1
        if k > best:
            best, where = k, t
    return where


def trained_text(verdict: Verdict) -> str:
    """The trained characters of a decided verdict, concatenated."""
    return "".join(verdict.text[a:b] for a, b in verdict.spans)


def char_mask(text: str, spans: Sequence[tuple[int, int]]) -> list[bool]:
    mask = [False] * len(text)
    for a, b in spans:
        mask[a:b] = [True] * (b - a)
    return mask


def tokens(tok, text: str, cuts: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """``text``'s ids and offsets as training must see them: the text cut at ``cuts`` (each judged turn's start),
    each piece tokenized alone, as the prompt is at inference, ids joined, offsets into the whole text."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    ids, offsets = [], []
    for a, b in zip(bounds, bounds[1:]):
        enc = tok(text[a:b], add_special_tokens=False, return_offsets_mapping=True)
        ids += enc["input_ids"]
        offsets += [(s + a, e + a) for s, e in enc["offset_mapping"]]
    return ids, offsets


def token_mask(offsets: Sequence[tuple[int, int]], mask: Sequence[bool]) -> list[bool]:
    """Tokens (by their character offsets) trained by the first-character rule: a token is trained when its
    first character is."""
    return [start < len(mask) and bool(mask[start]) and end > start for start, end in offsets]


@dataclass(frozen=True)
class RowCheck:
    """The engine's trained tokens of one kept row against the verdict on it."""

    text_differs: bool  # the engine's ids are not the tokens of the template's render: nothing else compared
    wrong: int = 0  # trained by the engine, not by the oracle (all trained tokens where the oracle refuses)
    missed: int = 0  # trained by the oracle, not by the engine
    weak: int = 0  # undecided rows: tokens breaking the weak properties (``weak_violations``)


def check_kept_row(tok, verdict: Verdict, messages: Sequence[dict], input_ids: Sequence[int],
                   trained: Sequence[bool], trained_messages: range | None = None) -> RowCheck:
    """Compare the tokens the engine trains in a row it kept (``trained[k]``: token k has a label) with the
    oracle's verdict on the row, token by token (the first-character rule)."""
    ids, offsets = tokens(tok, verdict.text, verdict.cuts)
    if ids != list(input_ids):
        return RowCheck(text_differs=True)
    if verdict.kind == DECIDED:
        expected = token_mask(offsets, char_mask(verdict.text, verdict.spans))
        return RowCheck(False, wrong=sum(t and not e for t, e in zip(trained, expected)),
                        missed=sum(e and not t for t, e in zip(trained, expected)))
    if verdict.kind == REFUSE:
        return RowCheck(False, wrong=sum(trained))
    return RowCheck(False, weak=weak_violations(verdict.text, messages, offsets, trained, trained_messages))


def weak_violations(text: str, messages: Sequence[dict], offsets: Sequence[tuple[int, int]],
                    trained: Sequence[bool], trained_messages: range | None = None) -> int:
    """What can be checked without prefix renders: tokens trained inside a located user, system or tool
    content (or an assistant one not in ``trained_messages``, when given), and tokens left untrained inside a
    located trained assistant content (by where tokens start); a content the render writes more than once is
    not located."""
    starts = [start for start, _ in offsets]
    bad = 0
    for i, a, b in located_messages(text, messages):
        if text.count(text[a:b]) > 1:  # written more than once (a one-word answer, a marker as content, '<' inside
            continue  # the template's own '</tool_response>'): where it is cannot be told without prefix renders
        inside = [k for k, start in enumerate(starts) if a <= start < b]
        if messages[i]["role"] == "assistant" and (trained_messages is None or i in trained_messages):
            bad += sum(not trained[k] for k in inside)
        else:
            bad += sum(bool(trained[k]) for k in inside)
    return bad


def located_messages(text: str, messages: Sequence[dict]) -> list[tuple[int, int, int]]:
    """``(message index, start, end)`` of each message's content (stripped) found in ``text``, in message order.

    For checks that need no prefix render: a message whose content the template does not write verbatim
    (trimmed inside, escaped, moved elsewhere) is left out, and the search goes on from the last one found.
    """
    found, at = [], 0
    for i, m in enumerate(messages):
        content = (m.get("content") or "").strip()
        if not content:
            continue
        k = text.find(content, at)
        if k >= 0:
            found.append((i, k, k + len(content)))
            at = k + len(content)
    return found
