"""Preference pairs (DPO, ORPO): a raw row -> a prompt and two responses -> two sequences sharing the prompt.

    >>> pair = canonicalize_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"})
    >>> pair.prompt, pair.chosen
    ([{'role': 'user', 'content': '2+2?'}], [{'role': 'assistant', 'content': '4'}])
    >>> ex = build_preference_example(pair.prompt, pair.chosen, pair.rejected, tok)  # Qwen3's template
    >>> tok.decode(ex["chosen_input_ids"][:ex["prompt_length"]])
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
    >>> tok.decode([t for t in ex["rejected_labels"] if t != -100])
    '<think>\\n\\n</think>\\n\\n5<|im_end|>'

A side is exactly what SFT trains for the conversation ``prompt + response`` with only the response's
assistant turns marked trained (``mark_side``): the same parse (``parse.canonical_messages``), the same one
render and verified walk (``render.render_conversation``, the general path behind it), the same tokenization and
labels (``tokenize.encode_batch``, ``make_labels``). Nothing here finds a turn: the boundary between prompt and
response is where ``render_conversation`` says the response's first turn starts its generated part
(``TurnSpan.start``: after the header, ``[/INST]`` or whatever the template's prompt side writes).

The shared prompt (``shared_prompt_length``), checked on every pair:

- the two renders are identical up to that boundary (else ``pair_prompt_differs``);
- the tokens wholly before the boundary are the same ids on both sides (else ``pair_prompt_differs``); their
  count (the fewer of the two sides') is ``prompt_length``;
- one boundary token per side may differ: where the tokenizer merged the prompt's last characters with the
  response's first ones (ChatML's header ``\\n`` + content `` \\nx`` -> ``\\n \\n``, while the other side keeps
  ``\\n`` alone). It is labelled by SFT's first-character rule on each side alike: it starts in the prompt, so it
  is never trained. It is not counted in ``prompt_length``; ``boundary_merges`` says on how many sides a token
  straddles the boundary. More than one differing token starting in the prompt is ``pair_prompt_differs``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from qlora_train.config import DataConfig
from qlora_train.data.messages import DropReason, Message, RowRejected, check_unicode
from qlora_train.data.parse import (
    ParseReport,
    canonical_messages,
    content_text,
    instruction_prompt,
    map_fields,
    row_tools,
)
from qlora_train.data.policy import DEFAULT_POLICY, LossPolicy
from qlora_train.data.render import RenderedConversation, render_conversation
from qlora_train.data.tokenize import IGNORE_INDEX, encode_batch, make_labels, project_char_mask
from qlora_train.data.truncate import exchanges_to_fit, measure, middle_exchanges

SIDES = ("chosen", "rejected")
# the layouts of a preference row canonicalize_pair reads (CanonicalPair.format)
PAIR_FORMATS = ("prompt_chosen_rejected", "instruction", "implicit_prompt", "hh_rlhf")
PROMPT_KEYS = ("prompt", "question")  # an explicit prompt: a string or a message list
RESPONSE_ROLES = ("assistant", "tool")  # what a response may hold: the model's turns and the tool results they get


@dataclass
class CanonicalPair:
    """A preference row in canonical messages (not yet marked: ``build_preference_example`` marks them)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    tools: list[dict] | None
    format: str  # one of PAIR_FORMATS
    score_chosen: float | None = None  # for data.min_score_margin (check_score_margin)
    score_rejected: float | None = None
    report: ParseReport = field(default_factory=ParseReport)


# ----------------------------------------------------------------------------------------------- the row's format


