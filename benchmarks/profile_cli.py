"""Where ``--stats-only`` spends its time per row, by stage, under cProfile, for each row distribution.

    python benchmarks/profile_cli.py [--dists all] [--rows 2000] [--small 250] [--top 0]

Each distribution of ``bench_rows.py`` (seed 1, as bench_cli.py) runs ``qlora-train --stats-only`` in this
process under cProfile (fresh datasets cache, ``reasoning_history: drop``, tokenizer on one thread), on
``--rows`` and on ``--small`` rows. The table gives, per row, the cumulative time of the stages by the same
two-size difference as bench_cli.py (so fixed costs such as loading the tokenizer cancel); the floor's two
parts as the pipeline makes them (its template render, ``apply_template``, cheaper than the floor's
``apply_chat_template``, and the batched tokenization with offsets) are marked, what the pipeline does beyond
them is the rest. cProfile slows Python code more than Rust calls, so the shares of the Python stages
are upper bounds: bench_cli.py gives the real ratio. ``--top N`` also prints the N functions with the most
own time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_rows  # noqa: E402

# (label, file suffix, function): cumulative time per row; nested stages are indented under what holds them
STAGES = [
    ("stats-only, all", "qlora_train/cli.py", "main"),
    ("read the JSON lines into Arrow, label", "qlora_train/data/sources.py", "load_labelled_source"),
    ("datasets.map of the pipeline", "datasets/arrow_dataset.py", "map"),
    ("  the map function", "qlora_train/data/dataset.py", "_process_raw_batch"),
    ("    json.loads of the lines", "qlora_train/data/batches.py", "parse_readable"),
    ("    process_rows", "qlora_train/data/sft.py", "process_sft_rows"),
    ("      canonicalize_row", "qlora_train/data/parse.py", "canonicalize_row"),
    ("        tools from a JSON string", "qlora_train/data/parse.py", "row_tools"),
    ("      render_conversation", "qlora_train/masking/render.py", "render_conversation"),
    ("        template render (apply_template)", "qlora_train/masking/rendered.py", "render_text"),
    ("      check_unicode", "qlora_train/masking/messages.py", "check_unicode"),
    ("      encode_batch (floor)", "qlora_train/masking/tokenize.py", "encode_batch"),
    ("      count dropped reasoning tokens", "qlora_train/masking/count.py", "count_tokens"),
    ("      _fit_chat: labels, tool block", "qlora_train/data/sft.py", "_fit_chat"),
    ("        tool_schema_tokens", "qlora_train/data/sft.py", "tool_schema_tokens"),
    ("      dedup hash", "qlora_train/data/rows.py", "content_hash"),
    ("      parse report JSON", "qlora_train/data/rows.py", "report_json"),
    ("    the int-list columns as Arrow", "qlora_train/data/processed.py", "arrow_lists"),
    ("  Arrow writing", "datasets/arrow_writer.py", "write_table"),
    ("the statistics after the map", "qlora_train/diagnostics/run.py", "stats_report"),
    ("  tool schema tokens by re-render", "qlora_train/diagnostics/stats.py", "tool_schema_tokens"),
]


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> tuple[float, int]:
    total, calls = 0.0, 0
    for (file, _, func), (_, ncalls, _, cum, _) in stats.stats.items():
        if func == name and file.endswith(suffix):
            total, calls = total + cum, calls + ncalls
    return total, calls


def profile(name: str, n: int, work: Path, tok_dir: Path) -> pstats.Stats:
    from qlora_train import cli

    data = work / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in bench_rows.rows(name, n, seed=1)))
    config = work / f"{name}.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(tok_dir), "chat_template": "qwen3"},
        "data": {"datasets": [{"path": str(data)}], "max_length": 4096, "reasoning_history": "drop",
                 "cache_dir": str(work / f"cache-{name}")},
        "train": {"output_dir": str(work / "out"), "report_to": "none"}}))
    prof = cProfile.Profile()
    prof.enable()
    code = cli.main(["--config", str(config), "--stats-only", "--stats-dir", str(work / f"stats-{name}")])
    prof.disable()
    assert code in (0, None), code
    return pstats.Stats(prof)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dists", default="all")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--small", type=int, default=250)
    ap.add_argument("--top", type=int, default=0)
    args = ap.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    names = list(bench_rows.NAMES) if args.dists == "all" else args.dists.split(",")
    from qlora_train.tiny import build_qwen_tokenizer, save_tokenizer

    with tempfile.TemporaryDirectory(prefix="profile-cli-") as tmp:
        work = Path(tmp)
        save_tokenizer(build_qwen_tokenizer("qwen3"), work / "tokenizer")
        profile("chat", 50, work, work / "tokenizer")  # imports and first-call costs out of the way
        small = {name: profile(name, args.small, work, work / "tokenizer") for name in names}
        results = {name: profile(name, args.rows, work, work / "tokenizer") for name in names}
    n_rows = args.rows - args.small

    def per_row(name: str, suffix: str, func: str) -> float:
        return (cumulative(results[name], suffix, func)[0] - cumulative(small[name], suffix, func)[0]) / n_rows

    print(f"\ncProfile of --stats-only, {args.rows} - {args.small} rows per distribution: us per row (cumulative "
          "time, two-size difference) and % of the floor's two parts (template render + encode_batch)")
    print(f"{'stage':<38}" + "".join(f"{n:>15}" for n in names))
    floors = {n: sum(per_row(n, s, f) for label, s, f in STAGES if "(floor)" in label) for n in names}
    for label, suffix, func in STAGES:
        cells = [f"{per_row(n, suffix, func) * 1e6:>8.0f} {per_row(n, suffix, func) / floors[n]:>5.0%}"
                 for n in names]
        print(f"{label:<38}" + "".join(f"{c:>15}" for c in cells))
    for n in names[:args.top and len(names)]:
        print(f"\n--- {n}: top {args.top} by own time")
        results[n].sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
