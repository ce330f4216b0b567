"""Seeded random conversations for mask checks: what the mask audit (benchmarks/mask_audit.py) and the layout-class
tests feed both the engine and the oracle.

    msgs, tools = conversation(random.Random(7), system=True, arguments_as_string=False)

A system prompt or not; 1-3 exchanges; reasoning on some answers; tool calls whose names are common words the user
writes in the same message ("Please add 12 and 30." -> ``add``), with their results and an answer, the call turn's
content empty on most; whitespace and unicode edges in every role. Messages are written as the parse stage writes
them (content always a string, tool call keys in its order), so that the engine renders the same text as
``apply_chat_template`` on these messages.
"""

from __future__ import annotations

import json
import random

# tools named with common words, each asked for by a user message that writes the word itself
TOOL_ASKS = {
    "add": (lambda r: {"a": r.randint(2, 999), "b": r.randint(2, 999)},
            lambda a: f"Please add {a['a']} and {a['b']}.", lambda a: str(a["a"] + a["b"]),
            lambda a: f"{a['a']} plus {a['b']} is {a['a'] + a['b']}."),
    "search": (lambda r: {"query": r.choice(["cheap flights", "ramen near me", "jazz concerts"])},
               lambda a: f"Can you search for {a['query']}?", lambda a: '["result one", "result two"]',
               lambda a: f"i found two results for {a['query']}."),
    "get": (lambda r: {"key": r.choice(["weather", "news", "score"])},
            lambda a: f"Get me the {a['key']}, please.", lambda a: "Sunny, 3°C",
            lambda a: f"here is the {a['key']}: sunny."),
    "time": (lambda r: {"city": r.choice(["Tokyo", "Oslo", "Lima"])},
             lambda a: f"What time is it in {a['city']}? Tell me the time.", lambda a: "14:05",
             lambda a: "it is 14:05 there."),
}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} tool",
    "parameters": {"type": "object", "properties": {k: {"type": "string"} for k in ask[0](random.Random(0))}}}}
    for name, ask in TOOL_ASKS.items()]
SYSTEMS = ["Answer briefly.", "You are a helpful assistant.\nBe precise.", "  System with spaces  ",
           "Réponds en français."]
USERS = ["What is the capital of France?", "Tell me a joke.", "  leading and trailing spaces  ",
         "Multi\nline\n\nquestion?", "Unicode: é 中 🙂", "Tabs\tand  double  spaces", "Why?\n"]
ANSWERS = ["paris.", "sure, here it is: a short answer.", "  spaced answer  ", "line one\nline two",
           "é 中 🙂 ok", "answer with trailing newline\n", "1. first\n2. second"]
REASONINGS = ["let me think about it.", "  padded reasoning \n", "step one, then step two.\nso: done"]


def conversation(rng: random.Random, *, system: bool, arguments_as_string: bool) -> tuple[list[dict], list | None]:
    """One random conversation and its tools (None without tool calls)."""
    msgs, tools = [], None
    if system and rng.random() < 0.5:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for k in range(rng.randint(1, 3)):
        if rng.random() < 0.35:
            name = rng.choice(list(TOOL_ASKS))
            make_args, ask, result, answer = TOOL_ASKS[name]
            args = make_args(rng)
            call_id = f"call{k:05d}"
            call = {"type": "function", "function": {  # keys in the order the parse stage writes them
                "name": name, "arguments": json.dumps(args) if arguments_as_string else args}, "id": call_id}
            call_turn = {"role": "assistant", "content": "" if rng.random() < 0.7 else "let me check.",
                         "tool_calls": [call]}
            if rng.random() < 0.3:
                call_turn["reasoning_content"] = f"the user wants {name}."
            msgs += [{"role": "user", "content": ask(args)}, call_turn,
                     {"role": "tool", "content": result(args), "tool_call_id": call_id, "name": name},
                     {"role": "assistant", "content": answer(args)}]
            tools = TOOLS
        else:
            msgs += [{"role": "user", "content": rng.choice(USERS)},
                     {"role": "assistant", "content": rng.choice(ANSWERS)}]
        if rng.random() < 0.4:
            msgs[-1]["reasoning_content"] = rng.choice(REASONINGS)
    return msgs, tools