def canonicalize_pair(row: dict, cfg: DataConfig | None = None, *, tokenizer=None) -> CanonicalPair:
    """A raw preference row -> ``CanonicalPair``, or ``RowRejected`` with a reason.

    Formats (after ``cfg.field_mappings``), in this order:

    - ``prompt_chosen_rejected``: ``prompt`` (or ``question``) a string or a message list; ``chosen`` and
      ``rejected`` each a string (one assistant answer; an inline ``<think>`` block is its reasoning) or a
      message list (the response: assistant turns and tool results) — TRL's standard and conversational forms;
    - ``instruction``: ``instruction`` (+ ``input``, joined as for Alpaca rows: ``data.format``) with ``chosen``
      and ``rejected``;
    - ``implicit_prompt``: ``chosen`` and ``rejected`` whole conversations (message lists) that share their
      beginning: the prompt is the longest shared message prefix that both sides follow with an assistant
      message;
    - ``hh_rlhf``: ``chosen`` and ``rejected`` Anthropic HH transcripts (``\\n\\nHuman: …\\n\\nAssistant: …``),
      split into messages (each stripped), then as ``implicit_prompt``.

    Messages go through the chat rows' normalisation (``parse.canonical_messages``: role and key mappings,
    reasoning keys, inline think blocks, tool calls, ``think_mode``); tools through ``parse.row_tools``. A
    ``system`` string column opens the prompt unless the prompt has a system message. ``score_chosen`` /
    ``score_rejected`` (numbers) are kept. A row with ``completion`` and ``label`` and no pair (KTO's unpaired
    form) is refused as ``unpaired_preference``.
    """
    cfg = cfg or DataConfig()
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"row is a {type(row).__name__}, not a mapping")
    row = map_fields(row, cfg.field_mappings)
    report = ParseReport(schema="preference", schemas={"preference": 1}, rows=1)
    present = [side for side in SIDES if row.get(side) is not None]
    if len(present) < 2:
        if "completion" in row and "label" in row:
            raise RowRejected(DropReason.UNPAIRED_PREFERENCE, "an unpaired preference row (KTO: prompt, completion, "
                              "label) is not supported: preference training needs a chosen and a rejected response "
                              "to the same prompt")
        raise RowRejected(DropReason.PAIR_MISSING_SIDE, f"a preference row needs 'chosen' and 'rejected'; it has "
                          f"{' and '.join(present) or 'neither'} (keys {sorted(row)[:8]})")

    def messages(value, where: str, role: str = "assistant") -> list[Message]:
        return _messages(value, where, role, cfg, report, tokenizer)

    prompt_key = next((k for k in PROMPT_KEYS if k in row), None)
    if prompt_key is not None or "instruction" in row:
        fmt = "prompt_chosen_rejected" if prompt_key is not None else "instruction"
        prompt_value = row[prompt_key] if prompt_key is not None else instruction_prompt(row, cfg)
        prompt = messages(prompt_value, prompt_key or "instruction", "user")
        chosen, rejected = messages(row["chosen"], "chosen"), messages(row["rejected"], "rejected")
    elif all(isinstance(row[side], list) for side in SIDES):
        fmt = "implicit_prompt"
        prompt, chosen, rejected = split_shared_prompt(messages(row["chosen"], "chosen"),
                                                       messages(row["rejected"], "rejected"))
    elif all(isinstance(row[side], str) and _is_hh(row[side]) for side in SIDES):
        fmt = "hh_rlhf"
        prompt, chosen, rejected = split_shared_prompt(messages(hh_messages(row["chosen"]), "chosen"),
                                                       messages(hh_messages(row["rejected"]), "rejected"))
    else:
        raise RowRejected(DropReason.UNKNOWN_SCHEMA, "'chosen' and 'rejected' without a prompt must be whole "
                          "conversations (message lists) or HH-RLHF transcripts ('\\n\\nHuman: …\\n\\nAssistant: …'); "
                          f"got {type(row['chosen']).__name__} and {type(row['rejected']).__name__} "
                          f"(keys {sorted(row)[:8]})")
    system = row.get("system")
    if isinstance(system, str) and system and not any(m["role"] == "system" for m in prompt):
        prompt = messages([{"role": "system", "content": system}], "system", "system") + prompt
    scores = [_score(row, f"score_{side}") for side in SIDES]
    check_pair(prompt, chosen, rejected)
    return CanonicalPair(prompt, chosen, rejected, row_tools(row, cfg, report), fmt, *scores, report=report)


