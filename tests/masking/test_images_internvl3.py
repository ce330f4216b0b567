"""InternVL 3's images through the mask engine, checked against ``InternVLProcessor`` (the tiny model's GotOcr2 PIL
image processor, the real Qwen vocabulary, InternVL3's language model's, with ``<img>``, ``</img>``,
``<IMG_CONTEXT>`` added): the template writes ``<IMG_CONTEXT>`` and a newline for an image; the processor cuts the
image into the grid of 32-pixel tiles (1 to 6) whose aspect ratio is closest to the image's, plus a thumbnail where
that is more than one tile, and writes ``<img>`` + 4 x ``<IMG_CONTEXT>`` a tile + ``</img>``. On rows with 0-4
images of random sizes (``test_images.vision_rows``) the ids equal the processor's, each image's run holds its
tiles' tokens, none is trained, and the trained tokens are exactly those of the same rows without images.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings

from qlora_train.masking import IGNORE_INDEX, IMAGE_SLOT, DropReason, RowRejected, image_rule, mask_conversation
from tests.data.test_image_pairs import image_pairs
from tests.masking.test_images import image, trained, vision_rows, without_images
from tests.vision_rows import packing_problem, pictures, processor_output, rule_of_folder, sizes_of

CONTEXT, START, END = "<IMG_CONTEXT>", "<img>", "</img>"
EXPANDED = re.compile(r"<img>(?:<IMG_CONTEXT>)+</img>")


@pytest.fixture(scope="module")
def internvl3():
    """(tokenizer with the tiny InternVL 3's image rule, its ``InternVLProcessor``)."""
    from transformers import InternVLProcessor

    from qlora_train.masking import set_image_rule
    from qlora_train.tiny import INTERNVL3_TINY, build_internvl3_tokenizer, tiny_image_processor
    from qlora_train.vision import family_named, layout_rule

    tok = build_internvl3_tokenizer()
    config = {"vision_config": {k: INTERNVL3_TINY[k] for k in ("image_size", "patch_size")},
              "downsample_ratio": INTERNVL3_TINY["downsample_ratio"]}
    set_image_rule(tok, layout_rule(family_named("internvl3"), tiny_image_processor("internvl3"), tok, config))

    class Processor(InternVLProcessor):  # no video processor: InternVL's needs torchvision, not installed here
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return tok, Processor(image_processor=image_rule(tok).image_processor, tokenizer=tok, image_seq_length=4)


def processor_out(proc, text: str, sizes: list[tuple[int, int]]) -> dict:
    """The processor's own output for the template's render (each image's expansion back to ``<IMG_CONTEXT>``) and
    images of ``sizes``."""
    return processor_output(proc, EXPANDED.sub(CONTEXT, text), sizes, return_tensors="pt")


TWO = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": f"{IMAGE_SLOT}What is this? {IMAGE_SLOT}",
        "images": [image(50, 30), image(30, 30)]},
       {"role": "assistant", "content": "A red box."}]


def test_layout_and_ids_exact(internvl3):
    tok, proc = internvl3
    m = mask_conversation(TWO, tok)
    # 50x30 (aspect 1.67): the 3x2 grid (1.5, the closest of up to 6 tiles) and the thumbnail, 7 tiles; 30x30:
    # one tile, no thumbnail
    assert m.text == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{START}{CONTEXT * 28}{END}\n"
                      f"What is this? {START}{CONTEXT * 4}{END}\n<|im_end|>\n<|im_start|>assistant\nA red box."
                      "<|im_end|>\n")
    assert m.input_ids == processor_out(proc, m.text, sizes_of(TWO))["input_ids"]
    assert tok.decode(trained(m)) == "A red box.<|im_end|>"


def test_tile_count_agrees_with_the_image_processor():
    """The layout's tiles by size equal the image processor's own ``get_number_of_image_patches`` as the processor
    calls it (``crop_to_patches``) on a sweep of sizes, including ties between grids."""
    from qlora_train.masking.image_layouts import InternVLTiles
    from qlora_train.tiny import tiny_image_processor

    proc = tiny_image_processor("internvl3")
    for layout in (InternVLTiles(4, (32, 32), 1, 6), InternVLTiles(256, (448, 448), 1, 12),
                   InternVLTiles(4, (32, 32), 2, 4)):
        kwargs = {"crop_to_patches": True, "min_patches": layout.min_patches, "max_patches": layout.max_patches,
                  "patch_size": {"height": layout.tile[0], "width": layout.tile[1]}}
        for w in (1, 7, 16, 31, 32, 33, 48, 64, 96, 100, 447, 448, 896, 1000, 2000):
            for h in (1, 9, 16, 32, 50, 64, 96, 448, 900, 1344):
                assert layout.tiles(w, h) == proc.get_number_of_image_patches(h, w, kwargs), (layout, w, h)


@hsettings(max_examples=200, deadline=None)
@given(vision_rows())
@example([{"role": "user", "content": f"{IMAGE_SLOT}", "images": [image(8, 700)]},  # the thinnest grid: 1x6
          {"role": "assistant", "content": "thin"}])
