"""Stage 4: fit a conversation into ``max_length`` tokens while keeping what matters.

It runs on the render and tokens of stages 2 and 3, only for a conversation over ``max_length``; the result
(``TruncationResult``) says how many exchanges were dropped, how many reasoning tokens trimmed, and whether the
token-level cut is still needed.

Order of actions, each only if the previous was not enough:

1. keep the leading system message(s) (and the tools, which the template
   renders), and the latest exchange: the last user message and everything
   after it (tool calls, tool results, the final answer);
2. drop the oldest middle exchanges first, whole exchanges at a time (a user
   message and the turns answering it), so no assistant turn loses its question;
3. trim ``reasoning_content`` of kept turns whose reasoning is rendered, from
   the end of the longest one;
4. otherwise report ``needs_token_fallback`` (the tokenize stage cuts tokens on
   ``truncate_side``).

Lengths are counted on ONE render + tokenization: each message's token cost is
read off the token offsets of its rendered segment, so dropping turns needs no
re-render per turn; the choice is then confirmed by one re-render.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qlora_train.masking import DEFAULT_POLICY, LossPolicy, MaskedConversation, Message, mask_conversation

_TRIM_MARGIN = 2  # tokens of slack when trimming reasoning (BPE merges at the cut)
_MAX_ROUNDS = 8


@dataclass
class TruncationResult:
    messages: list[Message]
    num_tokens_before: int
    num_tokens_after: int
    dropped_messages: int = 0
    dropped_turns: int = 0
    reasoning_trimmed_tokens: int = 0
    needs_token_fallback: bool = False
    final: MaskedConversation | None = field(default=None, repr=False)  # the example of ``messages``


def measure(messages, tokenizer, *, tools=None, policy: LossPolicy = DEFAULT_POLICY) -> MaskedConversation:
    """Marked messages -> their finished example, what truncation counts on (``masking.mask_conversation``)."""
    return mask_conversation(messages, tokenizer, tools=tools, policy=policy)


def _message_token_costs(m: MaskedConversation) -> np.ndarray:
    """Tokens starting inside each message's rendered segment (end of previous .. its end)."""
    starts = m.offsets.starts()
    bounds = np.searchsorted(starts, np.asarray((0,) + m.rendered.message_ends), side="left")
    return np.diff(bounds)


def exchanges_to_fit(measured: MaskedConversation, groups: list[list[int]], max_length: int) -> int:
    """How many of ``groups`` (message index lists, oldest first) to drop so that ``measured`` fits
    ``max_length``, estimated from each message's tokens in the one render (a re-render confirms it)."""
    costs = _message_token_costs(measured)
    estimate, n = measured.num_tokens, 0
    for group in groups:
        if estimate <= max_length:
            break
        estimate -= int(costs[group].sum())
        n += 1
    return n


def middle_exchanges(messages: list[Message]) -> list[list[int]]:
    """The exchanges truncation may drop, oldest first: every whole exchange (a user message and the turns
    answering it) between the leading system message(s) and the last user message.

    >>> middle_exchanges([{"role": "system"}, {"role": "user"}, {"role": "assistant"}, {"role": "user"}])
    [[1, 2]]
    """
    return _exchanges(messages)[2]


def _exchanges(messages: list[Message]) -> tuple[int, int, list[list[int]]]:
    """(end of protected head, start of protected tail, middle exchanges as index lists)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    users = [i for i, m in enumerate(messages) if m["role"] == "user" and i >= head]
    tail = users[-1] if users else len(messages)
    groups: list[list[int]] = []
    for i in range(head, tail):
        if messages[i]["role"] == "user" or not groups:
            groups.append([])
        groups[-1].append(i)
    return head, tail, groups


def structured_truncate_messages(
    messages: list[Message],
    tokenizer,
    *,
    max_length: int,
    tools: list[dict] | None = None,
    policy: LossPolicy = DEFAULT_POLICY,
    measured: MaskedConversation | None = None,
) -> TruncationResult:
    """Marked messages -> ``TruncationResult`` whose messages render to <= ``max_length`` tokens when possible.

    Kept messages keep their ``train`` flags: dropping an exchange never changes which turns are trained.

    ``measured`` may pass in the render + tokenization of ``messages`` already
    made by the caller, so the common no-truncation case costs nothing extra.
    The input list and its messages are never mutated.
    """
    current = measured or measure(messages, tokenizer, tools=tools, policy=policy)
    before = current.num_tokens
    result = TruncationResult(list(messages), before, before, final=current)
    if before <= max_length:
        return result

    # 2. drop whole middle exchanges, oldest first, sized on the one measured render
    groups = middle_exchanges(messages)
    result.dropped_turns = exchanges_to_fit(current, groups, max_length)
    drop = {i for group in groups[:result.dropped_turns] for i in group}
    kept = [m for i, m in enumerate(messages) if i not in drop]
    if drop:
        current = measure(kept, tokenizer, tools=tools, policy=policy)
        remaining = [g for g in groups if not drop.issuperset(g)]
        while current.num_tokens > max_length and remaining:  # estimate was short: drop one more
            drop.update(remaining.pop(0))
            result.dropped_turns += 1
            kept = [m for i, m in enumerate(messages) if i not in drop]
            current = measure(kept, tokenizer, tools=tools, policy=policy)
    result.dropped_messages = len(drop)

    # 3. trim rendered reasoning of kept turns, longest first
    kept, current, result.reasoning_trimmed_tokens = trim_reasoning(kept, current, max_length, tokenizer,
                                                                    tools=tools, policy=policy)

    result.messages = kept
    result.final = current
    result.num_tokens_after = current.num_tokens
    result.needs_token_fallback = current.num_tokens > max_length
    return result


def trim_reasoning(messages: list[Message], measured: MaskedConversation, max_length: int, tokenizer, *,
                   tools: list[dict] | None = None, policy: LossPolicy = DEFAULT_POLICY,
                   turns: range | None = None) -> tuple[list[Message], MaskedConversation, int]:
    """Trim the rendered ``reasoning_content`` of ``messages`` (those with an index in ``turns``; all without
    it), the longest first, from its end, until ``measured`` (their render) fits ``max_length`` or no rendered
    reasoning is left -> ``(messages, their render, reasoning tokens trimmed)``.

    Each round re-renders once; a message whose reasoning is trimmed to nothing loses the key. The input list
    and its messages are never mutated."""
    current, trimmed = measured, 0
    for _ in range(_MAX_ROUNDS):
        excess = current.num_tokens - max_length
        if excess <= 0:
            break
        starts = current.offsets.starts()
        best = None
        for turn in current.rendered.turns:
            if turn.reasoning and (turns is None or turn.index in turns):
                a, b = np.searchsorted(starts, turn.reasoning)
                if best is None or b - a > best[2] - best[1]:
                    best = (turn, int(a), int(b))
        if best is None:
            break
        turn, a, b = best
        n_reason = b - a
        keep = max(0, n_reason - excess - _TRIM_MARGIN)
        text = current.rendered.text
        new_reasoning = text[turn.reasoning[0]: int(starts[a + keep])].rstrip() if keep else ""
        msg = dict(messages[turn.index])
        msg["reasoning_content"] = new_reasoning
        if not new_reasoning:
            msg.pop("reasoning_content")
        messages = messages[: turn.index] + [msg] + messages[turn.index + 1:]
        trimmed += n_reason - keep
        current = measure(messages, tokenizer, tools=tools, policy=policy)
    return messages, current, trimmed