def _messages(value, where: str, role: str, cfg: DataConfig, report: ParseReport, tokenizer) -> list[Message]:
    """A string (one message of ``role``) or a message list -> canonical messages; errors name ``where``."""
    if isinstance(value, str):
        raw = [{"role": role, "content": value}]
    elif isinstance(value, list):
        raw = value
    else:
        raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"{where}: expected a string or a list of messages, got "
                          f"{type(value).__name__}")
    first = raw[0] if raw and isinstance(raw[0], dict) else {}
    schema = "sharegpt" if "from" in first and "value" in first else "messages"
    try:
        return canonical_messages(raw, cfg, report, schema=schema, tokenizer=tokenizer)
    except RowRejected as rej:
        raise RowRejected(rej.reason, f"{where}: {rej.detail}") from None


_HH_SPEAKER = re.compile(r"\n\n(Human|Assistant):")


def _is_hh(text: str) -> bool:
    return text.lstrip().startswith("Human:")


def hh_messages(text: str) -> list[dict]:
    """An Anthropic HH transcript -> messages, each content stripped.

    >>> hh_messages("\\n\\nHuman: Hi?\\n\\nAssistant: Hello.")
    [{'role': 'user', 'content': 'Hi?'}, {'role': 'assistant', 'content': 'Hello.'}]
    """
    parts = _HH_SPEAKER.split("\n\n" + text.lstrip())
    return [{"role": "user" if speaker == "Human" else "assistant", "content": body.strip()}
            for speaker, body in zip(parts[1::2], parts[2::2])]


def split_shared_prompt(chosen: list[Message], rejected: list[Message]
                        ) -> tuple[list[Message], list[Message], list[Message]]:
    """Two whole conversations -> ``(prompt, chosen response, rejected response)``: the prompt is their longest
    shared message prefix that both continue with an assistant message.

    >>> u, a, b = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, \\
    ...     {"role": "assistant", "content": "b"}
    >>> split_shared_prompt([u, a], [u, b])
    ([{'role': 'user', 'content': 'q'}], [{'role': 'assistant', 'content': 'a'}], [{'role': 'assistant', \
'content': 'b'}])
    """
    if chosen == rejected:
        raise RowRejected(DropReason.PAIR_IDENTICAL, "chosen and rejected are the same conversation")
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    while k > 0 and not (k < len(chosen) and k < len(rejected)
                         and chosen[k]["role"] == rejected[k]["role"] == "assistant"):
        k -= 1
    if k == 0:
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, "chosen and rejected share no messages that both continue "
                          "with an assistant turn: there is no common prompt")
    return chosen[:k], chosen[k:], rejected[k:]


def _score(row: dict, key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowRejected(DropReason.BAD_ROW, f"{key}: expected a finite number, got {value!r}")
    return float(value)


def check_pair(prompt: list[Message], chosen: list[Message], rejected: list[Message]) -> None:
    """The shape of a pair, before any render: a prompt that ends with a user turn or a tool result; two responses
    that differ, each opening with an assistant turn, holding only assistant turns and tool results, ending with
    an assistant turn, none of them empty. Raises ``RowRejected`` naming the side and message."""
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        last = f"ends with a {prompt[-1]['role']} message" if prompt else "is empty"
        raise RowRejected(DropReason.PAIR_BAD_PROMPT, f"the prompt {last}: it must end with a user turn (or a tool "
                          "result) for a response to answer")
    for side, response in zip(SIDES, (chosen, rejected)):
        if not response:
            raise RowRejected(DropReason.PAIR_EMPTY_RESPONSE, f"{side}: no response")
        for j, m in enumerate(response):
            if m["role"] not in RESPONSE_ROLES:
                raise RowRejected(DropReason.PAIR_BAD_RESPONSE, f"{side}[{j}]: a {m['role']!r} message inside the "
                                  "response (a response holds assistant turns and tool results only)")
            if m["role"] == "assistant" and not (m["content"].strip() or m.get("tool_calls")
                                                 or m.get("reasoning_content")):
                raise RowRejected(DropReason.PAIR_EMPTY_RESPONSE, f"{side}[{j}]: empty assistant turn")
        if response[0]["role"] != "assistant" or response[-1]["role"] != "assistant":
            where, role = (0, response[0]["role"]) if response[0]["role"] != "assistant" else (
                len(response) - 1, response[-1]["role"])
            raise RowRejected(DropReason.PAIR_BAD_RESPONSE, f"{side}[{where}]: the response must open and end with "
                              f"an assistant turn, not a {role!r} message")
    if _unmarked(chosen) == _unmarked(rejected):
        raise RowRejected(DropReason.PAIR_IDENTICAL, "chosen and rejected are the same response")


def _unmarked(messages: list[Message]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "train"} for m in messages]


