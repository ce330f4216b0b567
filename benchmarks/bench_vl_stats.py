"""``--stats-only`` on image rows against the same rows without their images, through the CLI (issue 38).

    python benchmarks/bench_vl_stats.py [--model .cache/tiny-qwen2.5-vl] [--rows 1000] [--repeats 3]

Writes ``--rows`` rows once into a temporary folder: a user turn with 1 or 2 images (OpenAI content parts
``{"type": "image", "image": "images/N.png"}``, paths relative to the data file, a PNG file per image of four
sizes from 64x64 to 448x336) and a question, an assistant answer; and the same rows with the image parts removed.
Each is run as users run it, ``qlora-train --config … --stats-only``, in a fresh process with a fresh datasets
cache (``data.cache_dir`` in a new folder), interleaved (images, text, images, …), best of ``--repeats`` by wall
time and by CPU time (the process's user + system time). Prints both times, their ratio (the target: at most 2x)
and how many images' pixels the image runs decoded. The start-up (imports, tokenizer and processor, template
probe: most of a 1,000-row run) is the same for both; so the first ``--small`` rows of each are run too, and the
cost per row beyond the start-up, (time of ``--rows`` - time of ``--small``) / (rows - small), is compared as well.

Pixels decoded: every run gets a ``sitecustomize.py`` (a folder first on ``PYTHONPATH``) that wraps Pillow's
``ImageFile.ImageFile.load`` (where a file's pixels are decoded) to count its calls and write the count to the
file ``QLORA_BENCH_DECODES`` names at exit. Both kinds of run import Pillow for it at start-up, so the ratio
carries no difference of imports. ``--stats-only`` reads each image's size from its header (``data.image_check:
header``): the count is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "qlora_train.cli"]
SIZES = ((64, 64), (224, 224), (320, 180), (448, 336))  # 4, 64, 60, 54 tokens with the tiny processor (<= 64)
TARGET = 2.0

SITECUSTOMIZE = '''\
import atexit, os
_out = os.environ.get("QLORA_BENCH_DECODES")
if _out:
    from PIL import ImageFile
    _load, _count = ImageFile.ImageFile.load, [0]
    def _counted(self, *a, **k):
        _count[0] += 1
        return _load(self, *a, **k)
    ImageFile.ImageFile.load = _counted
    atexit.register(lambda: open(_out, "w").write(str(_count[0])))
'''


class Took(NamedTuple):
    wall: float
    cpu: float
    decodes: int


def write_rows(work: Path, n: int, small: int) -> tuple[dict[tuple[str, int], Path], int]:
    """``n`` image rows and the same rows without images, and their first ``small`` rows -> ({(kind, rows): data
    file}, images written)."""
    from PIL import Image

    images = work / "images"
    images.mkdir()
    with_images, text_only, k = [], [], 0
    for i in range(n):
        parts = []
        for _ in range(1 + i % 2):  # 1 or 2 images a row
            w, h = SIZES[k % len(SIZES)]
            Image.new("RGB", (w, h), (k * 37 % 256, k * 11 % 256, 128)).save(images / f"{k}.png")
            parts.append({"type": "image", "image": f"images/{k}.png"})
            k += 1
        question = {"type": "text", "text": f"Row {i}: what colour is shown, and how large is it? " * (1 + i % 3)}
        answer = {"role": "assistant", "content": f"A plain colour, shade {i % 97}. " * (1 + i % 4)}
        with_images.append({"messages": [{"role": "user", "content": [*parts, question]}, answer]})
        text_only.append({"messages": [{"role": "user", "content": [question]}, answer]})
    files = {}
    for kind, rows in (("images", with_images), ("text", text_only)):
        for size in (n, small):
            files[kind, size] = work / f"{kind}-{size}.jsonl"
            files[kind, size].write_text("".join(json.dumps(r) + "\n" for r in rows[:size]))
    return files, k


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def counted_env(work: Path, run: str) -> dict[str, str]:
    """The environment of a counted run: ``work/site`` (with ``SITECUSTOMIZE``) first on ``PYTHONPATH``, the
    count written to ``work/<run>.decodes``."""
    path = os.pathsep.join(filter(None, [str(work / "site"), str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "QLORA_BENCH_DECODES": str(work / f"{run}.decodes"), "PYTHONPATH": path}


def write_site(work: Path) -> None:
    (work / "site").mkdir(exist_ok=True)
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)


def stats_run(work: Path, model: Path, data: Path, run: str, max_length: int) -> Took:
    """One ``--stats-only`` run of ``data``: a fresh process, a fresh datasets cache, decodes counted."""
    cfg = {"model": {"name_or_path": str(model)},
           "data": {"datasets": [{"path": str(data)}], "max_length": max_length, "image_check": "header",
                    "cache_dir": str(work / "cache" / run)},
           "train": {"output_dir": str(work / "out" / run), "report_to": "none"}}
    config = work / f"{run}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    decodes, env = work / f"{run}.decodes", counted_env(work, run)
    cpu, start = children_cpu(), time.perf_counter()
    out = subprocess.run([*CLI, "--config", str(config), "--stats-only", "--stats-dir", str(work / "stats" / run)],
                         cwd=work, capture_output=True, text=True, env=env)
    took = time.perf_counter() - start, children_cpu() - cpu
    if out.returncode != 0:
        raise SystemExit(f"--stats-only on {data.name} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    stats = json.loads((work / "stats" / run / "stats.json").read_text())["overall"]
    if stats["rows_kept"] != stats["rows_in"]:
        raise SystemExit(f"{data.name}: {stats['rows_in'] - stats['rows_kept']} rows refused: {stats['dropped']} "
                         f"(first: {stats['first_dropped']})")
    return Took(*took, int(decodes.read_text()) if decodes.exists() else -1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-qwen2.5-vl")
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--small", type=int, default=100, help="rows of the runs whose time is the start-up's share")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-length", type=int, default=1024)
    args = p.parse_args(argv)
    args.model = args.model.resolve()  # the runs' working directory is the temporary folder
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model}: no model there; build it with `python -m qlora_train.tiny --vision`")
    with tempfile.TemporaryDirectory(prefix="bench-vl-") as tmp:
        work = Path(tmp)
        write_site(work)
        start = time.perf_counter()
        files, n_images = write_rows(work, args.rows, args.small)
        print(f"{args.rows} rows, {n_images} PNG files of sizes {', '.join(f'{w}x{h}' for w, h in SIZES)} "
              f"written in {time.perf_counter() - start:.1f} s; model {args.model}")
        runs: dict[tuple[str, int], list[Took]] = {key: [] for key in files}
        for r in range(args.repeats):
            for (kind, size), data in files.items():
                t = stats_run(work, args.model, data, f"{kind}-{size}-{r}", args.max_length)
                runs[kind, size].append(t)
                print(f"  run {r + 1} {kind:<6} {size:>5} rows  wall {t.wall:6.2f} s  cpu {t.cpu:6.2f} s  pixels "
                      f"decoded {t.decodes}", flush=True)
    best = {key: Took(min(t.wall for t in ts), min(t.cpu for t in ts), max(t.decodes for t in ts))
            for key, ts in runs.items()}
    big, small = args.rows, args.small
    per_row = {kind: ((best[kind, big].wall - best[kind, small].wall) / (big - small) * 1e3,
                      (best[kind, big].cpu - best[kind, small].cpu) / (big - small) * 1e3)
               for kind in ("images", "text")}
    decoded = max(best["images", big].decodes, best["images", small].decodes)
    result = {"rows": big, "images": n_images, "wall_s": {k: best[k, big].wall for k in ("images", "text")},
              "cpu_s": {k: best[k, big].cpu for k in ("images", "text")},
              "ratio_wall": best["images", big].wall / best["text", big].wall,
              "ratio_cpu": best["images", big].cpu / best["text", big].cpu,
              "per_row_ms": per_row, "per_row_ratio_cpu": per_row["images"][1] / per_row["text"][1],
              "pixels_decoded": decoded, "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    print(f"--stats-only, best of {args.repeats} (fresh process and datasets cache each):")
    for kind, label in (("images", f"{big} rows, {n_images} images"), ("text", f"{big} rows, text only")):
        b = best[kind, big]
        print(f"  {label:<24} wall {b.wall:6.2f} s  cpu {b.cpu:6.2f} s;  per row beyond the start-up "
              f"({big} - {small} rows): wall {per_row[kind][0]:5.2f} ms  cpu {per_row[kind][1]:5.2f} ms")
    print(f"  ratio images/text: whole run wall {result['ratio_wall']:.2f}x  cpu {result['ratio_cpu']:.2f}x "
          f"(target <= {TARGET:.0f}x: {'met' if result['ratio_wall'] <= TARGET else 'NOT met'}); per row cpu "
          f"{result['per_row_ratio_cpu']:.2f}x")
    print(f"  images whose pixels were decoded: {decoded} (Pillow's ImageFile.load calls)")
    return result


if __name__ == "__main__":
    main()
