"""Hostile images (issue 46): a row's image never hangs, floods or corrupts a run. Nothing but a regular file is
opened; a format whose reader decodes on open (or runs a program) is refused by name; Pillow's own bomb guard is
on, set from ``data.max_image_pixels``; one image referred to many times is read once and the row's pixels are
capped; the row's seconds are looked at per image; images stand upright (EXIF) and 16-bit ones are scaled, not
clipped; ``data.image_root`` keeps references inside a folder."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from PIL import Image, ImageFile, ImageOps

from qlora_train.config import DataConfig
from qlora_train.data import parse, process_rows
from qlora_train.data.images import ImageUnreadable, image_info, image_ref, open_image
from qlora_train.data.parse import canonicalize_row
from qlora_train.masking import RowRejected
from tests.hostile_images import BOMBS, png_bytes

FORMATS_READ = "PNG, JPEG, GIF, WEBP, BMP, TIFF"


@contextlib.contextmanager
def at_most(seconds: int):
    """Fail (instead of hanging the suite) when the block runs longer than ``seconds``."""
    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def chat(content, **row):
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}], **row}


def refused(row, cfg=None, *, reason: str = "bad_image") -> str:
    with pytest.raises(RowRejected) as exc:
        canonicalize_row(row, cfg or DataConfig())
    assert exc.value.reason == reason, exc.value
    return exc.value.detail


def png(path, size=(56, 84), color=(10, 20, 30), mode="RGB"):
    Image.new(mode, size, color).save(path, format="PNG")
    return path


@pytest.fixture
def loads(monkeypatch):
    """Every image decode (``ImageFile.load``) recorded with Pillow's pixel limit at that moment."""
    real, seen = ImageFile.ImageFile.load, []

    def load(self):
        seen.append((self.size, Image.MAX_IMAGE_PIXELS))
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return seen