# ------------------------------------------------------------------------------------------- the pair's two sides


def pair_policy(policy: LossPolicy) -> LossPolicy:
    """The policy a pair's sides are rendered with: ``policy``'s ``think_loss`` and ``train_on_eos``, except that
    ``all`` trains only the response's end markers (``turn``: a prompt message's marker is never trained), and no
    ``last_turn_only`` (every assistant turn of a response is trained). Which messages are trained is not the
    role rules' to decide: ``mark_side`` marks them."""
    return replace(policy, last_turn_only=False,
                   train_on_eos="turn" if policy.train_on_eos == "all" else policy.train_on_eos)


def mark_side(prompt: list[Message], response: list[Message], policy: LossPolicy) -> list[Message]:
    """``prompt + response`` with their ``train`` flags: no prompt message trained, every assistant turn of the
    response trained, its tool results not (a message's own ``training`` flag is not read for a pair)."""
    flagged = [{**m, "train": False} for m in prompt] + [{**m, "train": m["role"] == "assistant"} for m in response]
    return policy.mark(flagged)


def _check_messages(messages, where: str) -> None:
    """Messages handed to ``build_preference_example`` directly: a list of mappings with a string role and
    string content."""
    if not isinstance(messages, list):
        raise RowRejected(DropReason.BAD_ROW, f"{where}: expected a list of messages, got {type(messages).__name__}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RowRejected(DropReason.BAD_ROW, f"{where}[{j}]: expected a mapping with a role")
        if not isinstance(m.get("content"), str):
            content_text(m.get("content"), f"{where}[{j}]")  # names what is wrong; text parts are for the parse
            raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"{where}[{j}]: content must be a string (canonical "
                              "messages: canonicalize_pair makes them)")


def build_preference_example(
    prompt: list[Message],
    chosen: list[Message],
    rejected: list[Message],
    tokenizer,
    *,
    tools: list[dict] | None = None,
    policy: LossPolicy = DEFAULT_POLICY,
    max_length: int | None = None,
) -> dict:
    """A prompt and two responses (canonical messages) -> the pair's two sequences, or ``RowRejected``.

    Returns ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_labels`` and the same for ``rejected``
    (each exactly what SFT makes for ``prompt + response`` with only the response's assistant turns trained:
    reasoning per ``policy.think_loss``, content, tool calls, end-of-turn markers per ``pair_policy``);
    ``prompt_length``, the tokens both sides share before the response (``shared_prompt_length``);
    ``boundary_merges``, on how many sides a token straddles the boundary; ``reasoning_dropped_turns``, response
    turns whose reasoning the template does not render (trained without it, as SFT's ``reasoning_history:
    drop``).

    Refused: a pair of the wrong shape (``check_pair``), a side the template or the mask check refuses (its
    reason, the detail naming the side), a prompt rendered or tokenized differently on the two sides
    (``pair_prompt_differs``), two sides with the same ids (``pair_identical``), and, with ``max_length``, a side
    longer than it (``too_long``; ``fit_pair`` drops prompt exchanges first).
    """
    for where, messages in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        _check_messages(messages, where)
    check_pair(prompt, chosen, rejected)
    side_policy = pair_policy(policy)
    rendered = {side: _render_side(side, mark_side(prompt, response, side_policy), tokenizer, tools, side_policy)
                for side, response in zip(SIDES, (chosen, rejected))}
    boundary = {side: next(t.start for t in r.turns if t.index == len(prompt)) for side, r in rendered.items()}
    encoded = dict(zip(SIDES, encode_batch([rendered[side].text for side in SIDES], tokenizer)))
    if encoded["chosen"][0] == encoded["rejected"][0]:
        raise RowRejected(DropReason.PAIR_IDENTICAL, "chosen and rejected render to the same tokens")
    prompt_length, merges = shared_prompt_length(rendered, boundary, encoded)
    out = {"prompt_length": prompt_length, "boundary_merges": merges,
           "reasoning_dropped_turns": sum(t.reasoning_dropped for r in rendered.values() for t in r.turns)}
    for side in SIDES:
        ids, offsets = encoded[side]
        if max_length is not None and len(ids) > max_length:
            raise RowRejected(DropReason.TOO_LONG, f"{side}: {len(ids)} tokens > max_length={max_length} "
                              "(fit_pair drops prompt exchanges first)")
        example = make_labels(ids, project_char_mask(offsets, rendered[side].char_mask))
        out.update({f"{side}_{key}": value for key, value in example.items()})
    return out


