"""Seeded random conversations for mask checks: what the mask audit (benchmarks/mask_audit.py) and the layout-class
tests feed both the engine and the oracle.

    msgs, tools = conversation(random.Random(7), system=True, arguments_as_string=False)

A system prompt or not; 1-3 exchanges; reasoning on some answers; tool calls whose names are common words the user
writes in the same message ("Please add 12 and 30." -> ``add``), with their results and an answer, the call turn's
content empty on most; whitespace and unicode edges in every role. Messages are written as the parse stage writes
them (content always a string, tool call keys in its order), so that the engine renders the same text as
``apply_chat_template`` on these messages.

With ``markers`` (the template's own: its control tokens and end markers), a share ``hostile`` of the rows is
edited by ``hostile_edits``: markers inside role names, tool names, argument keys and values, user, system, tool
and assistant content and reasoning, message names and tool schemas; content that begins and ends with
whitespace; one-word answers. Rows without ``markers`` are drawn exactly as before (the edits draw after them).
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


def conversation(rng: random.Random, *, system: bool, arguments_as_string: bool, markers: tuple[str, ...] = (),
                 hostile: float = 0.3, turn: tuple[str, str] = ("", ""),
                 flags: tuple[str, ...] = ()) -> tuple[list[dict], list | None]:
    """One random conversation and its tools (None without tool calls); with ``markers``, a share ``hostile`` of
    the rows edited by ``hostile_edits``; with ``flags`` (texts that switch the template's generation prompt), half
    the rows hold one in their system message (added where the row has none)."""
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
    if flags and rng.random() < 0.5:  # (drawn only for a template with flags: other rows draw as before)
        flag = rng.choice(flags)
        if msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']} {flag}"}
        else:
            msgs.insert(0, {"role": "system", "content": flag})
    if markers and rng.random() < hostile:
        msgs, tools = hostile_edits(rng, msgs, tools, markers, arguments_as_string=arguments_as_string, turn=turn)
    return msgs, tools


# what a hostile edit does; the first four put markers in row text outside content (the engine refuses those rows:
# marker_in_row_text); the others are content the engine must mask right (trained as written on the assistant's
# side, never trained on the user's)
HOSTILE_EDITS = ("role", "tool_name", "argument_key", "tools_schema", "argument_value", "user_content",
                 "system_content", "tool_content", "assistant_content", "reasoning", "message_name", "padded",
                 "one_word")
ROW_TEXT_EDITS = frozenset({"role", "tool_name", "argument_key", "tools_schema", "message_name"})
ONE_WORD = ["Yes.", "Paris", "ok", "No", "42", "<", "Sure!"]


def hostile_edits(rng: random.Random, msgs: list[dict], tools: list | None, markers: tuple[str, ...], *,
                  arguments_as_string: bool = False, kinds: tuple[str, ...] | None = None,
                  turn: tuple[str, str] = ("", "")) -> tuple[list[dict], list | None]:
    """A copy of the conversation with one or two edits of ``HOSTILE_EDITS`` (or ``kinds``), markers drawn from
    ``markers``; an edit the row has no place for (a tool name in a row without calls) is skipped. ``turn``: the
    template's assistant header (its generation prompt) and end marker, where known: the injected role writes a
    whole turn with them."""
    msgs, tools = json.loads(json.dumps(msgs)), json.loads(json.dumps(tools)) if tools else tools
    marker = lambda: rng.choice(markers)  # noqa: E731
    calls = [c for m in msgs for c in m.get("tool_calls") or []]
    by_role = lambda role: [m for m in msgs if m["role"] == role]  # noqa: E731
    for kind in kinds or rng.sample(HOSTILE_EDITS, rng.choice((1, 1, 2))):
        if kind == "role":  # issue 34's row: before the last answer, a message whose role writes a whole turn
            at = max(k for k, m in enumerate(msgs) if m["role"] == "user") + 1  # holding that answer's text
            answer = msgs[at]
            fn = (answer.get("tool_calls") or [{}])[0].get("function")
            args = (json.loads(fn["arguments"]) if arguments_as_string else fn["arguments"]) if fn else {}
            # a call's name and values (what the call check looked for), or the answer itself
            text = " ".join(["INJECTED", fn["name"], *map(str, args.values())]) if fn else answer["content"].strip()
            header, end = turn[0] or f"{marker()}assistant\n", turn[1] or marker()
            role = f"x{end}\n{header}{text}{end}\n{marker()}user"
            msgs.insert(at, {"role": role, "content": "context"})
        elif kind == "tool_name" and calls:
            fn = rng.choice(calls)["function"]
            fn["name"] += marker()
        elif kind == "argument_key" and calls:
            fn = rng.choice(calls)["function"]
            args = json.loads(fn["arguments"]) if arguments_as_string else fn["arguments"]
            args = {(k + marker() if j == 0 else k): v for j, (k, v) in enumerate(args.items())}
            fn["arguments"] = json.dumps(args) if arguments_as_string else args
        elif kind == "tools_schema" and tools:
            tools[0]["function"]["description"] += f" {marker()}assistant\n"
        elif kind == "message_name":
            rng.choice(by_role("user"))["name"] = f"bob{marker()}"
        elif kind == "argument_value" and calls:
            fn = rng.choice(calls)["function"]
            args = json.loads(fn["arguments"]) if arguments_as_string else fn["arguments"]
            key = next(iter(args))
            args[key] = f"{args[key]} {marker()}"
            fn["arguments"] = json.dumps(args) if arguments_as_string else args
        elif kind in ("user_content", "system_content", "tool_content", "assistant_content"):
            targets = by_role(kind.split("_")[0])
            # (reasoning tags in an answer are an inline reasoning block to the parse stage: extract_think_tags)
            usable = [m for m in markers if kind != "assistant_content" or m not in ("<think>", "</think>")]
            if targets and usable:
                m = rng.choice(targets)
                cut = rng.randint(0, len(m["content"]))
                inserted = rng.choice(usable) + rng.choice(["", "\n", " "])
                m["content"] = m["content"][:cut] + inserted + m["content"][cut:]
        elif kind == "reasoning":
            m = rng.choice(by_role("assistant"))
            m["reasoning_content"] = f"{m.get('reasoning_content') or 'think.'} {marker()} more"
        elif kind == "padded":
            for m in rng.sample(msgs, min(2, len(msgs))):
                if m["content"]:
                    before, after = rng.choice(["\n\n", "  ", "\n ", "\t"]), rng.choice([" \n", "\n\n", " "])
                    m["content"] = before + m["content"] + after
        elif kind == "one_word":
            answers = [m for m in by_role("assistant") if not m.get("tool_calls")]
            if answers:
                rng.choice(answers)["content"] = rng.choice(ONE_WORD)
    return msgs, tools


