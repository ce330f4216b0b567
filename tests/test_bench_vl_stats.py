"""benchmarks/bench_vl_stats.py: its text rows are its image rows without their image parts, and a small run through
the CLI reads every image row and decodes no pixel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_benchmarks import load_bench

TINY_VL = Path(__file__).resolve().parents[1] / ".cache" / "tiny-qwen2.5-vl"


def test_text_rows_are_the_image_rows_without_their_images(tmp_path):
    bench = load_bench("bench_vl_stats")
    files, n_images = bench.write_rows(tmp_path, 6, 2)
    rows = {key: [json.loads(line) for line in path.read_text().splitlines()] for key, path in files.items()}
    assert n_images == 1 + 2 + 1 + 2 + 1 + 2 and len(list((tmp_path / "images").iterdir())) == n_images
    assert rows["images", 2] == rows["images", 6][:2] and rows["text", 2] == rows["text", 6][:2]
    for with_images, text in zip(rows["images", 6], rows["text", 6]):
        user = with_images["messages"][0]["content"]
        assert [p for p in user if p["type"] != "image"] == text["messages"][0]["content"]
        assert with_images["messages"][1] == text["messages"][1]
        assert all((tmp_path / p["image"]).is_file() for p in user if p["type"] == "image")


@pytest.mark.slow
@pytest.mark.skipif(not (TINY_VL / "config.json").is_file(), reason="python -m qlora_train.tiny --vision first")
def test_a_small_run_reads_every_image_row_and_decodes_no_pixel():
    import qlora_train

    if not (Path(qlora_train.__file__).parent / "vision.py").is_file():
        pytest.skip("the vision-language loader (issue 38's trainer, qlora_train/vision.py) is not merged")
    bench = load_bench("bench_vl_stats")
    result = bench.main(["--model", str(TINY_VL), "--rows", "12", "--small", "4", "--repeats", "1"])
    assert result["images"] == 18 and result["pixels_decoded"] == 0  # stats_run refuses a run with refused rows


def test_the_counter_counts_each_decode_in_a_fresh_process(tmp_path):
    import subprocess
    import sys

    from PIL import Image

    bench = load_bench("bench_vl_stats")
    bench.write_site(tmp_path)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    code = ("from PIL import Image; Image.open('a.png').size; Image.open('a.png').size; "
            "Image.open('a.png').load(); Image.open('a.png').convert('L')")  # 2 headers, 2 decodes
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=bench.counted_env(tmp_path, "r"), check=True)
    assert (tmp_path / "r.decodes").read_text() == "2"