def _render_side(side: str, messages: list[Message], tokenizer, tools, policy: LossPolicy) -> RenderedConversation:
    try:
        rendered = render_conversation(messages, tokenizer, tools=tools, policy=policy)
        check_unicode(rendered.text, rendered.message_ends)
        return rendered
    except RowRejected as rej:
        raise RowRejected(rej.reason, f"{side}: {rej.detail} (messages counted over prompt + response)") from None


def shared_prompt_length(rendered: dict[str, RenderedConversation], boundary: dict[str, int],
                         encoded: dict[str, tuple]) -> tuple[int, int]:
    """The prompt both sides share -> ``(prompt_length, boundary_merges)``, or ``pair_prompt_differs``.

    ``boundary[side]`` is where the side's response starts its generated part in its render. The renders must be
    the same text before it. ``prompt_length`` is the fewer of the two sides' tokens wholly before it; those ids
    must be the same on both sides. After them, each side may have at most one more token starting in the prompt:
    the boundary token, which either straddles the boundary (the tokenizer merged the prompt's end with the
    response's start; counted in ``boundary_merges``) or ends at it where the other side merged it. It starts in
    the prompt, so the first-character rule leaves it untrained on both sides.
    """
    chosen, rejected = (rendered[side].text[:boundary[side]] for side in SIDES)
    if chosen != rejected:
        k = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"the template renders the prompt differently for chosen "
                          f"and rejected (first difference at char {k}: {chosen[k:k + 20]!r} vs "
                          f"{rejected[k:k + 20]!r})")
    before = {side: encoded[side][1].tokens_before(boundary[side], len(rendered[side].text)) for side in SIDES}
    prompt_length = min(whole for whole, _ in before.values())
    ids_c, ids_r = encoded["chosen"][0], encoded["rejected"][0]
    if ids_c[:prompt_length] != ids_r[:prompt_length]:
        k = next(i for i, (a, b) in enumerate(zip(ids_c, ids_r)) if a != b)
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"the prompt tokenizes differently for chosen and rejected "
                          f"(token {k} of the {prompt_length} before the boundary differs)")
    unshared = {side: starting - prompt_length for side, (_, starting) in before.items()}
    if max(unshared.values()) > 1:
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"the prompt's last tokens differ between chosen and "
                          f"rejected beyond one boundary token (tokens starting in the prompt after the shared "
                          f"{prompt_length}: {unshared['chosen']} and {unshared['rejected']})")
    return prompt_length, sum(starting - whole for whole, starting in before.values())


# ------------------------------------------------------------------------------- filters and truncation of a pair


