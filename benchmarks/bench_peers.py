"""Preprocessing CPU time, ours against LLaMA-Factory's and axolotl's, on the same rows (``make bench-peers``).

    python benchmarks/bench_peers.py [--sizes 1000,5000] [--repeats 3] [--tools ours,llamafactory,axolotl]
                                     [--baseline DIR]    # also DIR's qlora_train, interleaved ("ours (baseline)")

The rows are bench_preprocess.py's (``make_rows``: multi-turn, reasoning, tool calls, unicode, code), the first
``--sizes`` of 5,000, each tool given them in its own format: ours and axolotl's as they are (OpenAI messages, a
``tools`` column), LLaMA-Factory's in its sharegpt form (a tool call as a ``function_call`` message of its name
and arguments, a tool's result as ``observation``, the tools as a JSON string). The template is Qwen3's (ours:
``chat_template: qwen3``; LLaMA-Factory's ``qwen3``; axolotl the tokenizer's own, ours), the vocabulary the real
Qwen one (``.cache/tiny-qwen3``: ``python -m qlora_train.tiny``), the length limit 4096 tokens, one process each,
no worker processes, a fresh datasets cache each run:

  ours          ``qlora-train --config ... --preprocess`` (``reasoning_history: drop``: one example per row, as
                the peers make)
  llamafactory  ``get_dataset`` (benchmarks/peers/llamafactory_preprocess.py: its tokenizer load, template,
                dataset load, conversion and ``SupervisedDatasetProcessor``, what ``llamafactory-cli train`` runs
                before it loads the weights)
  axolotl       ``python -m axolotl.cli.preprocess`` (``type: chat_template``)

Each run is a fresh process; its CPU time is its user + system seconds. Runs are interleaved (tools, sizes), best
of ``--repeats``. Per extra row = (CPU of the largest size - CPU of the smallest) / (their difference in rows): the
start-up (imports, tokenizer load) cancels. The peers live in their own virtual environments under
``.cache/peers`` (scripts/install_peers.sh; ``make bench-peers`` installs them first); a tool whose environment is
missing is left out and said so. Not in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_preprocess import make_rows  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PEERS = REPO / ".cache" / "peers"
TINY = REPO / ".cache" / "tiny-qwen3"
TOOLS = ("ours", "llamafactory", "axolotl")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(cmd: list[str], env: dict, cwd: Path) -> float:
    """CPU seconds of one fresh process (it must succeed)."""
    cpu = children_cpu()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return children_cpu() - cpu


def sharegpt(row: dict) -> dict:
    """A row in LLaMA-Factory's sharegpt form (role/content tags set in its dataset_info.json)."""
    messages = []
    for m in row["messages"]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            for call in m["tool_calls"]:
                named = {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                messages.append({"role": "function_call", "content": json.dumps(named, ensure_ascii=False)})
        elif m["role"] == "tool":
            messages.append({"role": "observation", "content": m["content"]})
        else:
            messages.append({"role": m["role"], "content": m["content"]})
    out = {"messages": messages}
    if row.get("tools"):
        out["tools"] = json.dumps(row["tools"], ensure_ascii=False)
    return out


LF_INFO = {"bench": {"file_name": "rows.jsonl", "formatting": "sharegpt", "columns": {
    "messages": "messages", "tools": "tools"}, "tags": {
    "role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
    "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}}}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


class Setup:
    """Each tool's files for each size, and the command that preprocesses them."""

    def __init__(self, work: Path, rows: list[dict], sizes: list[int], baseline: Path | None = None):
        self.work = work
        self.baseline = baseline
        for n in sizes:
            write_jsonl(work / f"ours-{n}.jsonl", rows[:n])
            write_jsonl(work / f"lf-{n}" / "rows.jsonl", [sharegpt(r) for r in rows[:n]])
            (work / f"lf-{n}" / "dataset_info.json").write_text(json.dumps(LF_INFO))

    def command(self, tool: str, n: int, k: int) -> tuple[list[str], dict]:
        run_dir = self.work / f"{tool.replace(' ', '_')}-{n}-run{k}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir()
        env = {**os.environ, "HF_DATASETS_CACHE": str(run_dir / "hf-cache"), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "DISABLE_VERSION_CHECK": "1",
               "OMP_NUM_THREADS": "1"}
        if tool in ("ours", "ours (baseline)"):
            config = run_dir / "config.yaml"
            config.write_text(json.dumps({
                "model": {"name_or_path": str(TINY), "chat_template": "qwen3"},
                "data": {"datasets": [{"path": str(self.work / f"ours-{n}.jsonl")}], "max_length": 4096,
                         "reasoning_history": "drop", "cache_dir": str(run_dir / "cache")},
                "train": {"output_dir": str(run_dir / "out"), "report_to": "none"}}))
            code = self.baseline if tool == "ours (baseline)" else REPO
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), os.environ.get("PYTHONPATH")]))
            return [sys.executable, "-m", "qlora_train.cli", "--config", str(config), "--preprocess",
                    "--preprocess-dir", str(run_dir / "prepared")], env
        env.pop("PYTHONPATH", None)
        if tool == "llamafactory":
            return [str(PEERS / "llamafactory/bin/python"), str(REPO / "benchmarks/peers/llamafactory_preprocess.py"),
                    str(TINY), str(self.work / f"lf-{n}"), str(run_dir / "out")], env
        config = run_dir / "axolotl.yaml"
        config.write_text(json.dumps({
            "base_model": str(TINY), "chat_template": "tokenizer_default", "sequence_len": 4096,
            "datasets": [{"path": str(self.work / f"ours-{n}.jsonl"), "ds_type": "json", "type": "chat_template",
                          "field_messages": "messages", "field_tools": "tools", "split": "train"}],
            "dataset_prepared_path": str(run_dir / "prepared"), "output_dir": str(run_dir / "out"),
            "dataset_processes": 1, "micro_batch_size": 1, "num_epochs": 1, "learning_rate": 1e-4,
            "val_set_size": 0}))
        return [str(PEERS / "axolotl/bin/python"), "-m", "axolotl.cli.preprocess", str(config)], env


