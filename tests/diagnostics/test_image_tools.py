"""The diagnostics on image rows: ``--stats-only``'s image counts and ``--debug-samples``' image markers and
thumbnails, on rows the engine makes with the real Qwen vocabulary and the Qwen2-VL image processor's rule.

Sizes are chosen so the counts are checkable by hand: with 14 px patches merged 2x2 (28 px a token), a 56x56 image
is 4 tokens, 112x112 is 16, 224x224 is 64 (``min_pixels`` 28·28·4, ``max_pixels`` 28·28·64).
"""

from __future__ import annotations

import re

import pytest

from qlora_train.diagnostics.html import debug_html, read_tokens
from qlora_train.diagnostics.images import image_runs
from qlora_train.diagnostics.samples import format_sample, load_samples, trained_text
from qlora_train.diagnostics.stats import compute_stats, stats_lines
from qlora_train.masking import IMAGE_SLOT, mask_conversation, set_image_rule

PAD = "<|image_pad|>"


def png(path, w: int, h: int) -> str:
    from PIL import Image

    Image.new("RGB", (w, h), (200, 40, 40)).save(path)
    return str(path)


def processed_row(tok, msgs: list[dict]) -> dict:
    """The processed SFT row the pipeline writes for ``msgs`` (the columns the diagnostics read)."""
    m = mask_conversation(msgs, tok)
    refs = [im["ref"] for msg in msgs for im in msg.get("images", ())]
    pad = tok.convert_tokens_to_ids(PAD)
    return {"input_ids": m.input_ids, "labels": m.labels, "num_tokens_before": len(m.input_ids),
            "dropped_turns": 0, "reasoning_trimmed_tokens": 0, "token_fallback": "", "drop_reason": "",
            "drop_detail": "", "images": refs, "num_images": len(refs), "num_image_tokens": m.input_ids.count(pad)}


def image_messages(refs_sizes: list[tuple[str, int, int]], answer: str = "Red squares.") -> list[dict]:
    return [{"role": "user", "content": "Look: " + IMAGE_SLOT * len(refs_sizes) + " What colour?",
             "images": [{"ref": r, "width": w, "height": h} for r, w, h in refs_sizes]},
            {"role": "assistant", "content": answer}]


def stats_columns(n_images, n_tokens, num_tokens, reasons):
    n = len(reasons)
    details = [f"d.jsonl:{i + 1}: why" if r else "" for i, r in enumerate(reasons)]
    return {"drop_reason": reasons, "drop_detail": details,
            "num_tokens_before": num_tokens, "num_tokens": num_tokens, "num_trained_tokens": [5] * n,
            "dropped_turns": [0] * n, "reasoning_trimmed_tokens": [0] * n, "token_fallback": [""] * n,
            "straddling_tokens": [0] * n, "parse_report": ["{}"] * n, "expanded_tokens": [0] * n,
            "expanded_trained_tokens": [0] * n, "source": ["0:d.jsonl"] * n, "num_images": n_images,
            "num_image_tokens": n_tokens}


def test_stats_count_images_and_their_tokens_by_hand():
    # row 0: one 112x112 image (16 tokens) in 40 tokens; row 1: three images 4 + 16 + 64 = 84 tokens in 100;
    # row 2: text (no image); row 3: refused as bad_image
    cols = stats_columns([1, 3, 0, 0], [16, 84, 0, 0], [40, 100, 10, 0], ["", "", "", "bad_image"])
    s = compute_stats(cols, max_length=128)["overall"]
    im = s["images"]
    assert (im["rows_with_images"], im["images"], im["image_tokens"], im["bad_image"]) == (2, 4, 100, 1)
    assert im["images_per_row"] == {"p25": 1, "p50": 1, "p75": 3, "p90": 3, "p95": 3, "p99": 3, "max": 3}
    assert im["image_tokens_per_row"]["p50"] == 16 and im["image_tokens_per_row"]["max"] == 84
    assert im["share_of_max_length"]["p50"] == 16 / 128 and im["share_of_max_length"]["max"] == 84 / 128
    assert im["share_of_max_length"]["mean"] == pytest.approx((16 + 84) / 2 / 128)
    assert im["share_of_row_tokens"]["max"] == 0.84
    assert s["dropped"] == {"bad_image": 1}
    text = "\n".join(stats_lines(compute_stats(cols, max_length=128)))
    assert "dropped       1  bad_image  (first: d.jsonl:4: why)" in text
    assert "images: 4 in 2 kept rows (100 image tokens, never trained); refused as bad_image 1" in text
    assert "\n  images                   p25 1  p50 1  p75 3  p90 3  p95 3  p99 3  max 3\n" in text
    assert "\n  share of max_length=128  p25 12.5%  p50 12.5%" in text