@example([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # no image at all
def test_rows_with_images_match_the_processor(internvl3, msgs):
    tok, proc = internvl3
    m = mask_conversation(msgs, tok)
    sizes = sizes_of(msgs)
    out = processor_out(proc, m.text, sizes)
    assert m.input_ids == out["input_ids"]
    rule = image_rule(tok)
    tiles = [rule.layout.tiles(w, h) for w, h in sizes]
    assert out.get("pixel_values") is None or out["pixel_values"].shape[0] == sum(tiles)  # the tiles it decoded
    context = tok.convert_tokens_to_ids(CONTEXT)
    marks = set(tok.convert_tokens_to_ids([START, END]))
    runs = re.findall(r"<img>((?:<IMG_CONTEXT>)*)</img>", tok.decode(m.input_ids))
    assert [len(r) // len(CONTEXT) for r in runs] == [4 * t for t in tiles]
    assert not (marks | {context}) & set(trained(m))  # no image token or marker trained
    assert trained(m) == trained(mask_conversation(without_images(msgs), tok))  # exactly the text row's


@pytest.mark.parametrize("content, why", [
    (f"<img> {IMAGE_SLOT}", "'<img>'"),  # what only the processor writes
    (f"{IMAGE_SLOT}</img>", "'</img>'"),
    (f"<IMG_CONTEXT> {IMAGE_SLOT}", "2 image placeholder(s)"),  # the image token as text
    (f"{IMAGE_SLOT} a <video>", "'<video>'"),  # a video placeholder: the processor would expand it
])
def test_refused_with_bad_image(internvl3, content, why):
    tok, _ = internvl3
    msgs = [{"role": "user", "content": content, "images": [image(50, 50)]}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RowRejected) as exc:
        mask_conversation(msgs, tok)
    assert exc.value.reason == DropReason.BAD_IMAGE and why in exc.value.detail


def test_collator_feeds_every_tile_in_the_ids_order(internvl3, tmp_path):
    """``ImageCollator`` with InternVL's rule: every image's tiles and thumbnail, in order, as
    ``[tiles, 3, 32, 32]``: the processor's pixels exactly; no type ids."""
    import torch

    from qlora_train.train.collator import ImageCollator

    tok, proc = internvl3
    refs = []
    for k, picture in enumerate(pictures(sizes_of(TWO))):
        refs.append(str(tmp_path / f"{k}.png"))
        picture.save(refs[-1])
    m = mask_conversation(TWO, tok)
    batch = ImageCollator(tok.pad_token_id, image_rule(tok))([{"input_ids": m.input_ids, "labels": m.labels,
                                                               "images": refs}])
    ours = processor_out(proc, m.text, sizes_of(TWO))
    assert "token_type_ids" not in batch and "mm_token_type_ids" not in batch
    assert batch["pixel_values"].shape == (8, 3, 32, 32)
    assert torch.equal(batch["pixel_values"], ours["pixel_values"])


@hsettings(max_examples=50, deadline=None)
@given(image_pairs())
def test_image_pairs_share_the_prompts_image_tokens(internvl3, pair):
    """DPO / ORPO pairs on InternVL 3: each side's ids are the processor's, both sides hold the prompt's image
    tokens identically in the prompt they share, none trained on either side."""
    from qlora_train.data.pairs import build_preference_example
    from qlora_train.masking import SIDES

    tok, proc = internvl3
    prompt, chosen, rejected = pair
    ex = build_preference_example(prompt, chosen, rejected, tok)
    n = ex["prompt_length"]
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n]
    marks = set(tok.convert_tokens_to_ids([CONTEXT, START, END]))
    for side in SIDES:
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        assert not marks & {t for t in labels if t != IGNORE_INDEX}
        assert [i for i in ids[n:] if i in marks] == []
        assert ids == processor_out(proc, tok.decode(ids), sizes_of(prompt))["input_ids"]


def test_rule_read_from_the_models_config_and_packing_refused(internvl3, tmp_path):
    """``vision.image_rule_for`` on an InternVL folder: ``(image_size // patch_size)² x downsample_ratio²`` image
    tokens a tile (the real model's 448 // 14 = 32, 1024 / 4 = 256), the image processor's tile and patch bounds;
    packed image rows are refused at config time with the reason."""
    from qlora_train.masking.image_layouts import InternVLTiles

    tok, _ = internvl3
    real = {"model_type": "internvl", "vision_config": {"image_size": [448, 448], "patch_size": [14, 14]},
            "downsample_ratio": 0.5}
    rule = rule_of_folder(tmp_path / "m", "internvl3", real, tok)
    assert rule.layout == InternVLTiles(256, (32, 32), 1, 6) and rule.type_ids == ""
    assert rule.tokens(50, 30) == 7 * 256  # the 3x2 grid and the thumbnail
    problem = packing_problem(tmp_path / "p", real)
    assert problem.startswith("train.packing: packed image rows are not supported for ") and "(internvl)" in problem


def test_a_saved_processor_that_disagrees_with_the_model_is_refused(internvl3, tmp_path):
    """A ``processor_config.json`` whose ``image_seq_length`` is not the model config's: refused when the rule is
    made (the processor would write another count of ``<IMG_CONTEXT>`` a tile than the model reads)."""
    from qlora_train.errors import ModelLoadError

    tok, _ = internvl3
    config = {"model_type": "internvl", "vision_config": {"image_size": [32, 32], "patch_size": [8, 8]},
              "downsample_ratio": 0.5}
    rule = rule_of_folder(tmp_path, "internvl3", config, tok, {"image_seq_length": 4})
    assert rule.layout.image_seq_length == 4
    with pytest.raises(ModelLoadError, match="image_seq_length 256 differs from the model config's 4"):
        rule_of_folder(tmp_path, "internvl3", config, tok, {"image_seq_length": 256})
