"""Hostile images against the row path (issue 46): how long each takes to refuse its row, and how much memory it
adds over a normal run's peak.

    python benchmarks/bench_hostile_images.py [--seconds 5] [--timeout 120] [--cases ico,fifo,...]

Writes, once, into a temporary folder: a named pipe, real decompression bombs of 30,000 x 30,000 pixels (a greyscale
PNG of zeros, its IDAT streamed through zlib, inside an ICO and an ICNS; a deflate-compressed TIFF; a PackBits PSD;
an EPS whose bounding box is that size) and an 8,000 x 8,000 RGB PNG. Each case runs in a fresh process
(``PYTHONPATH`` decides whose code: this checkout's by default): the real Qwen vocabulary with the qwen2.5-vl
template and the tiny Qwen2.5-VL's image processor (``tests/conftest.py``'s ``vl_tok``), ``process_rows`` over 20
normal image rows first (a normal run: its peak RSS is the baseline), then the hostile row with
``data.row_budget.seconds`` = ``--seconds``, and prints the row's outcome, its seconds and the peak RSS it adds.
A case that does not end within ``--timeout`` is killed and reported as such (a pipe's open blocks forever).

Targets (issue 46): each hostile row refused within 2 x ``row_budget.seconds`` and under 500 MB above the normal
run's peak, and the run goes on (the next normal row is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDE = 30_000
LARGE = 8_000


def zeros_idat(width: int, height: int, channels: int) -> bytes:
    """A PNG's compressed pixels: ``height`` rows of zeros (filter byte 0 each), streamed through zlib."""
    z, row = zlib.compressobj(9), b"\0" * (1 + width * channels)
    out = [z.compress(row) for _ in range(height)]
    return b"".join(out) + z.flush()


def write_bombs(folder: Path) -> dict[str, str]:
    sys.path.insert(0, str(REPO))
    from tests.hostile_images import eps_bytes, icns_bytes, ico_bytes, png_bytes

    grey = png_bytes(SIDE, SIDE, zeros_idat(SIDE, SIDE, 1))
    files = {"ico": ("bomb.ico", ico_bytes(grey)), "icns": ("bomb.icns", icns_bytes(grey)),
             "eps": ("bomb.eps", eps_bytes(SIDE, SIDE)), "tiff": ("bomb.tif", tiff_deflate(SIDE, SIDE)),
             "psd": ("bomb.psd", psd_packbits(SIDE, SIDE)),
             "large": ("large.png", png_bytes(LARGE, LARGE, zeros_idat(LARGE, LARGE, 3), color_type=2))}
    out = {}
    for name, (file_name, data) in files.items():
        (folder / file_name).write_bytes(data)
        out[name] = str(folder / file_name)
    os.mkfifo(folder / "pipe.png")
    out["fifo"], out["device"] = str(folder / "pipe.png"), "/dev/zero"
    return out


def tiff_deflate(width: int, height: int, rows_per_strip: int = 1000) -> bytes:
    """A greyscale TIFF of zeros in deflate-compressed strips."""
    strip = zlib.compress(b"\0" * width * rows_per_strip, 9)
    n = -(-height // rows_per_strip)
    tags = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 8), (262, 3, 1, 1),
            (273, 4, n, None), (277, 3, 1, 1), (278, 4, 1, rows_per_strip), (279, 4, n, None)]
    ifd_size = 2 + 12 * len(tags) + 4
    offsets_at = 8 + ifd_size
    counts_at = offsets_at + 4 * n
    data_at = counts_at + 4 * n
    ifd = struct.pack("<H", len(tags))
    for tag, kind, count, value in tags:
        value = offsets_at if tag == 273 else counts_at if tag == 279 else value
        ifd += struct.pack("<HHI", tag, kind, count) + (struct.pack("<HH", value, 0) if kind == 3 and count == 1
                                                        else struct.pack("<I", value))
    ifd += struct.pack("<I", 0)
    offsets = struct.pack(f"<{n}I", *(data_at + k * len(strip) for k in range(n)))
    counts = struct.pack(f"<{n}I", *([len(strip)] * n))
    return b"II*\0" + struct.pack("<I", 8) + ifd + offsets + counts + strip * n


