"""Rows with images -> canonical messages: an ``IMAGE_SLOT`` where each image sits and its ``ImageInfo`` (absolute
ref, size) in the message's ``images``; every problem with an image refuses only its row (``bad_image``), naming
the file. Real PNG/JPEG files written with Pillow; the real Qwen vocabulary with Qwen2.5-VL's image rule."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data.images import image_info, image_ref
from qlora_train.data.pairs import canonicalize_pair
from qlora_train.data.parse import PREFERENCE_IMAGES, canonicalize_row
from qlora_train.data.unpaired import canonicalize_unpaired
from qlora_train.masking import IMAGE_SLOT, RowRejected

S = IMAGE_SLOT


def png(path, size=(56, 84), color=(10, 20, 30)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, format="PNG")
    return path


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_only(path, width: int, height: int):
    """A PNG whose IHDR (checksum right) claims width x height, with a tiny IDAT: its pixels never exist."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0\0\0\0"))
                     + _chunk(b"IEND", b""))
    return path


def flipped_png(path):
    """A real PNG with bytes of its image data flipped (its chunk checksum no longer matches)."""
    png(path, (40, 40), (200, 100, 50))
    data = bytearray(path.read_bytes())
    at = data.index(b"IDAT") + 4 + 3
    data[at:at + 4] = bytes(b ^ 0xFF for b in data[at:at + 4])
    path.write_bytes(bytes(data))
    return path


def truncated_png(path):
    png(path, (40, 40), (5, 6, 7))
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def truncated_jpeg(path):
    """A JPEG cut inside its scan data: its header reads, its pixels do not decode."""
    im = Image.effect_noise((64, 64), 50).convert("RGB")
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=95)
    path.write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    return path


def chat(user_content, **row):
    return {"messages": [{"role": "user", "content": user_content}, {"role": "assistant", "content": "ok"}], **row}


def info(path, w=56, h=84):
    return {"ref": str(path), "width": w, "height": h}


def refused(row, cfg, tok=None) -> str:
    with pytest.raises(RowRejected) as exc:
        canonicalize_row(row, cfg, tokenizer=tok)
    assert exc.value.reason == "bad_image", exc.value
    return exc.value.detail


# --- each form -> the exact messages ---------------------------------------------------------------------------------

def test_openai_content_parts_with_every_kind_of_reference(tmp_path, vl_tok):
    a, b = png(tmp_path / "img" / "a.png"), png(tmp_path / "b.png", (84, 56))
    c = png(tmp_path / "c.png", (28, 28))
    uri = "data:image/png;base64," + base64.b64encode(c.read_bytes()).decode()
    parts = [{"type": "text", "text": "look: "}, {"type": "image", "image": "img/a.png"},
             {"type": "image_url", "image_url": {"url": f"file://{b}"}}, {"type": "text", "text": " and "},
             {"type": "image_url", "image_url": uri}, {"type": "image", "path": str(a), "text": None}]
    row = canonicalize_row(chat(parts), DataConfig(image_dir=str(tmp_path)), tokenizer=vl_tok)
    assert row.messages[0] == {"role": "user", "content": f"look: {S}{S} and {S}{S}", "train": False,
                               "images": [info(a), info(b, 84, 56), info(uri, 28, 28), info(a)]}
    assert row.messages[1] == {"role": "assistant", "content": "ok", "train": True}
    assert row.report.images == {"part": 4} and row.report.image_rows == 1


def test_trl_image_parts_take_the_column_images_in_order(tmp_path):
    a, b = png(tmp_path / "a.png"), png(tmp_path / "b.png", (28, 56))
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                                     {"type": "image", "image": None}]},
                        {"role": "assistant", "content": "ok"}], "images": ["a.png", "b.png"]}
    out = canonicalize_row(row, DataConfig(image_dir=str(tmp_path)))
    assert out.messages[0]["content"] == f"{S}and{S}" and out.messages[0]["images"] == [info(a), info(b, 28, 56)]
    assert out.report.images == {"part_from_column": 2}


