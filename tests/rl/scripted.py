"""A scripted policy for agent rollouts: it emits given token ids, whatever it is shown.

``script_turns(conversation, tokenizer)`` is the text the model generates for each assistant turn of a
conversation, by the rule (the mask engine's trained text of that turn, the turn last; through the end marker that
stops it); ``odd_ids(text, tokenizer, seed)`` tokenizes it as the tokenizer never would: the first piece of the
turn split off (a merge across the turn's start broken), and plain runs cut at seeded places, each part encoded on
its own; the template's added tokens stay whole (a sampled end marker is one token).
"""

from __future__ import annotations

import random

from qlora_train.masking import IGNORE_INDEX, LossPolicy, mask_conversation, template_layout
from qlora_train.masking.layout import pieces

TOOLS_CALLED = ("12 * (3 + 4)", "84 + 5")


def conversation(*, reasoning: bool = False) -> list[dict]:
    """user, a call, its result, a call, its result, the answer: the calculator's own results."""
    think = (lambda r: {"reasoning_content": r}) if reasoning else (lambda r: {})

    def call(turn, expression):
        return {"type": "function", "id": f"qlora{turn:02d}00",
                "function": {"name": "calculate", "arguments": {"expression": expression}}}

    return [
        {"role": "user", "content": "What is 12 * (3 + 4), plus 5?"},
        {"role": "assistant", "content": "", "tool_calls": [call(1, TOOLS_CALLED[0])], **think("First the product.")},
        {"role": "tool", "content": "84", "tool_call_id": "qlora0100", "name": "calculate"},
        {"role": "assistant", "content": "", "tool_calls": [call(2, TOOLS_CALLED[1])], **think("Then the sum.")},
        {"role": "tool", "content": "89", "tool_call_id": "qlora0200", "name": "calculate"},
        {"role": "assistant", "content": "It is 89.", **think("Done.")},
    ]


def _trained_text(messages, i, tokenizer, tools) -> str:
    marked = [{**m, "train": k == i} for k, m in enumerate(messages)]
    masked = mask_conversation(marked, tokenizer, tools=tools, policy=LossPolicy())
    text = tokenizer.decode([t for t in masked.labels if t != IGNORE_INDEX], skip_special_tokens=False,
                            clean_up_tokenization_spaces=False)
    layout = template_layout(tokenizer)
    # markers as plain text: the last trained token may run past the end marker (']\n'); the turn ends at it
    return text.rstrip() if any(text.rstrip().endswith(m) for m in layout.end_markers if m) else text


def script_turns(messages: list[dict], tokenizer, tools) -> list[str]:
    layout = template_layout(tokenizer)
    ends = lambda t: any(t.endswith(m) for m in layout.end_markers if m)  # noqa: E731
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        text = _trained_text(messages[:i + 1], i, tokenizer, tools)
        if not ends(text) and i + 1 < len(messages):
            text = _trained_text(messages[:i + 2], i, tokenizer, tools)
        if not ends(text):
            text += layout.end_of_turn
        out.append(text)
    return out


def odd_ids(text: str, tokenizer, seed: int) -> list[int]:
    rng = random.Random(seed)
    added = sorted((t for t in tokenizer.get_added_vocab() if t), key=len, reverse=True)
    vocab = tokenizer.get_added_vocab()
    ids: list[int] = []
    for k, piece in enumerate(pieces(text, added)):
        if piece in vocab:
            ids.append(vocab[piece])
            continue
        cuts = sorted({1} if k == 0 and len(piece) > 1 else set()) + sorted(
            rng.sample(range(1, len(piece)), min(2, len(piece) - 1)) if len(piece) > 2 else [])
        at = 0
        for cut in [*sorted(set(cuts)), len(piece)]:
            if cut > at:
                ids += tokenizer.encode(piece[at:cut], add_special_tokens=False)
                at = cut
    return ids


class ScriptedPolicy:
    """Emits the given completions in order, whatever it is shown; keeps what it was shown."""

    def __init__(self, completions: list[list[int]]):
        self.completions, self.shown = list(completions), []

    def __call__(self, ids: list[int]) -> list[int]:
        self.shown.append(list(ids))
        return self.completions[len(self.shown) - 1]
