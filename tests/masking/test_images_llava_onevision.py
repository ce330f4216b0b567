"""LLaVA-OneVision's images through the mask engine, checked against ``LlavaOnevisionProcessor`` on the real Qwen
vocabulary with ``<image>`` added: the template writes ``<image>`` for an image, the processor writes ``<image>`` x N
in its place, N by the image's size (anyres: the base crop's features + the best grid's unpadded features + one
newline a feature row), or the base crop's features + 1 for each image of a row with several. The rule counts from
the size alone (``vision.AnyresCount``, no pixels); on rows with 0-4 images of random sizes
(``test_images.vision_rows``) the ids equal the processor's, no image token is trained, and the trained tokens are
exactly those of the same rows without images. The real models' numbers (729 base features, 384-pixel crops, grids
up to 6x6) are checked too.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings

from qlora_train.masking import IMAGE_SLOT, DropReason, ImageRule, RowRejected, image_rule, mask_conversation
from tests.masking.test_images import image, trained, vision_rows, without_images
from tests.vision_rows import sizes_of


def ov_rule(tok, ip, num_image_tokens: int, select: str = "full") -> ImageRule:
    """The rule ``vision.image_rule_for`` makes for a LLaVA-OneVision base with image processor ``ip``."""
    from qlora_train.vision import AnyresCount, family_named

    f = family_named("llava-onevision")
    crop = min(ip.size["height"], ip.size["width"])
    count = AnyresCount(tuple(tuple(p) for p in ip.image_grid_pinpoints), crop, num_image_tokens, 9,
                        select == "default")
    return ImageRule(f.image_token, tok.convert_tokens_to_ids(f.image_token), ip, f.markers, type_ids="",
                     counter=count)


def _processor(tok, num_image_tokens: int, select: str = "full"):
    from transformers import LlavaOnevisionProcessor

    mp = pytest.MonkeyPatch()  # no video processor (it needs torchvision): images only
    mp.setattr(LlavaOnevisionProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
    proc = LlavaOnevisionProcessor(image_processor=image_rule(tok).image_processor, tokenizer=tok,
                                   num_image_tokens=num_image_tokens, vision_feature_select_strategy=select)
    mp.undo()
    return proc


@pytest.fixture(scope="module")
def ov(vl_tok):
    """(tokenizer with the tiny LLaVA-OneVision's rule, its ``LlavaOnevisionProcessor``)."""
    from tokenizers import AddedToken

    from qlora_train.data import get_chat_template
    from qlora_train.masking import set_image_rule
    from qlora_train.tiny import LLAVA_OV_TINY, tiny_image_processor

    tok = get_chat_template(copy.deepcopy(vl_tok), "llava-onevision")
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                          for t in ("<image>", "<video>")]})
    set_image_rule(tok, ov_rule(tok, tiny_image_processor("llava-onevision"), LLAVA_OV_TINY["num_image_tokens"]))
    return tok, _processor(tok, LLAVA_OV_TINY["num_image_tokens"])


def processor_ids(proc, text: str, sizes: list[tuple[int, int]]) -> list[int]:
    """The processor's own ids for the template's render (each image's run back to one ``<image>``) and images of
    ``sizes``, given as one sample's (a nested list: a row of several images is one sample of several)."""
    import re

    from PIL import Image

    plain = re.sub("(?:<image>)+", "<image>", text)
    images = [Image.new("RGB", s, (40 * k % 255, 90, 200)) for k, s in enumerate(sizes)]
    return proc(text=[plain], images=[images] if images else None)["input_ids"][0]  # one sample's images


ONE = [{"role": "user", "content": f"{IMAGE_SLOT}What is this?", "images": [image(100, 60)]},
       {"role": "assistant", "content": "A red box."}]


def test_layout_and_ids_exact(ov):
    tok, proc = ov
    m = mask_conversation(ONE, tok)
    # 100x60 -> the 64x32 grid of 2x1 crops: 16 base + the 8x4 grid unpadded to 8x4 (32) + 4 newlines = 52
    assert m.text == (f"<|im_start|>user\n{'<image>' * 52}What is this?<|im_end|>\n"
                      "<|im_start|>assistant\nA red box.<|im_end|>\n")
    assert m.input_ids == processor_ids(proc, m.text, sizes_of(ONE))
    assert tok.decode(trained(m)) == "A red box.<|im_end|>"


