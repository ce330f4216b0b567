"""An independent oracle for loss masks: the masking rule applied directly, with prefix renders.

The rule (docs/masking.md): what the model must learn for assistant turn *i* is what it generates at
inference after ``render(messages[:i], add_generation_prompt=True)``. Everything that render writes (the
header and whatever the generation prompt adds after it: a pre-filled empty reasoning block, a reasoning
opener, a channel tag, a preamble) is prompt, never trained; the turn's generated part is the rest of
``render(messages[:i+1])``, through its end-of-turn marker(s), without a separator after the last marker and
without text the template appends after every render.

The oracle reads nothing from the engine (no probed layout). What it takes as given are documented facts of the
template: its end markers. Applied to one conversation::

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

1. ``start``: where the turn's render and the generation-prompt render of the turns
   before it part. Where the turn's render writes the whole prompt, at its end: every
   character the generation prompt writes is prompt. Where it writes only the start of
   the generation prompt's own text (reasoning dropped from history, an empty block
   pre-filled where the turn has reasoning, a preamble no turn writes), where they part,
   moved back out of a marker it cuts through (an added token, or ``<...>`` / ``[...]``
   written as plain text: ``<|A|><think>`` and ``<|A|></think>`` part after ``<|A|>``).
   Where they part before the generation prompt's own text (inside an earlier message:
   a tool result written differently when it is the last message), where that text ends
   in the turn's render after the parting point; where the turn's render does not write
   it there (Mistral moves the system prompt, its prompt writes nothing of its own), the
   row is undecided;
2. the generated part is the rest of the render through turn *i*, cut after its
   last end marker (what follows is a separator, or text the template appends
   after every render such as the first Llama 3 template's assistant header);
   an end marker inside the turn's own content or call (a name, an argument value)
   is the turn's text, not its end (assistant text holding markers is trained as written);
3. it must stand at ``start`` in the full render (prefix stability); where it
   has no end marker of its own, an end marker the full render writes right
   after it is the turn's (GLM's next header; an end marker written only where a
   user turn follows), whitespace before that marker included; without one,
   trailing whitespace is cut;
4. the turn's content (up to surrounding whitespace), its tool calls' names and
   scalar argument values must lie inside the span; spans are in order.

With ``think_loss="answer_only"`` the verdict's ``spans`` are each turn's answer: from where the template
starts writing the message's content (found by rendering the turn with a marker character before its content:
the template's separator after the reasoning block is not the answer's, the content's own leading whitespace
is) through the turn's end; ``masked`` are the characters that must not be trained (the turn's start through
its rendered reasoning). ``check_kept_row`` then checks that the answer's tokens are trained, the reasoning's are
not, and nothing outside the ``think_loss="all"`` spans is (``free``: the block's tags and separator, either way).

The character-level common prefix can reach into a turn's own text where the
generation prompt's last characters equal the answer's first ones (a preamble
"Let me ..." and an answer "Let ..."): the rule as stated does not train them,
and neither does the oracle.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from jinja2 import TemplateError

DECIDED, REFUSE, UNDECIDED = "decided", "refuse", "undecided"
# what rendering a template can raise on a row: raise_exception, undefined values (TemplateError), a dict
# concatenated to a string (TypeError)
TEMPLATE_ERRORS = (TemplateError, TypeError)
THINK_LOSSES = ("all", "answer_only")  # what the oracle judges (answer_plus_think: not here)


@dataclass(frozen=True)
class Verdict:
    kind: str  # DECIDED, REFUSE or UNDECIDED
    text: str = ""  # the full render ("" when it raised)
    spans: tuple[tuple[int, int], ...] = ()  # trained character spans of text (DECIDED only)
    reason: str = ""  # why REFUSE / UNDECIDED, naming the message
    turns: tuple[int, ...] = field(default=())  # message index of each span
    cuts: tuple[int, ...] = ()  # where the text is tokenized cut (``tokens``): each judged turn's start (and, with
    # answer_only, where each answer starts after its masked reasoning block)
    # think_loss="answer_only" (DECIDED): characters that must not be trained (each turn's start through its
    # rendered reasoning), and the spans think_loss="all" trains: a token trained outside them is wrong
    masked: tuple[tuple[int, int], ...] = ()
    whole: tuple[tuple[int, int], ...] | None = None
    answer_only: bool = False  # judged with think_loss="answer_only"


_SHIFT = "\x01"  # put before a turn's content to see where the template starts writing it (no template trims it)
_BRACKETED = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")  # a marker written as plain text: '<think>', '[INST]'


def _render(tok, messages, tools, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)


def _out_of_marker(tok, text: str, n: int) -> int:
    """``n``, or the start of the marker of ``text`` it falls inside: an added token, or a bracketed marker written
    as plain text (a prompt ``<|A|><think>`` and a turn ``<|A|></think>`` part inside ``<think>``: at its start)."""
    spans = [(m.start(), m.end()) for m in _BRACKETED.finditer(text)]
    for t in tok.get_added_vocab():
        k = text.find(t) if t else -1
        while k >= 0:
            spans.append((k, k + len(t)))
            k = text.find(t, k + 1)
    moved = True
    while moved:
        moved = False
        for a, b in spans:
            if a < n < b:
                n, moved = a, True
    return n


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


def _own_end(message: dict, generated: str) -> int:
    """Where the message's own text first ends in its generated part: its content (stripped), then each call's name
    and scalar argument values, each looked for after the one before (0 where none is written there; first
    occurrences: a one-letter answer is also inside the markers after it). An end marker before that is the
    message's own text (an answer or an argument value holding one), not its end."""
    at = end = 0
    content = (message.get("content") or "").strip()
    parts = [content] if content else []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        parts += [fn["name"], *(v for v in _scalars(fn.get("arguments")) if v.strip())]
    for part in parts:
        k = generated.find(part, at)
        if k >= 0:
            at = end = k + len(part)
    return end