def psd_packbits(width: int, height: int) -> bytes:
    """An RGB PSD of zeros, each row PackBits-compressed (runs of 128 zeros)."""
    full, rest = divmod(width, 128)
    row = b"\x81\0" * full + (bytes([257 - rest]) + b"\0" if rest > 1 else b"\0\0" if rest == 1 else b"")
    header = b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, height, width, 8, 3) + struct.pack(">III", 0, 0, 0)
    counts = struct.pack(f">{3 * height}H", *([len(row)] * (3 * height)))
    return header + struct.pack(">H", 1) + counts + row * (3 * height)


CASE = r"""
import json, os, resource, sys, time
sys.path.insert(0, os.environ["BENCH_REPO"])
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from PIL import Image
from qlora_train.config import DataConfig
from qlora_train.data import process_rows
from qlora_train.masking import ImageRule, set_image_rule
from qlora_train.tiny import TINY_VL_MAX_PIXELS, TINY_VL_MIN_PIXELS, build_qwen_tokenizer

tok = build_qwen_tokenizer("qwen2.5-vl")
set_image_rule(tok, ImageRule.of(Qwen2VLImageProcessorPil(min_pixels=TINY_VL_MIN_PIXELS,
                                                          max_pixels=TINY_VL_MAX_PIXELS), tok))
folder, ref, refs, seconds, check = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
normal = []
for k in range(20):
    path = os.path.join(folder, f"normal{k}.png")
    if not os.path.exists(path):
        Image.new("RGB", (224 + 8 * k, 224), (k * 10, 40, 90)).save(path)
    normal.append({"messages": [{"role": "user", "content": [{"type": "image", "image": path},
                                                              {"type": "text", "text": f"What is {k}?"}]},
                                {"role": "assistant", "content": f"Picture {k}."}]})
cfg = DataConfig(row_budget={"seconds": seconds}, image_check=check)
mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out = process_rows(normal, tok, cfg)
assert all(r == "" for r in out["drop_reason"]), out["drop_detail"]
base = mb()
hostile = {"messages": [{"role": "user", "content": "<image>" * refs + "What is it?"},
                        {"role": "assistant", "content": "A picture."}], "images": [ref] * refs}
start = time.perf_counter()
out = process_rows([hostile, normal[0]], tok, cfg)
took = time.perf_counter() - start
print(json.dumps({"reason": out["drop_reason"][0], "detail": out["drop_detail"][0][:160],
                  "next_row_kept": out["drop_reason"][1] == "", "seconds": round(took, 2),
                  "normal_peak_mb": round(base), "added_mb": round(mb() - base)}))
"""


def run_case(folder: Path, ref: str, refs: int, seconds: float, check: str, timeout: float) -> dict:
    env = {**os.environ, "BENCH_REPO": os.environ.get("PYTHONPATH", str(REPO)).split(os.pathsep)[0],
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        done = subprocess.run([sys.executable, "-c", CASE, str(folder), ref, str(refs), str(seconds), check],
                              capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"reason": f"(still running after {timeout:.0f} s: killed)"}
    if done.returncode != 0:
        return {"reason": f"(exit {done.returncode})", "detail": done.stderr.strip().splitlines()[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="data.row_budget.seconds")
    p.add_argument("--timeout", type=float, default=120.0, help="kill a case after this many seconds")
    p.add_argument("--cases", default="fifo,device,ico,icns,tiff,psd,eps,large1000",
                   help="comma-separated: fifo, device, ico, icns, tiff, psd, eps, large1000 (1,000 references "
                        "to one 8,000 x 8,000 image)")
    p.add_argument("--check", default="decode", choices=("decode", "header"),
                   help="data.image_check (header: what --stats-only uses)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        files = write_bombs(folder)
        print(f"code: {os.environ.get('PYTHONPATH') or REPO}; row_budget.seconds={args.seconds}; "
              f"image_check={args.check}")
        for case in args.cases.split(","):
            name, refs = ("large", 1000) if case == "large1000" else (case, 1)
            got = run_case(folder, files[name], refs, args.seconds, args.check, args.timeout)
            ok = (got.get("reason") in ("bad_image", "over_budget") and got.get("seconds", 1e9) <= 2 * args.seconds
                  and got.get("added_mb", 1e9) < 500 and got.get("next_row_kept"))
            print(f"{case:10} {'ok  ' if ok else 'MISS'} {json.dumps(got)}", flush=True)


if __name__ == "__main__":
    main()