def test_text_runs_print_what_they_printed():
    cols = stats_columns([0, 0], [0, 0], [40, 50], ["", ""])
    with_columns = compute_stats(cols, max_length=128)
    without = compute_stats({k: v for k, v in cols.items() if not k.startswith("num_image")}, max_length=128)
    assert "images" not in with_columns["overall"]
    assert stats_lines(with_columns) == stats_lines(without)


def test_image_share_advice():
    cols = stats_columns([1, 1], [100, 90], [120, 110], ["", ""])
    advice = compute_stats(cols, max_length=128)["advice"]
    assert any(line.startswith("image tokens take 70% of max_length=128 in the median row") for line in advice)


def test_debug_sample_shows_each_image_as_one_marker(vl_tok, tmp_path):
    refs = [(png(tmp_path / "a.png", 112, 112), 112, 112), (png(tmp_path / "b.png", 224, 224), 224, 224),
            (png(tmp_path / "c.png", 56, 56), 56, 56)]
    row = processed_row(vl_tok, image_messages(refs))
    raw = {"location": "d.jsonl:1", "source": "0:d.jsonl", "row": ""}
    (sample,) = load_samples([raw], [row], vl_tok, [0])
    assert [(r.tokens, r.size) for r in sample.images] == [(16, (112, 112)), (64, (224, 224)), (4, (56, 56))]
    text = format_sample(sample, color=False)
    assert "[image 112x112 → 16 tokens][image 224x224 → 64 tokens][image 56x56 → 4 tokens]" in text
    assert PAD not in text and "<|vision_start|>" not in text
    assert "images 3 (84 image tokens, 0 trained)" in text
    assert trained_text(sample) == ["Red squares.<|im_end|>"]  # the markers are shown untrained
    assert not re.search(r"⟦[^⟧]*\[image", text)
    tokens = format_sample(sample, color=False, show_tokens=True)
    assert PAD not in tokens and tokens.count("[image ") == 2 * 3  # in the text and one line each


def test_debug_html_has_thumbnails_and_no_pad_tokens(vl_tok, tmp_path):
    refs = [(png(tmp_path / "a.png", 112, 112), 112, 112), (png(tmp_path / "wide.png", 300, 60), 300, 60)]
    row = processed_row(vl_tok, image_messages(refs))
    raw = {"location": "d.jsonl:1", "source": "0:d.jsonl", "row": ""}
    page = debug_html(load_samples([raw], [row], vl_tok, [0]))
    uris = re.findall(r'<img class="thumb" src="(data:image/png;base64,[A-Za-z0-9+/=]+)"', page)
    assert len(uris) == 2
    from qlora_train.data.images import open_image

    assert open_image(uris[1]).size == (96, 19)  # 300x60 scaled to 96 px wide
    spans = read_tokens(page)["row-0"]
    images = [(on, text) for on, _, text in spans if text.startswith("[image")]
    # 300x60 -> 308x56 (the nearest multiples of 28) -> 11x2 = 22 tokens
    assert images == [(False, "[image 112x112 → 16 tokens]"), (False, "[image 300x60 → 22 tokens]")]
    assert PAD not in page