def _turn_start(tok, prompt: str, turn: str, bare: str) -> tuple[int | None, str]:
    """Where turn ``i``'s generated part starts in ``turn`` = render(messages[:i+1]), from ``prompt`` =
    render(messages[:i], add_generation_prompt=True) and ``bare`` = render(messages[:i]) -> ``(start, "")``, or
    ``(None, why)`` where the turn's render does not show where its prompt ends (step 1 of the module doc)."""
    n = len(os.path.commonprefix([prompt, turn]))
    if n >= len(prompt):
        return len(prompt), ""  # the whole prompt written: it ends there
    own = len(os.path.commonprefix([bare, prompt]))  # where the generation prompt's own text starts
    if n >= own:  # part of the generation prompt's own text written: they part there, not inside a marker
        return max(own, _out_of_marker(tok, prompt, n)), ""
    # they part inside the conversation before the turn: after the generation prompt's own text where the turn's
    # render writes it after the parting point, or as much of it as it writes there (not ending inside a marker)
    written, found = prompt[own:], []
    for m in range(len(written), 0, -1):
        if written[:m].strip() and _out_of_marker(tok, written, m) == m and (k := turn.find(written[:m], n)) >= 0:
            found.append((k, -m))  # the first place it is written, as much of it as is written there
    if not found:
        return None, ("the render through the turn writes the conversation before it differently from the prompt, "
                      "and not the generation prompt's text after that")
    k, m = min(found)
    return k - m, ""


