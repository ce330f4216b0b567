"""Row distributions for the preprocessing benchmarks: rows nobody tuned the pipeline to.

    >>> NAMES
    ('chat', 'reasoning', 'agent', 'unicode', 'sft', 'mix', 'bench')
    >>> rows("mix", 3, seed=0) == rows("mix", 3, seed=0) != rows("mix", 3, seed=1)
    True

Each distribution is a generator ``(rng) -> one raw row``, deterministic for a seed; ``rows(name, n, seed)``
draws ``n`` of them, ``mix`` each row from a distribution picked at random (equal weights), ``bench`` the
rows table 1 was tuned on. Between them they hold
every property of a row that the pipeline handles on a path of its own:

  chat       plain short chat: 1-2 exchanges, a system prompt in half the rows, no reasoning, no tools
  reasoning  long multi-turn (3-6 exchanges), reasoning in every assistant turn under a key drawn per turn
             (``reasoning_content``, ``reasoning``, ``thinking``, inline ``<think>``): Qwen3 drops all but the last
             turn's, so its tokens are counted (``reasoning_history: drop``) or expanded (the default)
  agent      tool-heavy agent traces: the tools list as a JSON string (parsed per row), 2-4 schemas, 1-4 calls
             per turn (parallel calls, arguments as objects or JSON strings), JSON tool results, reasoning beside
             the calls in a third of the turns
  unicode    CJK, Arabic, emoji text; content with leading/trailing spaces and newlines (which Qwen3 strips:
             the mask is then located around what the template changed), code blocks, content given as a list
             of text parts
  sft        the seed formats: ShareGPT (``conversations`` of from/value), ``prompt``/``response``, Alpaca
             (``instruction``/``input``/``output``), inline ``<think>`` in a quarter of the answers
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

LATIN = ("the model reads each token and predicts the next one while the loss mask decides which positions "
         "count on every row of the data set before training starts").split()
CJK = list("模型读取每个词元并预测下一个损失掩码决定哪些位置计入训练数据在开始之前东京大学的研究人员")
ARABIC = "النموذج يقرأ كل رمز ويتنبأ بالرمز التالي بينما يحدد القناع أي المواضع تحتسب".split()
EMOJI = list("🙂🚀🔥✨🎉👍🤖📊🧠💡")
CODE = ("```python\ndef add(a, b):\n    return a + b\n\n\nprint(add(2, 3))  # 5\n```",
        "```js\nconst xs = [1, 2, 3].map((x) => x * 2);\nconsole.log(xs);\n```",
        "```bash\nfor f in *.jsonl; do\n  wc -l \"$f\"\ndone\n```")
TOOLS = [
    {"type": "function", "function": {"name": "search", "description": "Search the web for a query.",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "description": "What to look for."},
                                          "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
                                          "required": ["query"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "start": {"type": "integer"},
                                          "end": {"type": "integer"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_python", "description": "Run Python code in a sandbox.",
                                      "parameters": {"type": "object", "properties": {
                                          "code": {"type": "string"}, "timeout_s": {"type": "number"}},
                                          "required": ["code"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"},
                                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"]}}},
]
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking", "inline")


def sentence(rng: random.Random, n: int, words=LATIN) -> str:
    return " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."


def paragraph(rng: random.Random, lo: int, hi: int) -> str:
    """Sentences of ``lo``-``hi`` words in all, sometimes a code block among them."""
    text = " ".join(sentence(rng, rng.randint(4, 16)) for _ in range(max(1, rng.randint(lo, hi) // 10)))
    if rng.random() < 0.2:
        text += "\n\n" + rng.choice(CODE)
    return text


def with_reasoning(rng: random.Random, msg: dict, reasoning: str) -> dict:
    key = rng.choice(REASONING_KEYS)
    if key == "inline":
        return {**msg, "content": f"<think>\n{reasoning}\n</think>\n\n{msg['content']}"}
    return {**msg, key: reasoning}


def chat(rng: random.Random) -> dict:
    msgs = [{"role": "system", "content": sentence(rng, rng.randint(4, 12))}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 2)):
        msgs.append({"role": "user", "content": sentence(rng, rng.randint(3, 20))})
        msgs.append({"role": "assistant", "content": paragraph(rng, 8, 60)})
    return {"messages": msgs}


def reasoning(rng: random.Random) -> dict:
    msgs = [{"role": "system", "content": sentence(rng, rng.randint(5, 25))}] if rng.random() < 0.6 else []
    for _ in range(rng.randint(3, 6)):
        msgs.append({"role": "user", "content": paragraph(rng, 10, 50)})
        answer = {"role": "assistant", "content": paragraph(rng, 20, 120)}
        msgs.append(with_reasoning(rng, answer, paragraph(rng, 30, 150)))
    return {"messages": msgs}


def _call(rng: random.Random, tool: dict) -> dict:
    fn = tool["function"]
    args = {k: (sentence(rng, 3) if v.get("type") == "string" and "enum" not in v else
                v["enum"][0] if "enum" in v else rng.randint(1, 9))
            for k, v in fn["parameters"]["properties"].items() if k in fn["parameters"]["required"] or
            rng.random() < 0.5}
    return {"type": "function", "function": {"name": fn["name"],
                                             "arguments": json.dumps(args) if rng.random() < 0.5 else args}}


def agent(rng: random.Random) -> dict:
    tools = rng.sample(TOOLS, rng.randint(2, 4))
    msgs = [{"role": "system", "content": sentence(rng, rng.randint(8, 30))}]
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": sentence(rng, rng.randint(5, 40))})
        for _ in range(rng.randint(1, 3)):
            calls = [_call(rng, rng.choice(tools)) for _ in range(rng.randint(1, 2 if rng.random() < 0.7 else 4))]
            turn = {"role": "assistant", "content": "" if rng.random() < 0.7 else sentence(rng, 8),
                    "tool_calls": calls}
            msgs.append(with_reasoning(rng, turn, paragraph(rng, 10, 60)) if rng.random() < 0.33 else turn)
            for _ in calls:
                msgs.append({"role": "tool", "content": json.dumps(
                    {"ok": True, "results": [sentence(rng, rng.randint(4, 20)) for _ in range(rng.randint(1, 3))]})})
        msgs.append({"role": "assistant", "content": paragraph(rng, 10, 80)})
    return {"messages": msgs, "tools": json.dumps(tools)}


def _edge(rng: random.Random, text: str) -> str:
    """Leading/trailing whitespace on a third of the contents."""
    if rng.random() < 0.33:
        text = rng.choice((" ", "\n", "  \n", "\t")) + text + rng.choice((" ", "\n\n", " \n", ""))
    return text


def unicode(rng: random.Random) -> dict:
    def text(lo: int, hi: int) -> str:
        words = rng.choice((CJK, ARABIC, LATIN + EMOJI, CJK + EMOJI))
        glue = "" if words is CJK else " "
        out = glue.join(rng.choice(words) for _ in range(rng.randint(lo, hi))) + ("。" if words is CJK else ".")
        if rng.random() < 0.25:
            out += "\n\n" + rng.choice(CODE)
        return _edge(rng, out)

    msgs = [{"role": "system", "content": text(4, 20)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        user = text(4, 40)
        msgs.append({"role": "user", "content": [{"type": "text", "text": user}] if rng.random() < 0.2 else user})
        answer = {"role": "assistant", "content": text(10, 120)}
        msgs.append(with_reasoning(rng, answer, text(10, 60).strip()) if rng.random() < 0.3 else answer)
    return {"messages": msgs}


def sft(rng: random.Random) -> dict:
    answer = paragraph(rng, 10, 120)
    if rng.random() < 0.25:
        answer = f"<think>\n{paragraph(rng, 10, 60)}\n</think>\n\n{answer}"
    kind = rng.randrange(3)
    if kind == 0:
        turns = [{"from": "system", "value": sentence(rng, 10)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": sentence(rng, rng.randint(4, 30))},
                      {"from": "gpt", "value": paragraph(rng, 10, 80)}]
        turns[-1]["value"] = answer
        return {"conversations": turns}
    if kind == 1:
        return {"prompt": sentence(rng, rng.randint(4, 40)), "response": answer}
    return {"instruction": sentence(rng, rng.randint(4, 20)),
            "input": paragraph(rng, 5, 40) if rng.random() < 0.5 else "", "output": answer}


DISTRIBUTIONS: dict[str, Callable[[random.Random], dict]] = {
    "chat": chat, "reasoning": reasoning, "agent": agent, "unicode": unicode, "sft": sft}
NAMES = (*DISTRIBUTIONS, "mix", "bench")  # mix: each row from one of DISTRIBUTIONS, equal weights


def iter_rows(name: str, n: int, seed: int = 0) -> Iterator[dict]:
    """``n`` rows of distribution ``name`` (or ``mix``), one at a time: deterministic for a seed."""
    if name == "bench":
        from bench_preprocess import iter_rows as bench_rows

        yield from bench_rows(n, seed)
        return
    rng = random.Random(f"{name}-{seed}")
    names = list(DISTRIBUTIONS)
    for _ in range(n):
        yield DISTRIBUTIONS[rng.choice(names) if name == "mix" else name](rng)


def rows(name: str, n: int, seed: int = 0) -> list[dict]:
    return list(iter_rows(name, n, seed))
