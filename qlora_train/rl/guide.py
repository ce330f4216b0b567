"""``rl.guided_first_call``: the first completion of each agent rollout sampled restricted to the shape of a call to
the first tool, for a model that cannot write one yet (the random tiny model of ``make demo-agent``).

The restriction is on which tokens may be drawn, never on which one is: the call's fixed text (the template's opener,
the tool's name, the first argument's key, the closer and the end-of-turn marker) is the only token allowed where it
stands; inside the argument's value the model draws from its own distribution over the tokens of a small alphabet
(digits, operators, spaces, parentheses: ``VALUE_ALPHABET``) and the closer's first token, which it must draw within
``max_value_tokens``. What the model draws is its own sample of the restricted distribution; the loss takes the log-
probs of the unrestricted policy, as for any completion (the restriction makes those draws off-policy: a demo
device, documented in docs/rl.md#the-agent-demo, not a training method).

    >>> guide = CallGuide.for_tool(tok, fmt, tool, end="<|im_end|>")        # doctest: +SKIP
    >>> tok.decode(forced + drawn)                                            # doctest: +SKIP
    '<tool_call>\\n{"name": "calculate", "arguments": {"expression": "7 + 7"}}\\n</tool_call><|im_end|>'
"""

from __future__ import annotations

import torch

from qlora_train.rl.tool_calls import CallFormat
from qlora_train.rl.tools import Tool

VALUE_ALPHABET = tuple("0123456789+-*/() ")


class CallGuide:
    """A logits processor (transformers' interface) for one sequence whose completion starts at ``start``."""

    def __init__(self, opening: list[int], value: list[int], closing: list[int], *, start: int,
                 max_value_tokens: int = 12):
        self.opening, self.value, self.closing = opening, value, closing
        self.start, self.max_value_tokens = start, max_value_tokens

    @classmethod
    def for_tool(cls, tokenizer, fmt: CallFormat, tool: Tool, *, end: str, start: int = 0,
                 max_value_tokens: int = 12) -> CallGuide:
        """The guide for a call to ``tool`` (its first parameter a string) in a ``json`` call format."""
        params = list(tool.schema["function"]["parameters"].get("properties", {}))
        if fmt.kind != "json" or not params:
            raise ValueError("rl.guided_first_call: needs a json call format and a tool with a parameter")
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        opening = encode(f'{fmt.prefix}\n{{"{fmt.name_key}": "{tool.name}", "{fmt.arguments_key}": '
                         f'{{"{params[0]}": "')
        closing = encode(f'"}}}}\n{fmt.suffix}{end}')
        value = sorted({ids[0] for ids in map(encode, VALUE_ALPHABET) if len(ids) == 1} - {closing[0]})
        return cls(opening, value, closing, start=start, max_value_tokens=max_value_tokens)

    def at(self, start: int) -> CallGuide:
        """The same guide for a sequence whose completion starts at ``start``."""
        return CallGuide(self.opening, self.value, self.closing, start=start, max_value_tokens=self.max_value_tokens)

    def allowed(self, drawn: list[int]) -> list[int]:
        """The tokens that may come after ``drawn`` (this completion's tokens so far)."""
        if len(drawn) < len(self.opening):
            return [self.opening[len(drawn)]]
        rest = drawn[len(self.opening):]
        if self.closing[0] in rest:
            done = len(rest) - rest.index(self.closing[0])
            return [self.closing[done]] if done < len(self.closing) else [self.closing[-1]]
        return [self.closing[0]] if len(rest) >= self.max_value_tokens else [*self.value, self.closing[0]]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = torch.full_like(scores, float("-inf"))
        for row in range(input_ids.shape[0]):
            keep = torch.tensor(self.allowed(input_ids[row, self.start:].tolist()), device=scores.device)
            out[row, keep] = scores[row, keep]
        return out