def _answer_start(tok, messages: list[dict], i: int, tools, turn: str, start: int, end: int) -> int:
    """Where the template starts writing message ``i``'s content in ``turn`` (its render through the turn): where
    that render and one with a marker character before the content part (``start`` where it is not inside the
    span). The separator a template writes after a reasoning block is before it, the content's own leading
    whitespace after it."""
    shifted = {**messages[i], "content": _SHIFT + (messages[i].get("content") or "")}
    try:
        alt = _render(tok, [*messages[:i], shifted], tools, False)
    except TEMPLATE_ERRORS:
        return start
    k = len(os.path.commonprefix([turn, alt]))
    return k if start <= k <= end and alt.startswith(_SHIFT, k) else start


def _reasoning_end(message: dict, turn: str, start: int, end: int) -> int:
    """The end of the message's reasoning as the turn writes it (``start`` where it writes none)."""
    reasoning = (message.get("reasoning_content") or message.get("thinking") or "").strip()
    k = turn.find(reasoning, start, end) if reasoning else -1
    return k + len(reasoning) if k >= 0 else start


def prefix_oracle(tok, messages: Sequence[dict], *, tools: list | None = None, end_markers: Sequence[str],
                  trained: range | None = None, think_loss: str = "all") -> Verdict:
    """The trained spans of every assistant message of ``messages`` per the rule (see the module doc); with
    ``trained``, only of the assistant messages whose index is in it (a preference pair's response), the others
    judged as context like any untrained message. The verdict's ``cuts`` are where the full render is cut before
    it is tokenized (``tokens``): each judged turn's start, where the oracle can place it. ``think_loss``: one of
    ``THINK_LOSSES`` (answer_only: each turn's answer, its ``masked`` reasoning; the module doc)."""
    assert think_loss in THINK_LOSSES, think_loss
    messages = list(messages)
    try:
        full = _render(tok, messages, tools, False)
    except TEMPLATE_ERRORS as err:
        return Verdict(REFUSE, reason=f"the template raises: {type(err).__name__}: {err}")
    spans, turns, cuts, masked, whole, cursor = [], [], [], [], [], 0
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
        start, why = _turn_start(tok, prompt, turn, bare)
        if start is not None and full.startswith(turn[:start]):  # the full render has the turn's prompt there
            cuts.append(start)
        else:  # where the turn's prompt ends in the full render, which writes it differently (reasoning dropped,
            # tools written before the last user message)
            at, _ = _turn_start(tok, prompt, full, bare)
            if at is None:
                own = len(os.path.commonprefix([bare, prompt]))
                at = _aligned_end(prompt, full, cuts[-1] if cuts else 0, len(prompt) - own)
            if at is not None:
                cuts.append(at)
        if start is None:
            fail(UNDECIDED, f"messages[{i}]: {why}")
            continue
        if failed:
            continue  # only where the turns after it start (the tokens are compared even where not decided)
        generated = turn[start:]
        after = _own_end(message, generated)  # an end marker inside the content or a call is the turn's own text
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
            whole.append((start, end))
            if think_loss == "answer_only":
                answer = _answer_start(tok, messages, i, tools, turn, start, min(end, len(turn)))
                masked.append((start, _reasoning_end(message, turn, start, answer)))
                if answer > start and answer not in cuts:
                    cuts.append(answer)  # a masked block before the answer: the text is cut where it starts
                spans.append((answer, end))
            else:
                spans.append((start, end))
            turns.append(i)
        cursor = end
    if failed:
        return Verdict(failed[0], full, reason=failed[1], cuts=tuple(cuts), answer_only=think_loss == "answer_only")
    if think_loss == "answer_only":
        return Verdict(DECIDED, full, tuple(spans), turns=tuple(turns), cuts=tuple(sorted(cuts)), masked=tuple(masked),
                       whole=tuple(whole), answer_only=True)
    return Verdict(DECIDED, full, tuple(spans), turns=tuple(turns), cuts=tuple(cuts))


