"""Preprocessing throughput: the whole row pipeline next to its floor, measured side by side.

    python benchmarks/bench_preprocess.py [--rows 2000] [--batch-size 256] [--repeats 3]

floor    = one ``apply_chat_template`` render per row + one batched fast-tokenizer
           call with offsets per batch (the least any exact-mask pipeline must do)
pipeline = ``process_rows``: canonicalize, render, char mask + verification,
           batched tokenize, projection to labels, truncation when needed
Rows are generated deterministically (multi-turn, reasoning, tool calls,
unicode, code); nothing is downloaded. Best of ``--repeats`` interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_train.config import DataConfig  # noqa: E402
from qlora_train.data import canonicalize_row, process_rows  # noqa: E402
from qlora_train.data.render import render_text  # noqa: E402
from qlora_train.data.tokenize import encode_batch  # noqa: E402
from qlora_train.tiny import build_qwen_tokenizer  # noqa: E402

WORDS = ("the model reads each token and predicts the next one while the loss mask decides which "
         "positions count naïve café 東京 données 🙂 größe").split()
CODE = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n"
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def make_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": sentence(rng, rng.randint(5, 30))}]
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": sentence(rng, rng.randint(5, 60))})
            if rng.random() < 0.25:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "search", "arguments": {"query": sentence(rng, 4)}}}]})
                msgs.append({"role": "tool", "content": json.dumps({"results": [sentence(rng, 12)]})})
            answer = sentence(rng, rng.randint(10, 120))
            if rng.random() < 0.3:
                answer += "\n\n```python\n" + CODE + "```"
            if rng.random() < 0.5:
                answer = f"<think>\n{sentence(rng, rng.randint(10, 80))}\n</think>\n\n{answer}"
            msgs.append({"role": "assistant", "content": answer})
        row = {"messages": msgs}
        if i % 4 == 0:
            row["tools"] = TOOLS
        rows.append(row)
    return rows


def run_floor(canon, tok, batch_size: int) -> float:
    t = time.perf_counter()
    for s in range(0, len(canon), batch_size):
        texts = [render_text(c.messages, tok, tools=c.tools) for c in canon[s:s + batch_size]]
        encode_batch(texts, tok)
    return time.perf_counter() - t


def run_pipeline(rows, tok, cfg: DataConfig) -> float:
    t = time.perf_counter()
    for s in range(0, len(rows), cfg.batch_size):
        out = process_rows(rows[s:s + cfg.batch_size], tok, cfg)
        assert not any(out["drop_reason"]), set(out["drop_reason"])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    tok = build_qwen_tokenizer("qwen3")
    cfg = DataConfig(max_length=args.max_length, batch_size=args.batch_size)
    rows = make_rows(args.rows)
    canon = [canonicalize_row(r, cfg) for r in rows]
    process_rows(rows[:8], tok, cfg)  # warm caches (template compile, layout probe)
    floor, pipe = [], []
    for _ in range(args.repeats):
        floor.append(run_floor(canon, tok, args.batch_size))
        pipe.append(run_pipeline(rows, tok, cfg))
    f, p = min(floor), min(pipe)
    n_tokens = sum(len(ids) for ids, _ in encode_batch([render_text(c.messages, tok, tools=c.tools)
                                                        for c in canon[:200]], tok)) / min(200, len(canon))
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"rows {args.rows}, mean tokens/row {n_tokens:.0f}, batch {args.batch_size}, best of {args.repeats}")
    print(f"{'':<10} {'rows/s':>10} {'seconds':>9}")
    print(f"{'floor':<10} {args.rows / f:>10.0f} {f:>9.3f}")
    print(f"{'pipeline':<10} {args.rows / p:>10.0f} {p:>9.3f}")
    print(f"ratio pipeline/floor (time): {p / f:.3f}")


if __name__ == "__main__":
    main()
