"""Gemma 3's images through the mask engine, checked against ``Gemma3Processor`` on the real Gemma 3 vocabulary: the
template writes ``<start_of_image>`` for an image, the processor writes ``\\n\\n<start_of_image>`` + its
``image_seq_length`` x ``<image_soft_token>`` + ``<end_of_image>\\n\\n`` in its place whatever the image's size (the
tiny model's 4, the real models' 256). On rows with 0-4 images of random sizes (``test_images.vision_rows``) the ids
equal the processor's, no image or marker token is trained, the image tokens are 4 an image, the trained tokens are
exactly those of the same rows without images, and the collator's ``token_type_ids`` are the processor's.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings

from qlora_train.masking import (
    IGNORE_INDEX,
    IMAGE_SLOT,
    DropReason,
    ImageRule,
    RowRejected,
    image_rule,
    mask_conversation,
)
from tests.data.test_image_pairs import image_pairs
from tests.masking.test_images import image, trained, vision_rows, without_images
from tests.vision_rows import sizes_of

MARKERS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def gemma3_rule(tok, tokens: int) -> ImageRule:
    """The rule ``vision.image_rule_for`` makes for a Gemma 3 base (its family's declaration) of ``tokens`` an
    image, with the tiny model's image processor."""
    from qlora_train.tiny import tiny_image_processor
    from qlora_train.vision import family_named

    f = family_named("gemma3")
    return ImageRule.wrapped(tiny_image_processor("gemma3"), tok, placeholder=f.placeholder, image_token=f.image_token,
                             before=f.wrapper[0], after=f.wrapper[1], tokens=tokens, type_ids=f.type_ids,
                             other_tokens=f.markers)


@pytest.fixture(scope="module")
def gemma3(real_vocab_dir):
    """(tokenizer with the tiny Gemma 3's image rule (4 tokens an image), its ``Gemma3Processor``)."""
    from transformers import AutoTokenizer, Gemma3Processor

    from qlora_train.data import get_chat_template
    from qlora_train.masking import set_image_rule

    tok = get_chat_template(AutoTokenizer.from_pretrained(real_vocab_dir("gemma3")), "gemma3")
    set_image_rule(tok, gemma3_rule(tok, 4))
    return tok, Gemma3Processor(image_processor=image_rule(tok).image_processor, tokenizer=tok, image_seq_length=4)


def processor_out(proc, text: str, sizes: list[tuple[int, int]]) -> dict:
    """The processor's own output for the template's render (each image's expansion back to ``<start_of_image>``)
    and images of ``sizes`` (the render already holds ``<bos>``: no special tokens added)."""
    from PIL import Image

    rule = image_rule(proc.tokenizer)
    plain = re.sub(re.escape(rule.before) + f"(?:{re.escape(rule.image_token)})+" + re.escape(rule.after),
                   rule.written, text)
    images = [Image.new("RGB", s, (40 * k % 255, 90, 200)) for k, s in enumerate(sizes)] or None
    out = proc(text=[plain], images=images, add_special_tokens=False)
    return {k: v[0] for k, v in out.items() if k != "pixel_values"}


TWO = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": f"{IMAGE_SLOT}What is this? {IMAGE_SLOT}",
        "images": [image(100, 60), image(300, 500)]},
       {"role": "assistant", "content": "A red box."}]


def test_layout_and_ids_exact(gemma3):
    tok, proc = gemma3
    m = mask_conversation(TWO, tok)
    img = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    assert m.text == (f"<bos><start_of_turn>user\nBe brief.\n\n{img}What is this?{img}<end_of_turn>\n"
                      "<start_of_turn>model\nA red box.<end_of_turn>\n")
    assert m.input_ids == processor_out(proc, m.text, sizes_of(TWO))["input_ids"]
    assert tok.decode(trained(m)) == "A red box.<end_of_turn>"


def test_the_real_models_256_tokens_an_image(gemma3):
    """The real models' count (``image_seq_length`` 256 = ``mm_tokens_per_image``): the same rule, the same ids."""
    from transformers import Gemma3Processor

    from qlora_train.masking import set_image_rule

    tok, _ = gemma3
    tok = set_image_rule(__import__("copy").copy(tok), gemma3_rule(tok, 256))
    proc = Gemma3Processor(image_processor=image_rule(tok).image_processor, tokenizer=tok)
    assert proc.image_seq_length == 256  # the processor's default: the real models'
    m = mask_conversation(TWO, tok)
    assert m.input_ids.count(tok.convert_tokens_to_ids("<image_soft_token>")) == 2 * 256
    assert m.input_ids == processor_out(proc, m.text, sizes_of(TWO))["input_ids"]