def pair_oracle(tok, prompt: Sequence[dict], responses: dict[str, Sequence[dict]], *, tools: list | None = None,
                end_markers: Sequence[str], think_loss: str = "all") -> dict[str, Verdict]:
    """Each side of a preference pair (``responses``: side -> its messages) judged with only its response's turns
    trained, each side's text cut also where the pair's prompt ends: the earlier of the sides' starts (a side whose
    turn writes more of the generation prompt's text, an empty block it pre-fills, starts later), as training
    tokenizes a pair so that both sides' prompt tokens are the same."""
    prompt = list(prompt)
    verdicts = {side: prefix_oracle(tok, prompt + list(r), tools=tools, end_markers=end_markers, think_loss=think_loss,
                                    trained=range(len(prompt), len(prompt) + len(r))) for side, r in responses.items()}
    firsts = [min(v.cuts) for v in verdicts.values() if v.cuts]
    if len(firsts) == len(verdicts):
        shared = min(firsts)
        verdicts = {side: dataclasses.replace(v, cuts=tuple(sorted({*v.cuts, shared}))) for side, v in verdicts.items()}
    return verdicts


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
    if verdict.answer_only and verdict.kind != REFUSE:  # each answer's cut where the engine has it
        found = _answer_cut_tokens(tok, verdict, list(input_ids))
        if found is None:
            return RowCheck(text_differs=True)
        ids, offsets = found
    else:
        ids, offsets = tokens(tok, verdict.text, verdict.cuts)
    if ids != list(input_ids):
        return RowCheck(text_differs=True)
    if verdict.kind == DECIDED and verdict.whole is not None:  # answer_only: the answers exactly, no reasoning
        required = token_mask(offsets, char_mask(verdict.text, verdict.spans))
        allowed = token_mask(offsets, char_mask(verdict.text, verdict.whole))
        masked = token_mask(offsets, char_mask(verdict.text, verdict.masked))
        return RowCheck(False, wrong=sum(t and (m or not a) for t, a, m in zip(trained, allowed, masked)),
                        missed=sum(r and not t for t, r in zip(trained, required)))
    if verdict.kind == DECIDED:
        expected = token_mask(offsets, char_mask(verdict.text, verdict.spans))
        return RowCheck(False, wrong=sum(t and not e for t, e in zip(trained, expected)),
                        missed=sum(e and not t for t, e in zip(trained, expected)))
    if verdict.kind == REFUSE:
        return RowCheck(False, wrong=sum(trained))
    return RowCheck(False, weak=weak_violations(verdict.text, messages, offsets, trained, trained_messages))


_ANSWER_WITHIN = 64  # an undecided answer_only row: where its answer's cut may be, after the turn's start


def _answer_cut_tokens(tok, verdict: Verdict, input_ids: list[int]) -> tuple[list[int], list] | None:
    """An answer_only verdict's tokens with each answer's cut where the engine's ids show it: anywhere from the
    turn's start through its answer's first character (the masked block and the separator are either's; where the
    text is cut there changes which tokens they make, never what must be trained), or nowhere. None where no
    placement gives the engine's ids."""
    text = verdict.text
    answers = {a for (w, _), (a, _) in zip(verdict.whole or (), verdict.spans) if a > w}
    bounds = [0, *sorted(c for c in set(verdict.cuts) - answers if 0 < c < len(text)), len(text)]
    ids, offsets = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        a = next((a for a in answers if lo < a < hi), None)
        if a is not None:
            options = [a, None, *range(lo + 1, a)]
        elif verdict.kind == UNDECIDED and lo > 0:  # no answer placed: its cut within the turn's first characters
            options = [None, *range(lo + 1, min(hi, lo + _ANSWER_WITHIN))]
        else:
            options = [None]
        for cut in options:
            piece_ids, piece_offsets = tokens(tok, text[lo:hi], [] if cut is None else [cut - lo])
            if input_ids[len(ids):len(ids) + len(piece_ids)] == piece_ids:
                ids += piece_ids
                offsets += [(x + lo, y + lo) for x, y in piece_offsets]
                break
        else:
            return None
    return ids, offsets


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