def test_sharegpt_placeholders_take_the_column_images_in_message_order(tmp_path):
    a, b, c = (png(tmp_path / f"{n}.png") for n in "abc")
    row = {"conversations": [{"from": "human", "value": "<image>first"}, {"from": "gpt", "value": "one"},
                             {"from": "human", "value": "two: <image> vs <image>"}, {"from": "gpt", "value": "b"}],
           "images": [str(a), "b.png", {"path": "c.png"}]}
    out = canonicalize_row(row, DataConfig(image_dir=str(tmp_path)))
    assert [m["content"] for m in out.messages] == [f"{S}first", "one", f"two: {S} vs {S}", "b"]
    assert out.messages[0]["images"] == [info(a)] and out.messages[2]["images"] == [info(b), info(c)]
    assert "images" not in out.messages[1] and out.report.images == {"placeholder": 3}


def test_one_image_column_value_and_the_prompt_response_form(tmp_path):
    a = png(tmp_path / "a.png")
    out = canonicalize_row({"prompt": "<image>What is it?", "response": "a square", "image": "a.png"},
                           DataConfig(image_dir=str(tmp_path)))
    assert out.messages[0] == {"role": "user", "content": f"{S}What is it?", "images": [info(a)], "train": False}


def test_hugging_face_image_values(tmp_path):
    a = png(tmp_path / "a.png")
    raw = a.read_bytes()
    ref = "data:image/png;base64," + base64.b64encode(raw).decode()
    for value in ({"bytes": raw, "path": "ignored.png"}, {"bytes": base64.b64encode(raw).decode(), "path": None},
                  {"bytes": repr(raw), "path": None}):  # bytes, base64 text, and the text JSON made of bytes
        out = canonicalize_row(chat("<image>x", images=[value]), DataConfig(image_dir=str(tmp_path)))
        assert out.messages[0]["images"] == [info(ref)]
    out = canonicalize_row(chat("<image>x", images=[{"bytes": None, "path": "a.png"}]),
                           DataConfig(image_dir=str(tmp_path)))
    assert out.messages[0]["images"] == [info(a)]


def test_references_resolved(tmp_path):
    assert image_ref("x/../a.png", "/data", "w") == "/data/a.png"
    assert image_ref("/abs/a.png", "/data", "w") == "/abs/a.png"
    assert image_ref("file:///abs/a%20b.png", "/data", "w") == "/abs/a b.png"
    for bad, why in (("https://x.org/a.png", "remote images are not downloaded: https://x.org/a.png (download them "
                      "and name the local files; relative paths are found under data.image_dir)"),
                     ("s3://bucket/a.png", "scheme s3://"), ("data:text/plain;base64,aGk=", "not data:image/"),
                     ("", "an empty image reference"), (3, "of type int"), ({"size": 3}, "an image mapping without")):
        with pytest.raises(RowRejected, match="bad_image") as exc:
            image_ref(bad, "/data", "images[0]")
        assert exc.value.detail.startswith("images[0]: ") and why in exc.value.detail


def test_placeholder_text_without_an_images_column_stays_text():
    out = canonicalize_row(chat("what does <image> mean in LLaVA?"))
    assert out.messages[0] == {"role": "user", "content": "what does <image> mean in LLaVA?", "train": False}
    assert out.report.images == {} and out.report.image_rows == 0


def test_other_placeholder_and_image_columns(tmp_path):
    a = png(tmp_path / "a.png")
    cfg = DataConfig(image_dir=str(tmp_path), image_placeholder="[IMG]", image_columns=["pictures"])
    out = canonicalize_row(chat("[IMG] <image>", pictures="a.png", images=["ignored"]), cfg)
    assert out.messages[0]["content"] == f"{S} <image>" and out.messages[0]["images"] == [info(a)]


# --- refusals ------------------------------------------------------------------------------------------------------

def test_count_mismatch_refuses_the_row_saying_both_counts(tmp_path):
    png(tmp_path / "a.png")
    cfg = DataConfig(image_dir=str(tmp_path))
    assert refused(chat("<image><image>", images=["a.png"]), cfg) == (
        "2 image(s) asked for ('<image>' placeholders and image parts without a reference), but column 'images' "
        "holds 1")
    assert "1 image(s) asked for" in refused(chat("<image>", images=["a.png", "a.png"]), cfg)
    assert "0 image(s) asked for" in refused(chat("no placeholder", images=["a.png"]), cfg)
    assert "the row has no images column" in refused(chat([{"type": "image"}, {"type": "text", "text": "x"}]), cfg)


