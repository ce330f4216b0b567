"""Write configs/data/quickstart.jsonl: a small, deterministic chat dataset we wrote ourselves.

Mixes single and multi-turn conversations, system prompts, reasoning (as a
field and as inline <think> tags), and tool calls with tool results.
"""

import json
import random
from pathlib import Path

rng = random.Random(0)
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Canada": "Ottawa",
            "Norway": "Oslo", "Egypt": "Cairo", "Chile": "Santiago", "India": "New Delhi", "Spain": "Madrid"}
SYSTEMS = ["You are a concise assistant.", "Answer in one short sentence.", "You are a helpful math tutor."]
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def arithmetic():
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"What is {a} + {b}?", f"{a} plus {b}: units first, then tens.", f"{a} + {b} = {a + b}."


rows = []
for i in range(48):
    kind = i % 4
    if kind == 0:  # single turn with reasoning field
        q, r, a = arithmetic()
        rows.append({"messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                                  {"role": "user", "content": q},
                                  {"role": "assistant", "content": a, "reasoning_content": r}]})
    elif kind == 1:  # multi-turn, inline think tags in the last answer
        country, other = rng.sample(sorted(CAPITALS), 2)
        rows.append({"messages": [
            {"role": "system", "content": "You know world geography."},
            {"role": "user", "content": f"What is the capital of {country}?"},
            {"role": "assistant", "content": f"The capital of {country} is {CAPITALS[country]}."},
            {"role": "user", "content": f"And of {other}?"},
            {"role": "assistant", "content": f"<think>\nRecall the capital of {other}.\n</think>\n\n"
                                             f"The capital of {other} is {CAPITALS[other]}."}]})
    elif kind == 2:  # tool call and tool result
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"tools": [ADD_TOOL], "messages": [
            {"role": "system", "content": "Use tools for arithmetic."},
            {"role": "user", "content": f"Please add {a} and {b}."},
            {"role": "assistant", "content": "", "reasoning_content": "Large numbers: call the add tool.",
             "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]})
    else:  # prompt/response rows, no system prompt
        q, r, a = arithmetic()
        rows.append({"prompt": q, "response": a})

out = Path(__file__).resolve().parents[1] / "configs" / "data" / "quickstart.jsonl"
out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
print(f"wrote {len(rows)} rows to {out}")
