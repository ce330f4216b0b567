"""``--preprocess`` on image rows: the prepared directory keeps each row's image references (paths, ``data:``
URIs; never pixels), training from it reads the same references, and its fingerprint names an image file changed
or gone since it was prepared (``images.json``: each file's size and modification time)."""

from __future__ import annotations

import json
import os

import pytest

from qlora_train.config import Config, ConfigError
from qlora_train.data.prepared import (
    IMAGES_FILE,
    changed_images,
    check_prepared,
    fingerprint,
    image_refs,
    image_stamps,
    load_prepared,
    write_prepared,
)

DATA_URI = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAE"
            "lFTkSuQmCC")  # a 1x1 PNG


def png(path, w: int, h: int) -> str:
    from PIL import Image

    Image.new("RGB", (w, h), (10, 200, 30)).save(path)
    return str(path)


def image_row(i: int, refs: list[str]) -> dict:
    """A row with ``refs`` as OpenAI content parts (paths relative to the data file, or ``data:`` URIs)."""
    return {"messages": [{"role": "user", "content": [*({"type": "image", "image": r} for r in refs),
                                                      {"type": "text", "text": f"question {i}"}]},
                         {"role": "assistant", "content": f"answer {i}"}]}


@pytest.fixture
def prepared(tmp_path, vl_tok):
    """A prepared directory of three image rows (two files, one ``data:`` URI), written by ``write_prepared`` from
    a data file."""
    (tmp_path / "img").mkdir()
    a, b = png(tmp_path / "img" / "a.png", 112, 112), png(tmp_path / "img" / "b.png", 224, 56)
    rows = [image_row(0, ["img/a.png"]), image_row(1, ["img/b.png", "img/a.png"]), image_row(2, [DATA_URI])]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = Config.model_validate({"model": {"name_or_path": "tiny-vl"}, "data": {
        "datasets": [{"path": str(tmp_path / "d.jsonl")}], "eval_fraction": 0, "cache_dir": str(tmp_path / "c")},
        "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}})
    dest = tmp_path / "prepared"
    data = write_prepared(cfg, vl_tok, dest)
    assert data.report.rows_kept == 3
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"prepared_path": str(dest)})}), a, b


def test_the_prepared_rows_keep_their_image_references_and_training_reads_them(prepared, vl_tok):
    cfg, a, b = prepared
    train = load_prepared(cfg, vl_tok).train
    assert train["images"] == [[a], [b, a], [DATA_URI]]  # references, in order; no pixel column
    assert "pixel_values" not in train.column_names
    with open(os.path.join(cfg.data.prepared_path, IMAGES_FILE)) as f:
        saved = json.load(f)
    assert [s[0] for s in saved] == [a, b]  # the files; the data: URI's pixels are in the row
    assert saved[0][1] == os.path.getsize(a)


def test_an_image_changed_or_missing_since_preparing_is_named(prepared, vl_tok):
    cfg, a, b = prepared
    assert check_prepared(cfg, vl_tok)  # unchanged: passes
    png(a, 224, 224)  # another image at the same path: another size in bytes
    os.utime(a, (1_700_000_000, 1_700_000_000))
    os.remove(b)
    with pytest.raises(ConfigError) as err:
        check_prepared(cfg, vl_tok)
    text = str(err.value)
    assert f"an image changed since the data was prepared (its tokens were counted from its size then): {a}: " in text
    assert "modified 1700000000 now" in text
    assert f"{b}: missing" in text


def test_image_stamps_and_refs(tmp_path):
    import datasets

    a = png(tmp_path / "a.png", 8, 8)
    ds = datasets.Dataset.from_dict({"images": [[a, DATA_URI], [], [a, str(tmp_path / "none.png")]]})
    refs = image_refs(ds, None, datasets.Dataset.from_dict({"input_ids": [[1]]}))  # a text dataset has none
    assert refs == [a, str(tmp_path / "none.png")]
    stamps = image_stamps(refs)
    assert stamps == [[a, os.path.getsize(a), int(os.path.getmtime(a))], [str(tmp_path / "none.png"), None, None]]
    assert changed_images(stamps, stamps) == []
    assert changed_images([[a, 1, 2]], [[a, 1, 3]]) == [f"{a}: 1 bytes, modified 2 when prepared; 1 bytes, "
                                                        "modified 3 now"]


def test_a_text_run_fingerprints_no_images(vl_tok, tmp_path):
    cfg = Config.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d.jsonl"}]}})
    a = png(tmp_path / "a.png", 8, 8)
    plain, with_one = fingerprint(cfg, vl_tok), fingerprint(cfg, vl_tok, image_stamps([a]))
    assert plain["images"] == [] and with_one["images"] == image_stamps([a])
    assert plain["parts"]["images"] != with_one["parts"]["images"]
    assert plain["fingerprint"] != with_one["fingerprint"]