@pytest.mark.parametrize("empty", [[], None, ""])
def test_placeholders_in_a_row_whose_images_column_is_empty_are_refused(empty):
    """An images column that is there but empty holds 0 images: its placeholders ask for images it does not have (as
    more placeholders than images do); a row without the column keeps the placeholder as text."""
    assert refused(chat("<image>What is it?", images=empty), DataConfig()) == (
        "1 image(s) asked for ('<image>' placeholders and image parts without a reference), but column 'images' "
        "holds 0")
    assert "column 'images' holds 0" in refused(chat([{"type": "image"}, {"type": "text", "text": "x"}],
                                                     images=empty), DataConfig())
    assert canonicalize_row(chat("no placeholder", images=empty)).report.image_rows == 0


def test_a_literal_object_replacement_character_in_a_row_with_images(tmp_path):
    png(tmp_path / "a.png")
    cfg = DataConfig(image_dir=str(tmp_path))
    detail = refused({"messages": [{"role": "user", "content": "<image>x"},
                                   {"role": "assistant", "content": f"a {S} b"}], "images": ["a.png"]}, cfg)
    assert detail.startswith("messages[1]: the text holds U+FFFC")
    assert "U+FFFC" in refused(chat([{"type": "text", "text": S}, {"type": "image", "image": "a.png"}]), cfg)
    # a row without images keeps it as text
    assert canonicalize_row(chat(f"a {S}")).messages[0]["content"] == f"a {S}"


def test_an_image_inside_the_reasoning_block_is_refused(tmp_path):
    png(tmp_path / "a.png")
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think><image></think>a"}],
           "images": ["a.png"]}
    assert refused(row, DataConfig(image_dir=str(tmp_path))).startswith("messages[1]: ")


def bad_files(d):
    return {"missing": (d / "nope.png", "no such file"),
            "truncated": (truncated_png(d / "trunc.png"), "unreadable or corrupt"),
            "flipped": (flipped_png(d / "flip.png"), "unreadable or corrupt"),
            "huge": (png_header_only(d / "huge.png", 20000, 20000), "400000000 pixels is over "
                     "data.max_image_pixels=64000000"),
            "not_an_image": (d / "text.png", "not an image"),
            "zero": (png_header_only(d / "zero.png", 0, 5), "not an image")}


def test_each_bad_file_refuses_its_row_naming_the_file(tmp_path, vl_tok):
    (tmp_path / "text.png").write_text("hello")
    cfg = DataConfig(image_dir=str(tmp_path))
    for name, (path, why) in bad_files(tmp_path).items():
        detail = refused(chat("<image>x", images=[path.name]), cfg, vl_tok)
        assert detail.startswith(f"messages[0] <image> #0 <- column 'images'[0]: {path}: ") and why in detail, name
    wide = png(tmp_path / "wide.png", (600, 2))
    detail = refused(chat([{"type": "image", "image": "wide.png"}]), cfg, vl_tok)
    assert detail.startswith(f"messages[0].content[0]: {wide}: the image processor refuses it")
    assert "aspect ratio" in detail


def test_max_image_pixels_is_read_from_the_header(tmp_path, monkeypatch):
    a = png(tmp_path / "a.png", (100, 100))
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(1))
    with pytest.raises(RowRejected, match="10000 pixels is over data.max_image_pixels=9999"):
        image_info(str(a), max_pixels=9999)
    assert loads == []
    assert image_info(str(a), max_pixels=10000)["width"] == 100 and loads == [1]


def test_header_check_reads_no_pixels_and_decode_reads_each_once(tmp_path, monkeypatch):
    png(tmp_path / "a.png"), png(tmp_path / "b.png")
    row = chat("<image><image>", images=["a.png", "b.png"])
    real_load, loads = ImageFile.ImageFile.load, []

    def counting_load(self):
        loads.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    canonicalize_row(row, DataConfig(image_dir=str(tmp_path), image_check="header"))
    assert loads == []
    canonicalize_row(row, DataConfig(image_dir=str(tmp_path)))
    assert loads == [(56, 84), (56, 84)]


def test_a_corrupt_jpeg_is_caught_by_decode_not_by_the_header(tmp_path):
    truncated_jpeg(tmp_path / "t.jpg")
    row = chat("<image>x", images=["t.jpg"])
    out = canonicalize_row(row, DataConfig(image_dir=str(tmp_path), image_check="header"))
    assert out.messages[0]["images"][0]["width"] == 64
    assert "image file is truncated" in refused(row, DataConfig(image_dir=str(tmp_path)))