@hsettings(max_examples=200, deadline=None)
@given(vision_rows())
@example([{"role": "user", "content": f"{IMAGE_SLOT}", "images": [image(8, 700)]},  # an image alone in its turn
          {"role": "assistant", "content": "thin"}])
@example([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # no image at all
def test_rows_with_images_match_the_processor(gemma3, msgs):
    tok, proc = gemma3
    m = mask_conversation(msgs, tok)
    out = processor_out(proc, m.text, sizes_of(msgs))
    assert m.input_ids == out["input_ids"]
    markers = set(tok.convert_tokens_to_ids(list(MARKERS)))
    assert not markers & set(trained(m))  # no image or marker token trained
    soft = tok.convert_tokens_to_ids("<image_soft_token>")
    assert m.input_ids.count(soft) == 4 * len(sizes_of(msgs))
    assert [int(i == soft) for i in m.input_ids] == out["token_type_ids"]  # what the collator feeds the model
    assert trained(m) == trained(mask_conversation(without_images(msgs), tok))  # exactly the text row's


@pytest.mark.parametrize(("content", "why"), [
    (f"<image_soft_token> {IMAGE_SLOT}", "'<image_soft_token>'"),  # what only the processor writes
    (f"{IMAGE_SLOT}<end_of_image>", "'<end_of_image>'"),
    (f"<start_of_image> {IMAGE_SLOT}", "2 image placeholder(s)"),  # the placeholder as text
])
def test_refused_with_bad_image(gemma3, content, why):
    tok, _ = gemma3
    msgs = [{"role": "user", "content": content, "images": [image(50, 50)]}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RowRejected) as exc:
        mask_conversation(msgs, tok)
    assert exc.value.reason == DropReason.BAD_IMAGE and why in exc.value.detail


def test_collator_feeds_token_type_ids(gemma3, tmp_path):
    """``ImageCollator`` with Gemma 3's rule: its pixels (one 32x32 square an image, no grids) and
    ``token_type_ids`` (1 at each image token), as ``Gemma3Processor`` makes them."""
    import torch
    from PIL import Image

    from qlora_train.train.collator import ImageCollator

    tok, proc = gemma3
    refs = []
    for k, (w, h) in enumerate(sizes_of(TWO)):
        refs.append(str(tmp_path / f"{k}.png"))
        Image.new("RGB", (w, h), (40 * k % 255, 90, 200)).save(refs[-1])
    m = mask_conversation(TWO, tok)
    batch = ImageCollator(tok.pad_token_id, image_rule(tok))([{"input_ids": m.input_ids, "labels": m.labels,
                                                               "images": refs}])
    ours = processor_out(proc, m.text, sizes_of(TWO))
    assert "image_grid_thw" not in batch and "mm_token_type_ids" not in batch
    assert batch["token_type_ids"][0, :len(m.input_ids)].tolist() == ours["token_type_ids"]
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    pixels = proc.image_processor([Image.open(r) for r in refs], return_tensors="pt")["pixel_values"]
    assert torch.equal(batch["pixel_values"], pixels)


@hsettings(max_examples=50, deadline=None)
@given(image_pairs())
def test_image_pairs_share_the_prompts_image_tokens(gemma3, pair):
    """DPO / ORPO pairs on Gemma 3: each side's ids are the processor's, both sides hold the prompt's image tokens
    (wrapper and markers included) identically in the prompt they share, none trained on either side."""
    from qlora_train.data.pairs import build_preference_example
    from qlora_train.masking import SIDES

    tok, proc = gemma3
    prompt, chosen, rejected = pair
    ex = build_preference_example(prompt, chosen, rejected, tok)
    n = ex["prompt_length"]
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n]
    markers = set(tok.convert_tokens_to_ids(list(MARKERS)))
    soft = tok.convert_tokens_to_ids("<image_soft_token>")
    for side in SIDES:
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        assert not markers & {t for t in labels if t != IGNORE_INDEX}
        assert ids[:n].count(soft) == ids.count(soft) == 4 * len(sizes_of(prompt))
        assert ids == processor_out(proc, tok.decode(ids), sizes_of(prompt))["input_ids"]
