"""Peak memory of ``--stats-only`` over rows of distinct 1 MB contents, with a chat template that reads an attribute
named by each row's content (``('{0.' ~ content ~ '}').format(m)``) and without that read (issue 35, item 4).

    python benchmarks/template_cache_memory.py [--rows 300] [--mb 1] [--baseline DIR] [--stats-only]

Each run is a fresh process under ``/usr/bin/time -f %M`` (peak RSS, KB) on the same rows (seeded);
``--baseline DIR`` also runs another copy of the package (``DIR/qlora_train``, e.g. the code before the change).
By default the process renders the rows one at a time (``apply_template``, past its checked renders), so that
the rows themselves take no memory and what a render keeps shows; ``--stats-only`` runs
``python -m qlora_train.cli --stats-only`` on them instead, with a fresh datasets cache (300 rows of 1 MB take
about 10 GB there: the whole batch's renders, offsets and masks). The done-when: the formatting template's peak
within 10% of the plain template's. The sandbox's decided-once cache used to keep every name it was asked for:
each row's content.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FORMATTING = PLAIN.replace("{{ m.content }}", "{{ m.content }}{{ ('{0.' ~ m.content ~ '}').format(m) }}")


def make_rows(rows: int, mb: float, seed: int = 0):
    """``rows`` conversations, each a user question of ``mb`` MB of letters (a valid field name, distinct per row)."""
    rng = random.Random(seed)
    letters = bytes.maketrans(bytes(range(256)), (string.ascii_lowercase * 10).encode()[:256])
    for i in range(rows):
        content = f"row{i}" + rng.randbytes(int(mb * 1_000_000)).translate(letters).decode()
        yield {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}


def write_rows(path: Path, rows: int, mb: float, seed: int = 0) -> None:
    with path.open("w") as f:
        for row in make_rows(rows, mb, seed):
            f.write(json.dumps(row) + "\n")


def render_rows(tokenizer: str, template_file: str, rows: int, mb: float) -> None:
    """The child process of the default mode: each row rendered once, then dropped."""
    from transformers import AutoTokenizer

    from qlora_train.masking import apply_template as at

    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.chat_template = Path(template_file).read_text()
    warm = [{"role": "user", "content": "warm"}]
    for _ in range(at.CHECKED_RENDERS):
        at.apply_template(warm, tok)
    for row in make_rows(rows, mb):
        at.apply_template(row["messages"], tok)
    print(f"kept decisions: {len(at._DECIDED)}", file=sys.stderr)


def render_peak_kb(package_root: Path, template: str, work: Path, tokenizer: str, rows: int, mb: float) -> int:
    work.mkdir()
    (work / "t.jinja").write_text(template)
    env = {**os.environ, "PYTHONPATH": str(package_root), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, __file__, "--child", tokenizer,
                          str(work / "t.jinja"), "--rows", str(rows), "--mb", str(mb)],
                         env=env, cwd=package_root, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"rendering failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return int(run.stderr.strip().splitlines()[-1])


def peak_kb(package_root: Path, template: str, data: Path, work: Path, tokenizer: str) -> int:
    work.mkdir()
    (work / "t.jinja").write_text(template)
    cfg = work / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"name_or_path": tokenizer, "chat_template": str(work / "t.jinja")},
        "data": {"datasets": [{"path": str(data)}], "cache_dir": str(work / "cache"), "max_length": 64},
        "train": {"output_dir": str(work / "out"), "report_to": "none"}}))
    env = {**os.environ, "PYTHONPATH": str(package_root), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "qlora_train.cli", "--config",
                          str(cfg), "--stats-only", "--stats-dir", str(work / "stats")],
                         env=env, cwd=package_root, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"--stats-only failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return int(run.stderr.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--mb", type=float, default=1.0, help="content size per row, in MB")
    parser.add_argument("--baseline", type=Path, help="another copy of the package, run the same way")
    parser.add_argument("--tokenizer", default=str(ROOT / ".cache/tiny-qwen3"))
    parser.add_argument("--stats-only", action="store_true", help="run --stats-only on the rows, not renders")
    parser.add_argument("--child", nargs=2, metavar=("TOKENIZER", "TEMPLATE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return render_rows(*args.child, args.rows, args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        if args.stats_only:
            write_rows(data, args.rows, args.mb)
        roots = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
        what = "--stats-only" if args.stats_only else "rendering them one at a time"
        print(f"{args.rows} rows of {args.mb} MB; peak RSS of {what} (/usr/bin/time -f %M)")
        for label, root in roots.items():
            runs = {}
            for name, template in (("plain", PLAIN), ("formatting", FORMATTING)):
                work = Path(tmp) / f"{label}-{name}"
                runs[name] = (peak_kb(root, template, data, work, args.tokenizer) if args.stats_only else
                              render_peak_kb(root, template, work, args.tokenizer, args.rows, args.mb))
            plain, formatting = runs["plain"], runs["formatting"]
            print(f"  {label:9s} plain {plain / 1024:8.1f} MB   formatting {formatting / 1024:8.1f} MB   "
                  f"{100 * (formatting - plain) / plain:+.1f}%")


if __name__ == "__main__":
    main()