@pytest.mark.parametrize("sizes", [[(1000, 700)], [(30, 900)], [(1000, 700), (30, 900)], [(384, 384)]])
@pytest.mark.parametrize("select", ["full", "default"])
def test_the_real_models_counts(vl_tok, ov, sizes, select):
    """The real models' processor (729 base features, 384-pixel crops, grids up to 6x6 crops, anyres_max_9: the
    feature grid scaled down past 9 crops): the rule's count is its count, one image alone or several in a row."""
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    from qlora_train.masking import set_image_rule

    tok, _ = ov
    tok = set_image_rule(copy.copy(tok), ov_rule(tok, LlavaOnevisionImageProcessorPil(), 729, select))
    proc = _processor(tok, 729, select)
    msgs = [{"role": "user", "content": " ".join([IMAGE_SLOT] * len(sizes)) + " hi",
             "images": [image(w, h) for w, h in sizes]}, {"role": "assistant", "content": "ok"}]
    m = mask_conversation(msgs, tok)
    assert m.input_ids == processor_ids(proc, m.text, sizes)


@hsettings(max_examples=200, deadline=None)
@given(vision_rows())
@example([{"role": "user", "content": f"{IMAGE_SLOT}", "images": [image(8, 700)]},  # an image alone in its turn
          {"role": "assistant", "content": "thin"}])
@example([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # no image at all
def test_rows_with_images_match_the_processor(ov, msgs):
    tok, proc = ov
    m = mask_conversation(msgs, tok)
    sizes = sizes_of(msgs)
    assert m.input_ids == processor_ids(proc, m.text, sizes)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert image_id not in trained(m)  # no image token trained
    starts = [i for i, t in enumerate(m.input_ids) if t == image_id and (i == 0 or m.input_ids[i - 1] != image_id)]
    assert len(starts) == len(sizes)  # one run of image tokens an image (the slots are apart: words between)
    if len(sizes) > 1:
        assert m.input_ids.count(image_id) == 17 * len(sizes)  # several images: the base crop's 16 + 1 each
    assert trained(m) == trained(mask_conversation(without_images(msgs), tok))  # exactly the text row's


@pytest.mark.parametrize(("content", "why"), [
    (f"<video> {IMAGE_SLOT}", "'<video>'"),  # inputs this trainer does not read
    (f"<image> {IMAGE_SLOT}", "2 image placeholder(s)"),  # the placeholder as text
])
def test_refused_with_bad_image(ov, content, why):
    tok, _ = ov
    msgs = [{"role": "user", "content": content, "images": [image(50, 50)]}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RowRejected) as exc:
        mask_conversation(msgs, tok)
    assert exc.value.reason == DropReason.BAD_IMAGE and why in exc.value.detail


def test_collator_feeds_image_sizes_and_crops(ov, tmp_path):
    """``ImageCollator`` with the rule: a row's images processed together (``batch_num_images``), their crops
    padded to the batch's most, ``image_sizes`` (height, width) as the processor makes them; no type ids."""
    import torch
    from PIL import Image

    from qlora_train.train.collator import ImageCollator

    tok, proc = ov
    two = [{"role": "user", "content": f"{IMAGE_SLOT} and {IMAGE_SLOT}", "images": [image(100, 60), image(20, 90)]},
           {"role": "assistant", "content": "two"}]
    feats = []
    for r, msgs in enumerate((ONE, two)):
        refs = []
        for k, (w, h) in enumerate(sizes_of(msgs)):
            refs.append(str(tmp_path / f"{r}-{k}.png"))
            Image.new("RGB", (w, h), (40 * k % 255, 90, 200)).save(refs[-1])
        m = mask_conversation(msgs, tok)
        feats.append({"input_ids": m.input_ids, "labels": m.labels, "images": refs})
    batch = ImageCollator(tok.pad_token_id, image_rule(tok))(feats)
    assert batch["image_sizes"].tolist() == [[60, 100], [60, 100], [90, 20]]
    assert batch["batch_num_images"].tolist() == [1, 2]
    assert "mm_token_type_ids" not in batch and "token_type_ids" not in batch
    alone = proc.image_processor([Image.open(feats[0]["images"][0])], return_tensors="pt")["pixel_values"]
    assert batch["pixel_values"].shape == (3, *alone.shape[1:])  # the others (unpatched: 1 crop) padded to its crops
    assert torch.equal(batch["pixel_values"][:1], alone)
    pair = proc.image_processor([[Image.open(r) for r in feats[1]["images"]]], return_tensors="pt")["pixel_values"]
    assert torch.equal(batch["pixel_values"][1:, :pair.shape[1]], pair)
