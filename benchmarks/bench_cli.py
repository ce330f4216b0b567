"""``--stats-only`` through the CLI, per row, against its floor; start-up of ``--stats-only`` and ``--help``.

    python benchmarks/bench_cli.py [--big 8000] [--small 500] [--repeats 3]

Per-row cost through the CLI = (time of a ``--big``-row run - time of a ``--small``-row run) / (big - small),
so the start-up (imports, tokenizer load, template probe) cancels. Each run is a fresh process with a fresh
datasets cache (``data.cache_dir`` in a new folder) on held-out generated rows (multi-turn, reasoning, tool
calls and tool schemas; the rows of bench_preprocess.py drawn with another seed), ``reasoning_history: drop``
so that each row is rendered once, like the floor.

The floor is measured in this process on the same rows by the same two-size difference: one
``apply_chat_template`` render per row + one batched fast-tokenizer call with offsets per 256-row batch
(``floor (HF call)`` of bench_preprocess.py). Runs are interleaved, best of ``--repeats``.
Start-up: median of ``--repeats`` fresh runs of ``--help`` and of ``--stats-only`` on the 48 quickstart rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_preprocess import batches, floor_hf, make_rows  # noqa: E402

from qlora_train.config import DataConfig  # noqa: E402
from qlora_train.data.parse import canonicalize_row  # noqa: E402
from qlora_train.tiny import build_qwen_tokenizer, save_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "qlora_train.cli"]


def cli_seconds(args: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    out = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return took


def stats_run(work: Path, tok_dir: Path, data: Path, run: str) -> float:
    """One --stats-only run of ``data`` in a fresh process with a fresh datasets cache."""
    cache = work / f"cache-{run}"
    config = work / f"{run}.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(tok_dir), "chat_template": "qwen3"},
        "data": {"datasets": [{"path": str(data)}], "max_length": 4096, "reasoning_history": "drop",
                 "cache_dir": str(cache)},
        "train": {"output_dir": str(work / "out"), "report_to": "none"}}))
    try:
        return cli_seconds(["--config", str(config), "--stats-only", "--stats-dir", str(work / "stats")], work)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def floor_seconds(canon: list, tok) -> float:
    start = time.perf_counter()
    for batch in batches(canon, 256):
        floor_hf(batch, tok)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", type=int, default=8000)
    ap.add_argument("--small", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        tok = build_qwen_tokenizer("qwen3")
        tok_dir = work / "tokenizer"
        save_tokenizer(tok, tok_dir)
        rows = make_rows(args.big, seed=1)  # held out: table 1 uses seed 0
        sizes = {"small": args.small, "big": args.big}
        files = {}
        for name, n in sizes.items():
            files[name] = work / f"{name}.jsonl"
            files[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[:n]))
        cfg = DataConfig(reasoning_history="drop")
        canon = {name: [canonicalize_row(r, cfg) for r in rows[:n]] for name, n in sizes.items()}
        from qlora_train.chat_templates import get_chat_template

        tok = get_chat_template(tok, "qwen3")
        floor_seconds(canon["small"], tok)  # warm the template and the tokenizer
        cli: dict[str, list[float]] = {k: [] for k in sizes}
        floor: dict[str, list[float]] = {k: [] for k in sizes}
        for r in range(args.repeats):
            for name in sizes:
                cli[name].append(stats_run(work, tok_dir, files[name], f"{name}{r}"))
                floor[name].append(floor_seconds(canon[name], tok))
        n = args.big - args.small
        cli_row = (min(cli["big"]) - min(cli["small"])) / n
        floor_row = (min(floor["big"]) - min(floor["small"])) / n
        help_s = statistics.median(cli_seconds(["--help"], REPO) for _ in range(args.repeats))
        quick = [cli_seconds(["--config", "configs/quickstart.yaml", "--stats-only", "--stats-dir",
                              str(work / "quick")], REPO) for _ in range(args.repeats)]
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, python {platform.python_version()}; "
              f"rows {args.small} and {args.big} (multi-turn, reasoning, tools), best of {args.repeats}, interleaved")
        print("\n5. --stats-only through the CLI vs the floor (render + batched tokenization), per row")
        print(f"{'':24} {'small s':>8} {'big s':>8} {'ms/row':>8}")
        print(f"{'qlora-train --stats-only':24} {min(cli['small']):8.2f} {min(cli['big']):8.2f} {1e3 * cli_row:8.3f}")
        print(f"{'floor (HF call)':24} {min(floor['small']):8.2f} {min(floor['big']):8.2f} {1e3 * floor_row:8.3f}")
        print(f"ratio per row, CLI / floor: {cli_row / floor_row:.3f}")
        print(f"start-up: --help {help_s:.2f} s; --stats-only on the quickstart (48 rows) "
              f"{statistics.median(quick):.2f} s (median of {args.repeats}: "
              + ", ".join(f"{q:.2f}" for q in quick) + ")")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