def check_score_margin(pair: CanonicalPair, min_margin: float | None) -> None:
    """``data.min_score_margin``: a pair whose ``score_chosen - score_rejected`` is below ``min_margin``, or that
    lacks either score, is refused as ``below_score_margin`` (``None``: no filter).

    >>> check_score_margin(CanonicalPair([], [], [], None, "instruction", 7.0, 6.5), 1.0)
    Traceback (most recent call last):
    ...
    qlora_train.data.messages.RowRejected: below_score_margin: score_chosen - score_rejected = 0.5 < \
data.min_score_margin=1
    """
    if min_margin is None:
        return
    if pair.score_chosen is None or pair.score_rejected is None:
        missing = " and ".join(k for k, v in (("score_chosen", pair.score_chosen),
                                              ("score_rejected", pair.score_rejected)) if v is None)
        raise RowRejected(DropReason.BELOW_SCORE_MARGIN, f"no {missing}: data.min_score_margin={min_margin:g} "
                          "compares the two scores")
    margin = pair.score_chosen - pair.score_rejected
    if margin < min_margin:
        raise RowRejected(DropReason.BELOW_SCORE_MARGIN, f"score_chosen - score_rejected = {margin:g} < "
                          f"data.min_score_margin={min_margin:g}")


@dataclass(frozen=True)
class FittedPair:
    """A pair's example within ``max_length`` (``fit_pair``) and what fitting it took."""

    example: dict  # build_preference_example's columns
    tokens_before: int  # both sides' tokens before truncation
    dropped_turns: int  # middle prompt exchanges dropped (0: the pair fitted as it was)


def side_lengths(example: dict) -> dict[str, int]:
    """``{"chosen": tokens, "rejected": tokens}`` of a pair's example."""
    return {side: len(example[f"{side}_input_ids"]) for side in SIDES}


def trained_tokens(example: dict) -> int:
    """Trained tokens of both sides together."""
    return sum(len(example[f"{side}_labels"]) - example[f"{side}_labels"].count(IGNORE_INDEX) for side in SIDES)


def fit_pair(pair: CanonicalPair, tokenizer, *, max_length: int, policy: LossPolicy = DEFAULT_POLICY,
             on_too_long: str = "truncate") -> FittedPair:
    """A canonical pair -> its example with both sides within ``max_length`` tokens, or ``RowRejected``.

    Both sides share one prompt, so only the prompt is shortened, as SFT's structured truncation shortens a
    conversation: the leading system message(s) and the last exchange (the last user message and what follows
    it in the prompt) are kept, and whole middle exchanges are dropped, oldest first, as many as the longer
    side's one render says are needed (``truncate.exchanges_to_fit``), then one more at a time until both sides
    fit. A response is never cut: a pair still too long with every middle exchange gone, or any pair over
    ``max_length`` with ``on_too_long: drop``, is refused as ``too_long``, naming the side and its tokens.
    """
    example = build_preference_example(pair.prompt, pair.chosen, pair.rejected, tokenizer, tools=pair.tools,
                                       policy=policy)
    lengths = side_lengths(example)
    before = sum(lengths.values())
    longer = max(SIDES, key=lengths.__getitem__)
    if lengths[longer] <= max_length:
        return FittedPair(example, before, 0)
    if on_too_long == "drop":
        raise RowRejected(DropReason.TOO_LONG, f"{longer}: {lengths[longer]} tokens > max_length={max_length} "
                          "(data.on_too_long: drop)")
    groups = middle_exchanges(pair.prompt)
    n = 0
    if groups:
        side_policy = pair_policy(policy)
        response = pair.chosen if longer == "chosen" else pair.rejected
        measured = measure(mark_side(pair.prompt, response, side_policy), tokenizer, tools=pair.tools,
                           policy=side_policy)
        n = max(1, exchanges_to_fit(measured, groups, max_length))
    while 0 < n <= len(groups):
        drop = {i for group in groups[:n] for i in group}
        prompt = [m for i, m in enumerate(pair.prompt) if i not in drop]
        example = build_preference_example(prompt, pair.chosen, pair.rejected, tokenizer, tools=pair.tools,
                                           policy=policy)
        lengths = side_lengths(example)
        longer = max(SIDES, key=lengths.__getitem__)
        if lengths[longer] <= max_length:
            return FittedPair(example, before, n)
        n += 1
    raise RowRejected(DropReason.TOO_LONG, f"{longer}: {lengths[longer]} tokens > max_length={max_length} with "
                      f"{len(groups)} of {len(groups)} middle prompt exchanges dropped (a pair keeps the system "
                      "message, the prompt's last exchange and both whole responses)")
