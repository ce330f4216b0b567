"""``data.reasoning_history: expand``: train every turn's reasoning once, as the model sees the turn at inference.

For example, a Qwen3 conversation of two exchanges, both answers with reasoning: the full render drops the first
answer's reasoning, so the expansion adds one extra example (the first exchange, 2 messages, its answer trained
with its reasoning), moves turn 1 there (``moved == (1,)``) and leaves nothing dropped (``still_dropped == ()``).

Templates such as Qwen3's drop the reasoning of assistant turns before the
last user query. In the one render of a conversation such a turn would be
trained without its reasoning, which teaches a thinking model to answer
without thinking. At inference the model writing that turn sees exactly the
conversation up to it, with the turn last: so each extra example is such a
prefix, rendered once and verified like any row, training the turns whose
reasoning it renders. Those turns are then left untrained in the full
conversation, so each turn (content and reasoning) is trained exactly once.
Turns whose reasoning no prefix renders (a template that never writes it)
stay trained without it, and are counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from qlora_train.masking.messages import Message, RowRejected
from qlora_train.masking.policy import LossPolicy
from qlora_train.masking.render import RenderedConversation, render_conversation


@dataclass(frozen=True)
class Expansion:
    primary: RenderedConversation  # the full conversation, with the moved turns untrained
    messages: list[Message]  # the full conversation's messages as rendered in ``primary``
    extra: list[tuple[list[Message], RenderedConversation]]  # prefix examples, latest turn first
    moved: tuple[int, ...]  # turns trained (with their reasoning) in an extra example
    still_dropped: tuple[int, ...]  # trained turns whose reasoning is still not rendered


def _flagged(messages: list[Message], trained: set[int]) -> list[Message]:
    return [{**m, "train": i in trained} for i, m in enumerate(messages)]


def expand_dropped_reasoning(messages: list[Message], rendered: RenderedConversation, tokenizer, *,
                             policy: LossPolicy, tools=None) -> Expansion:
    """Marked messages + their render -> extra prefix examples for the turns whose reasoning the render dropped.

    At most ``policy.reasoning_history_max_examples`` extra examples; the latest dropped turn is served first.
    """
    pending = [t.index for t in rendered.turns if t.reasoning_dropped]
    extra, moved = [], set()
    while pending and len(extra) < policy.reasoning_history_max_examples:
        j = pending[-1]
        candidates = {i for i in pending if i <= j}
        prefix = _flagged(messages[: j + 1], candidates)
        try:
            r = render_conversation(prefix, tokenizer, tools=tools, policy=policy)
            kept = {t.index for t in r.turns if not t.reasoning_dropped}
            if j in kept and kept != candidates:  # some earlier candidates still drop it here: untrain them
                prefix = _flagged(messages[: j + 1], kept)
                r = render_conversation(prefix, tokenizer, tools=tools, policy=policy)
        except RowRejected:
            kept = set()
        if j not in kept:  # not even as the last turn: the template never writes this reasoning
            pending.remove(j)
            continue
        extra.append((prefix, r))
        moved |= kept
        pending = [i for i in pending if i not in kept]
    if not moved:
        return Expansion(rendered, messages, [], (), tuple(t.index for t in rendered.turns if t.reasoning_dropped))
    was_trained = {t.index for t in rendered.turns}
    if not was_trained - moved:  # nothing left to train in the full conversation: the latest prefix stands in
        (head, r), *rest = extra
        return Expansion(r, head, rest, tuple(sorted(moved)), ())
    full = _flagged(messages, was_trained - moved)
    primary = render_conversation(full, tokenizer, tools=tools, policy=policy)
    return Expansion(primary, full, extra, tuple(sorted(moved)),
                     tuple(t.index for t in primary.turns if t.reasoning_dropped))