def available(tool: str) -> bool:
    return tool.startswith("ours") or (PEERS / tool / ".installed").exists()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,5000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--baseline", type=Path, help="another checkout (a copy of its qlora_train/ is enough) whose "
                    "--preprocess runs interleaved with this one's: before/after from one run")
    args = ap.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    tools = [t for t in args.tools.split(",") if available(t) or print(f"{t}: not installed (make bench-peers "
                                                                         "installs it into .cache/peers): left out")]
    if args.baseline:
        tools.insert(1, "ours (baseline)")
    if not (TINY / "config.json").exists():
        raise SystemExit(f"{TINY} is missing: python -m qlora_train.tiny --out {TINY}")
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    try:
        setup = Setup(work, make_rows(sizes[-1]), sizes, args.baseline and args.baseline.resolve())
        best = {(t, n): float("inf") for t in tools for n in sizes}
        keys = list(best)
        for k in range(args.repeats):
            for j in range(len(keys)):  # interleaved; who goes first rotates
                t, n = keys[(j + k) % len(keys)]
                cmd, env = setup.command(t, n, k)
                best[t, n] = min(best[t, n], run(cmd, env, work))
                shutil.rmtree(work / f"{t.replace(' ', '_')}-{n}-run{k}", ignore_errors=True)
                print(f"  {t:<16} {n:>6} rows: {best[t, n]:.2f} s CPU (best so far)", flush=True)
        small, big = sizes[0], sizes[-1]
        print(f"\npreprocessing CPU seconds (user + system, one process, best of {args.repeats}; Qwen3 template, "
              "real Qwen vocabulary, bench_preprocess.py rows)")
        print(f"{'':<16}" + "".join(f"{f'{n} rows':>12}" for n in sizes) + f"{'per extra row':>16}"
              + f"{f'vs ours ({big})':>16}{'vs ours /row':>14}")
        per_row = {t: (best[t, big] - best[t, small]) / (big - small) for t in tools}
        for t in tools:
            line = f"{t:<16}" + "".join(f"{best[t, n]:>12.2f}" for n in sizes) + f"{1000 * per_row[t]:>13.3f} ms"
            if "ours" in tools:
                line += f"{best[t, big] / best['ours', big]:>15.2f}x{per_row[t] / per_row['ours']:>13.2f}x"
            print(line)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
