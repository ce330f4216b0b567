"""``--stats-only`` through the CLI, per row, against its floor; start-up of ``--stats-only`` and ``--help``.

    python benchmarks/bench_cli.py [--dists all] [--big 4000] [--small 500] [--repeats 3] [--baseline DIR]
                                   [--versus KEY=VALUE]

Per-row cost through the CLI = (time of a ``--big``-row run - time of a ``--small``-row run) / (big - small),
so the start-up (imports, tokenizer load, template probe) cancels. Each run is a fresh process with a fresh
datasets cache (``data.cache_dir`` in a new folder) on held-out generated rows of each row distribution of
``bench_rows.py`` (``--dists``: chat, reasoning, agent, unicode, sft, their mix, and bench, the rows of
bench_preprocess.py; all drawn with seed 1, the tables use seed 0), ``reasoning_history: drop`` so that each
row is rendered once, like the floor.

The floor is measured in this process on the same rows by the same two-size difference: one
``apply_chat_template`` render per row + one batched fast-tokenizer call with offsets per 256-row batch
(``floor (HF call)`` of bench_preprocess.py). Runs are interleaved (distributions, sizes, CLI and floor), best
of ``--repeats``, by wall time and by CPU time (the CLI process's user + system time; this process's for the
floor): on a machine other jobs share, CPU time is the steadier measure. ``--baseline DIR`` also runs the CLI
of another copy of the package (``DIR/qlora_train``), interleaved, so before/after ratios come from one run;
``--versus KEY=VALUE`` runs this one's CLI again with ``data.KEY: VALUE`` (``rule_check=off``: the check's cost).
Start-up: median of ``--repeats`` fresh runs of ``--help`` and of ``--stats-only`` on the 48 quickstart rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_rows  # noqa: E402
from bench_preprocess import batches, floor_hf  # noqa: E402

from qlora_train.config import DataConfig  # noqa: E402
from qlora_train.data.parse import canonicalize_row  # noqa: E402
from qlora_train.tiny import build_qwen_tokenizer, save_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "qlora_train.cli"]


class Took(NamedTuple):
    wall: float
    cpu: float  # user + system seconds of the process (all its threads)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cli_run(args: list[str], cwd: Path, code: Path = REPO) -> Took:
    # the package of this checkout (or of ``code``), whatever the installed one points to
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))}
    cpu, start = children_cpu(), time.perf_counter()
    out = subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, env=env)
    took = Took(time.perf_counter() - start, children_cpu() - cpu)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return took


def cli_seconds(args: list[str], cwd: Path) -> float:
    return cli_run(args, cwd).wall


def stats_run(work: Path, tok_dir: Path, data: Path, run: str, code: Path = REPO, options: dict | None = None) -> Took:
    """One --stats-only run of ``data`` in a fresh process with a fresh datasets cache; ``options``: more
    ``data:`` keys."""
    cache = work / f"cache-{run}"
    config = work / f"{run}.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(tok_dir), "chat_template": "qwen3"},
        "data": {"datasets": [{"path": str(data)}], "max_length": 4096, "reasoning_history": "drop",
                 "cache_dir": str(cache), **(options or {})},
        "train": {"output_dir": str(work / "out"), "report_to": "none"}}))
    try:
        return cli_run(["--config", str(config), "--stats-only", "--stats-dir", str(work / "stats")], work, code)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def floor_seconds(canon: list, tok) -> Took:
    cpu, start = time.process_time(), time.perf_counter()
    for batch in batches(canon, 256):
        floor_hf(batch, tok)
    return Took(time.perf_counter() - start, time.process_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dists", default="all", help="comma-separated names of bench_rows.NAMES, or all")
    ap.add_argument("--big", type=int, default=4000)
    ap.add_argument("--small", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="another checkout (a copy of its qlora_train/ is enough) whose "
                    "CLI runs interleaved with this one's, for before/after ratios measured side by side")
    ap.add_argument("--versus", metavar="KEY=VALUE", help="also run this checkout with data.KEY set to VALUE (YAML), "
                    "interleaved: e.g. rule_check=off for the cost of the rule check")
    args = ap.parse_args()
    names = list(bench_rows.NAMES) if args.dists == "all" else args.dists.split(",")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        tok = build_qwen_tokenizer("qwen3")
        tok_dir = work / "tokenizer"
        save_tokenizer(tok, tok_dir)
        from qlora_train.chat_templates import get_chat_template

        tok = get_chat_template(tok, "qwen3")
        sizes = {"small": args.small, "big": args.big}
        cfg = DataConfig(reasoning_history="drop")
        files: dict[tuple[str, str], Path] = {}
        canon: dict[tuple[str, str], list] = {}
        for name in names:
            rows = bench_rows.rows(name, args.big, seed=1)  # held out: the tables use seed 0
            for size, n in sizes.items():
                files[name, size] = work / f"{name}-{size}.jsonl"
                files[name, size].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[:n]))
                canon[name, size] = [canonicalize_row(r, cfg) for r in rows[:n]]
            floor_seconds(canon[name, "small"], tok)  # warm the template and the tokenizer
        codes = {"": (REPO, None), **({" (baseline)": (args.baseline.resolve(), None)} if args.baseline else {})}
        if args.versus:
            key, value = args.versus.split("=", 1)
            parsed = yaml.safe_load(value)  # YAML 1.1 reads off/on/yes/no as booleans: those stay strings
            parsed = value if isinstance(parsed, bool) and value.lower() not in ("true", "false") else parsed
            codes[f" ({key}={value})"] = (REPO, {key: parsed})
        stats_run(work, tok_dir, files[names[0], "small"], "warm-up")  # first-run caches (fonts, bytecode)
        cli: dict[tuple[str, str], list[Took]] = {(name + c, size): [] for name in names for c in codes
                                                  for size in sizes}
        floor: dict[tuple[str, str], list[Took]] = {k: [] for k in files}
        for r in range(args.repeats):
            for name in names:
                for size in sizes:
                    for c, (code, options) in codes.items():
                        cli[name + c, size].append(stats_run(work, tok_dir, files[name, size], f"{name}-{size}{r}",
                                                             code, options))
                    floor[name, size].append(floor_seconds(canon[name, size], tok))
        n = args.big - args.small
        help_s = statistics.median(cli_seconds(["--help"], REPO) for _ in range(args.repeats))
        quick = [cli_seconds(["--config", "configs/quickstart.yaml", "--stats-only", "--stats-dir",
                              str(work / "quick")], REPO) for _ in range(args.repeats)]
        print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, python {platform.python_version()}; "
              f"rows {args.small} and {args.big} per distribution (bench_rows.py, seed 1), best of {args.repeats}, "
              f"interleaved; TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}")
        print("\n5. --stats-only through the CLI vs the floor (render + batched tokenization), per row: wall time, "
              "and CPU time (user + system of the CLI's process; of this process for the floor), each the best of "
              "the runs; CPU time is the steadier measure when other jobs share the machine")
        print(f"{'distribution':<23} {'CLI small s':>11} {'CLI big s':>9} {'floor small':>11} {'floor big':>9} "
              f"{'CLI ms/row':>10} {'floor ms/row':>12} {'CLI / floor':>11} {'cpu CLI/floor':>13}")
        for name in [name + c for name in names for c in codes]:
            def per_row(runs, kind, name=name):
                return (min(getattr(t, kind) for t in runs[name, "big"])
                        - min(getattr(t, kind) for t in runs[name, "small"])) / n
            base = name.split(" (")[0]
            cli_row, floor_row = per_row(cli, "wall"), per_row(floor, "wall", base)
            print(f"{name:<23} {min(t.wall for t in cli[name, 'small']):>11.2f} "
                  f"{min(t.wall for t in cli[name, 'big']):>9.2f} {min(t.wall for t in floor[base, 'small']):>11.2f} "
                  f"{min(t.wall for t in floor[base, 'big']):>9.2f} {1e3 * cli_row:>10.3f} {1e3 * floor_row:>12.3f} "
                  f"{cli_row / floor_row:>11.3f} {per_row(cli, 'cpu') / per_row(floor, 'cpu', base):>13.3f}")
        print(f"start-up: --help {help_s:.2f} s; --stats-only on the quickstart (48 rows) "
              f"{statistics.median(quick):.2f} s (median of {args.repeats}: "
              + ", ".join(f"{q:.2f}" for q in quick) + ")")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