def test_images_outside_a_prompt_are_refused(tmp_path):
    """A pair's images are its prompt's, as an unpaired row's (tests/data/test_image_pairs.py); in a response or a
    completion, and in whole conversations without a prompt column, they are refused."""
    png(tmp_path / "a.png")
    cfg = DataConfig(image_dir=str(tmp_path))
    image_answer = [{"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]
    rows = [(canonicalize_pair, {"prompt": "q", "chosen": image_answer, "rejected": "b"}),
            (canonicalize_pair, {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                 "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
                                 "images": ["a.png"]}),
            (canonicalize_unpaired, {"prompt": "q", "completion": image_answer, "label": True})]
    for fn, row in rows:
        with pytest.raises(RowRejected) as exc:
            fn(row, cfg)
        assert exc.value.reason == "bad_image" and PREFERENCE_IMAGES in exc.value.detail, row


# --- through the real source: a data file beside its images ----------------------------------------------------------

def test_relative_paths_resolve_against_the_data_files_directory(tmp_path, vl_tok, monkeypatch):
    from qlora_train.data.dataset import build_datasets, load_and_process_sources

    d = tmp_path / "set"
    good = png(d / "pics" / "good.png")
    (d / "text.png").write_text("hello")
    bad = bad_files(d)
    wide = png(d / "wide.png", (600, 2))
    rows = [chat("<image>what is it?", images=["pics/good.png"])]
    rows += [chat("<image>x", images=[path.name]) for path, _ in bad.values()]
    rows += [chat([{"type": "image", "image": "wide.png"}, {"type": "text", "text": "x"}]),
             chat("<image><image>", images=["pics/good.png"]),
             chat("text only")]
    data = d / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)  # the data file's directory, not the current one
    cfg = DataConfig(datasets=[DatasetSource(path="set/train.jsonl")], cache_dir=str(tmp_path / "cache"))
    assert cfg.for_source(cfg.datasets[0]).image_dir == str(d)
    _, processed = load_and_process_sources(cfg.datasets, cfg, vl_tok)
    reasons = processed["drop_reason"]
    assert reasons == ["", *["bad_image"] * 8, ""]
    assert processed["images"][0] == [str(good)] and processed["num_images"][0] == 1
    assert processed["num_image_tokens"][0] == vl_tok.qlora_image_rule.tokens(56, 84)
    assert processed["images"][-1] == [] and processed["num_images"][-1] == 0
    details = processed["drop_detail"]
    for k, (path, why) in enumerate(bad.values(), start=1):
        assert details[k].startswith(f"set/train.jsonl:{k + 1}: ") and str(path) in details[k] and why in details[k]
    assert str(wide) in details[7] and "aspect ratio" in details[7]
    assert "2 image(s) asked for" in details[8]
    _, _, report = build_datasets(cfg, vl_tok)
    assert report.rows_kept == 2 and report.dropped == {"bad_image": 8}
    assert report.parse["images"] == {"placeholder": 1} and report.parse["image_rows"] == 1
    assert "images: 1 in 1 rows read: 1 from the images column, placed by placeholders in the text" in report.lines()


def test_the_rule_check_of_a_row_with_images(tmp_path, vl_tok):
    from qlora_train.data.pipeline import process_rows

    png(tmp_path / "a.png")
    out = process_rows([chat("<image>what is it?", images=["a.png"])], vl_tok,
                       DataConfig(image_dir=str(tmp_path), rule_check="all"))
    assert out["drop_reason"] == [""], out["drop_detail"]


def test_a_saved_dataset_with_an_image_feature(tmp_path, vl_tok):
    import datasets

    from qlora_train.data.dataset import load_and_process_sources

    raw = png(tmp_path / "a.png").read_bytes()
    ds = datasets.Dataset.from_dict({
        "messages": [[{"role": "user", "content": "<image>what?"}, {"role": "assistant", "content": "a square"}]],
        "images": [[{"bytes": raw, "path": None}]]}).cast_column("images", datasets.List(datasets.Image()))
    ds.save_to_disk(str(tmp_path / "saved"))
    cfg = DataConfig(datasets=[DatasetSource(path=str(tmp_path / "saved"))], cache_dir=str(tmp_path / "cache"),
                     rule_check="off")
    _, processed = load_and_process_sources(cfg.datasets, cfg, vl_tok)
    assert processed["drop_reason"] == [""], processed["drop_detail"]
    assert processed["images"] == [["data:image/png;base64," + base64.b64encode(raw).decode()]]


def test_source_image_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jsonl").write_text("{}\n")
    cfg = DataConfig()
    for path, want in (("a/x.jsonl", tmp_path / "a"), ("a", tmp_path / "a"), ("a/**/*.jsonl", tmp_path / "a"),
                       ("org/hub-set", None)):
        got = cfg.for_source(DatasetSource(path=path)).image_dir
        assert got == (str(want) if want else None), path
    assert cfg.for_source(DatasetSource(path="a/x.jsonl", image_dir="/pics")).image_dir == "/pics"
    assert DataConfig(image_dir="/all").for_source(DatasetSource(path="a/x.jsonl")).image_dir == "/all"


# --- property: interleavings of text and image parts -----------------------------------------------------------------

@pytest.fixture(scope="module")
def three_pngs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pngs")
    return [png(d / f"{k}.png", (28 * (k + 1), 28)) for k in range(3)]


TEXT = st.text(st.characters(blacklist_characters=IMAGE_SLOT, blacklist_categories=("Cs",)), max_size=6)
PART = st.one_of(st.tuples(st.just("text"), TEXT), st.tuples(st.sampled_from(["image", "column"]), st.integers(0, 2)))


@settings(max_examples=60, deadline=None)
@given(st.lists(PART, max_size=8).filter(lambda ps: any(kind != "text" for kind, _ in ps)))
@example([("text", "<image>"), ("column", 0), ("text", ""), ("image", 2)])
def test_content_split_at_slots_gives_back_the_texts_and_refs_in_order(three_pngs, parts):
    raw, column, texts, refs = [], [], [""], []
    for kind, value in parts:
        if kind == "text":
            raw.append({"type": "text", "text": value})
            texts[-1] += value
            continue
        path = str(three_pngs[value])
        if kind == "image":
            raw.append({"type": "image", "image": path})
        else:
            raw.append({"type": "image"})
            column.append(path)
        refs.append(path)
        texts.append("")
    out = canonicalize_row(chat(raw, images=column), DataConfig()).messages[0]
    assert out["content"].split(IMAGE_SLOT) == texts
    assert out["content"].count(IMAGE_SLOT) == len(out["images"]) == len(refs)
    assert [im["ref"] for im in out["images"]] == refs
    assert [im["width"] for im in out["images"]] == [Image.open(r).size[0] for r in refs]


def test_placeholders_without_images_and_remote_images_refused_through_the_cli(tmp_path, qwen_tokenizer_dir,
                                                                                 capsys):
    """What a user sees: a placeholder in a row whose images list is empty, and a remote image, are refused as
    bad_image with what to do; a placeholder in a row without an images column is text, kept."""
    import yaml

    from qlora_train.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (
        chat("<image>What is it?", images=[]), chat("<image>x", images=["http://x.io/a.png"]),
        chat("what does <image> mean in LLaVA?"))))
    cfg = {"model": {"name_or_path": str(qwen_tokenizer_dir), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(data)}], "cache_dir": str(tmp_path / "cache")},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    argv = ["--config", str(tmp_path / "cfg.yaml"), "--stats-only", "--debug-samples", "2", "--debug-refused"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "rows in 3, kept 1, dropped 2\n" in printed
    assert (f"refused: bad_image: {data}:1: 1 image(s) asked for ('<image>' placeholders and image parts without a "
            "reference), but column 'images' holds 0\n") in printed
    assert (f"refused: bad_image: {data}:2: messages[0] <image> #0 <- column 'images'[0]: remote images are not "
            "downloaded: http://x.io/a.png (download them and name the local files; relative paths are found under "
            "data.image_dir)\n") in printed


def test_stats_only_reads_image_headers_only(tmp_path, qwen_tokenizer_dir, monkeypatch):
    import yaml

    from qlora_train.cli import main
    from qlora_train.data import parse

    png(tmp_path / "a.png")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat("<image>x", images=["a.png"])) + "\n" + json.dumps(chat("text")) + "\n")
    cfg = {"model": {"name_or_path": str(qwen_tokenizer_dir), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(data)}], "cache_dir": str(tmp_path / "cache")},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    checks, real = [], parse.image_info
    monkeypatch.setattr(parse, "image_info", lambda ref, **kw: checks.append(kw["check"]) or real(ref, **kw))
    assert main(["--config", str(tmp_path / "cfg.yaml"), "--stats-only"]) == 0
    assert checks == ["header"]  # the image row is read, then refused: qwen3 reads no image