def test_debug_html_names_each_images_source_beside_its_thumbnail(vl_tok, tmp_path):
    """A file's path, or for bytes the row holds inline (a Parquet image column) the column and index; outside the
    token spans, so the tokens read back as before."""
    import base64
    import io
    import json

    from PIL import Image

    from qlora_train.data.images import image_ref

    a = png(tmp_path / "a.png", 112, 112)
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (0, 90, 200)).save(buf, format="PNG")
    inline = {"bytes": base64.b64encode(buf.getvalue()).decode("ascii"), "path": None}
    row = processed_row(vl_tok, image_messages([(a, 112, 112), (image_ref(inline, None, "x"), 56, 56)]))
    raw = {"location": "d.parquet[0]", "source": "0:d.parquet", "row": json.dumps({"images": ["a.png", inline]})}
    page = debug_html(load_samples([raw], [row], vl_tok, [0]))
    beside = re.findall(r'<img class="thumb" src="data:image/png;base64,[^"]+" alt="[^"]+">(\[image [^]]+\])</span>'
                        r'<span class="src" title="where the row has this image">([^<]+)</span>', page)
    assert beside == [("[image 112x112 → 16 tokens]", a), ("[image 56x56 → 4 tokens]", "column &#x27;images&#x27;[1]")]
    assert [text for _, _, text in read_tokens(page)["row-0"] if text.startswith("[image")] == [
        "[image 112x112 → 16 tokens]", "[image 56x56 → 4 tokens]"]


def test_a_missing_image_is_said_so_and_the_page_renders(vl_tok, tmp_path):
    path = png(tmp_path / "gone.png", 112, 112)
    row = processed_row(vl_tok, image_messages([(path, 112, 112)]))
    (tmp_path / "gone.png").unlink()
    raw = {"location": "d.jsonl:1", "source": "0:d.jsonl", "row": ""}
    samples = load_samples([raw], [row], vl_tok, [0])
    assert f"[image: {path}: no such file → 16 tokens]" in format_sample(samples[0], color=False)
    page = debug_html(samples)
    assert "<img" not in page and ": no such file → 16 tokens]" in page


def test_an_image_changed_since_processing_is_said_so(vl_tok, tmp_path):
    path = png(tmp_path / "a.png", 112, 112)
    row = processed_row(vl_tok, image_messages([(path, 112, 112)]))
    png(tmp_path / "a.png", 224, 224)  # replaced by a larger image: 64 tokens now
    (run,) = image_runs(row["input_ids"], row["images"], vl_tok)
    assert run.marker == "[image 224x224 → 16 tokens; its file now makes 64]"


def test_text_model_rows_have_no_runs(vl_tok):
    ids = vl_tok("hello <|image_pad|>", add_special_tokens=False)["input_ids"]
    assert len(image_runs(ids, [], vl_tok)) == 1
    rule = vl_tok.qlora_image_rule
    set_image_rule(vl_tok, None)  # a text model's tokenizer: its ids are never read as images
    try:
        assert image_runs(ids, [], vl_tok) == ()
    finally:
        set_image_rule(vl_tok, rule)


@pytest.mark.slow
def test_an_image_page_renders_in_chromium(vl_tok, tmp_path):
    from qlora_train.diagnostics.browser import check_page, chromium_binary

    if chromium_binary() is None:
        pytest.skip("no chromium (make browser installs it)")
    refs = [(png(tmp_path / "a.png", 112, 112), 112, 112), (str(tmp_path / "gone.png"), 56, 56)]
    png(tmp_path / "gone.png", 56, 56)
    row = processed_row(vl_tok, image_messages(refs))
    (tmp_path / "gone.png").unlink()
    raw = {"location": "d.jsonl:1", "source": "0:d.jsonl", "row": ""}
    page = tmp_path / "page.html"
    page.write_text(debug_html(load_samples([raw], [row], vl_tok, [0])))
    assert check_page(page, tmp_path / "page.png") == []  # every span back as written; not blank