COLUMN = "messages[0] <image> #0 <- column 'images'[0]"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_a_device_or_a_directory_is_refused_without_being_opened(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    (tmp_path / "link.png").symlink_to(fifo)
    cases = [(fifo, "a named pipe (FIFO)"), (tmp_path / "link.png", "a named pipe (FIFO)"),
             ("/dev/zero", "a character device"), (tmp_path, "a directory")]
    with at_most(20):  # an open() of the pipe would wait for a writer forever
        for path, kind in cases:
            for check in ("decode", "header"):  # training's preprocessing, --stats-only's
                detail = refused(chat("<image>x", images=[str(path)]), DataConfig(image_check=check))
                assert detail == f"{COLUMN}: {path}: {kind}, not an image file: only regular files are read"
        with pytest.raises(ImageUnreadable, match="named pipe"):  # the collator's read, and the debug page's
            open_image(str(fifo))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_refuses_its_row_in_the_pipeline_and_the_next_row_is_kept(tmp_path, vl_tok):
    os.mkfifo(tmp_path / "pipe.png")
    png(tmp_path / "a.png")
    rows = [chat("<image>x", images=["pipe.png"]), chat("<image>y", images=["a.png"])]
    with at_most(30):
        out = process_rows(rows, vl_tok, DataConfig(image_dir=str(tmp_path), row_budget={"seconds": 5}))
    assert out["drop_reason"] == ["bad_image", ""]
    assert "a named pipe (FIFO)" in out["drop_detail"][0]


@pytest.mark.parametrize("name", ["ico", "icns", "psd", "eps"])
def test_a_bomb_in_a_format_that_decodes_on_open_is_refused_by_its_name(tmp_path, name, loads):
    """ICO and ICNS decode their frame while the file opens (a 30,000² PNG inside: 900 M pixels decoded before any
    check), EPS runs Ghostscript: refused by format, nothing decoded."""
    file_name, make = BOMBS[name]
    (tmp_path / file_name).write_bytes(make())
    start = time.perf_counter()
    detail = refused(chat("<image>x", images=[str(tmp_path / file_name)]))
    assert time.perf_counter() - start < 1
    assert detail == (f"{COLUMN}: {tmp_path / file_name}: an image of format {name.upper()}, which is not read "
                      f"(read: {FORMATS_READ})")
    assert loads == []


def test_a_tiff_bomb_is_refused_from_its_header(tmp_path, loads):
    file_name, make = BOMBS["tiff"]
    (tmp_path / file_name).write_bytes(make())
    detail = refused(chat("<image>x", images=[str(tmp_path / file_name)]))
    assert detail == (f"{COLUMN}: {tmp_path / file_name}: 900000000 pixels is over data.max_image_pixels=64000000 "
                      "(read from the header, before decoding)")
    assert loads == []


def test_pillows_bomb_guard_is_on_while_an_image_is_decoded_set_from_max_image_pixels(tmp_path, loads):
    before = Image.MAX_IMAGE_PIXELS
    png(tmp_path / "a.png", (100, 100))
    image_info(str(tmp_path / "a.png"), max_pixels=12345)
    assert loads == [((100, 100), 12345)]
    open_image(str(tmp_path / "a.png"), max_pixels=23456)
    assert {limit for _, limit in loads[1:]} == {23456}
    assert Image.MAX_IMAGE_PIXELS == before  # restored after


def test_one_image_referred_to_a_thousand_times_is_read_once_and_the_row_pixels_are_capped(tmp_path, loads):
    png(tmp_path / "a.png", (100, 100))
    row = chat("<image>" * 1000, images=["a.png"] * 1000)
    cfg = DataConfig(image_dir=str(tmp_path), max_row_image_pixels=50_000)
    detail = refused(row, cfg, reason="over_budget")
    assert detail == ("messages[0] <image> #5 <- column 'images'[5]: the row's images hold 60,000 pixels > "
                      "data.max_row_image_pixels=50,000")
    assert len(loads) == 1
    loads.clear()
    out = canonicalize_row(row, DataConfig(image_dir=str(tmp_path)))  # 10 M pixels: under the default cap
    assert len(out.messages[0]["images"]) == 1000 and len(loads) == 1


def test_the_row_budget_is_looked_at_per_image(tmp_path, monkeypatch, vl_tok):
    """Each image read inside the row's seconds: a row of 40 images that take 0.05 s each is refused after the
    image that passes its 0.2 s, not after all 40."""
    for k in range(40):
        png(tmp_path / f"{k}.png", (28, 28))
    real, reads = parse.image_info, []

    def slow(ref, **kw):
        reads.append(ref)
        time.sleep(0.05)
        return real(ref, **kw)

    monkeypatch.setattr(parse, "image_info", slow)
    rows = [chat("<image>" * 40, images=[f"{k}.png" for k in range(40)])]
    out = process_rows(rows, vl_tok, DataConfig(image_dir=str(tmp_path), row_budget={"seconds": 0.2}))
    assert out["drop_reason"] == ["over_budget"] and "> row_budget.seconds=0.2" in out["drop_detail"][0]
    assert 4 <= len(reads) <= 6


def exif_jpeg(path, orientation: int):
    """A 60x40 JPEG, left half red, right half blue, whose EXIF says ``orientation``."""
    im = Image.new("RGB", (60, 40), (255, 0, 0))
    im.paste((0, 0, 255), (30, 0, 60, 40))
    exif = Image.Exif()
    exif[0x0112] = orientation
    im.save(path, format="JPEG", exif=exif.tobytes(), quality=95)
    return path


def test_an_image_stands_upright_as_its_exif_says(tmp_path):
    path = str(exif_jpeg(tmp_path / "turned.jpg", 6))  # 6: shown turned a quarter clockwise
    info = image_info(path)
    assert (info["width"], info["height"]) == (40, 60)
    im = open_image(path)
    with Image.open(path) as stored:
        assert im.tobytes() == ImageOps.exif_transpose(stored).convert("RGB").tobytes()  # transformers' load_image
    assert im.size == (40, 60) and im.getpixel((20, 5))[0] > 200 and im.getpixel((20, 55))[2] > 200
    assert image_info(str(exif_jpeg(tmp_path / "upright.jpg", 1)))["width"] == 60


def test_a_16_bit_image_is_scaled_to_8_bits_and_a_32_bit_one_is_refused(tmp_path):
    import numpy as np

    grey = np.zeros((4, 4), dtype=np.uint16)
    grey[0, 0], grey[0, 1], grey[0, 2] = 65535, 32896, 257  # 255, 128 and 1 in 8 bits (v / 257)
    Image.fromarray(grey).save(tmp_path / "deep.png")
    im = open_image(str(tmp_path / "deep.png"))
    assert [im.getpixel((x, 0)) for x in range(4)] == [(255,) * 3, (128,) * 3, (1,) * 3, (0,) * 3]
    Image.fromarray(np.ones((4, 4), dtype=np.float32)).save(tmp_path / "float.tif")
    detail = refused(chat("<image>x", images=[str(tmp_path / "float.tif")]))
    assert detail == (f"{COLUMN}: {tmp_path / 'float.tif'}: 32-bit float pixels (mode F): their range is not "
                      "known, so they are not scaled to 8 bits; save the image with 8 or 16 bits a channel")


def test_image_root_refuses_a_path_outside_it_links_followed(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    png(root / "a.png"), png(tmp_path / "secret.png")
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    cfg = DataConfig(image_dir=str(root), image_root=str(root))
    assert canonicalize_row(chat("<image>x", images=["a.png"]), cfg).messages[0]["images"][0]["ref"] == \
        str(root / "a.png")
    for ref, resolved in (("../secret.png", tmp_path / "secret.png"), ("link.png", root / "link.png"),
                          ("/etc/hostname", "/etc/hostname")):
        detail = refused(chat("<image>x", images=[ref]), cfg)
        assert detail == f"{COLUMN}: {resolved}: outside data.image_root={root} (links followed)"
    out = canonicalize_row(chat("<image>x", images=["../secret.png"]), DataConfig(image_dir=str(root)))
    assert out.messages[0]["images"][0]["ref"] == str(tmp_path / "secret.png")  # unset: any readable file


def test_a_reference_that_is_not_valid_text_is_refused():
    """A lone surrogate (an undecodable byte of the data file) in a path: it could not be stored (UTF-8 Arrow)."""
    with pytest.raises(RowRejected, match=r"images\[0\]: an image reference that is not valid text \('a\\udcff.png'\)"):
        image_ref("a\udcff.png", None, "images[0]")


def test_a_png_header_claiming_a_bomb_never_decodes(tmp_path, loads):
    (tmp_path / "big.png").write_bytes(png_bytes(30_000, 30_000))
    assert "900000000 pixels is over" in refused(chat("<image>x", images=[str(tmp_path / "big.png")]))
    assert loads == []
