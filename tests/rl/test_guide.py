"""``rl.guided_first_call``: what the guide allows makes a call that parses, whichever allowed tokens are drawn."""

from __future__ import annotations

import random

import torch

from qlora_train.rl.guide import CallGuide
from qlora_train.rl.tool_calls import call_format, parse_calls
from qlora_train.rl.tools import load_tools


def test_any_draw_the_guide_allows_is_a_call_that_parses(qwen3_tok):
    [tool] = load_tools(["qlora_train.rl.calculator:calculate"])
    fmt = call_format(qwen3_tok)
    guide = CallGuide.for_tool(qwen3_tok, fmt, tool, end="<|im_end|>", max_value_tokens=6)
    rng = random.Random(0)
    for _ in range(20):
        drawn: list[int] = []
        while not drawn or drawn[-1] != qwen3_tok.convert_tokens_to_ids("<|im_end|>"):
            drawn.append(rng.choice(guide.allowed(drawn)))
            assert len(drawn) < 60
        parsed = parse_calls(qwen3_tok.decode(drawn), fmt)
        assert parsed.error is None and [c["name"] for c in parsed.calls] == ["calculate"]
        assert set(parsed.calls[0]["arguments"]["expression"]) <= set("0123456789+-*/() ")


def test_the_guide_keeps_the_models_scores_of_the_allowed_tokens(qwen3_tok):
    [tool] = load_tools(["qlora_train.rl.calculator:calculate"])
    guide = CallGuide.for_tool(qwen3_tok, call_format(qwen3_tok), tool, end="<|im_end|>").at(3)
    prefix = torch.tensor([[7, 8, 9, *guide.opening]])
    scores = torch.randn(1, len(qwen3_tok))
    out = guide(prefix, scores.clone())
    allowed = guide.allowed(guide.opening)
    assert torch.equal(out[0, allowed], scores[0, allowed])
    assert torch.isinf(out).sum() == len(qwen3_tok) - len(allowed)
