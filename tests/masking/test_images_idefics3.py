"""Idefics3's images through the mask engine, checked against ``Idefics3Processor`` (the tiny model's PIL image
processor, the real Llama 3 vocabulary, Idefics3-8B-Llama3's base, with Idefics3's tokens added): the template
writes ``<image>`` for an image; the processor resizes it to a 64-pixel longest edge, brings it up to whole 32-pixel
tiles and, where that is more than one, writes per tile ``<fake_token_around_image><row_R_col_C>`` + 4 x
``<image>``, ``\\n`` after each tile row, then ``\\n<fake_token_around_image><global-img>`` + 4 x ``<image>`` +
``<fake_token_around_image>`` (the global image alone for an image of one tile). On rows with 0-4 images of random
sizes (``test_images.vision_rows``) the ids equal the processor's, every tile's run and marker sits where the
processor puts it, none is trained, and the trained tokens are exactly those of the same rows without images.

SmolVLM writes the same text, but its processor needs ``num2words``, which is not installed here.
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

FAKE, GLOBAL, IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"
ROW_COL = re.compile(r"<row_(\d)_col_(\d)>")
EXPANDED = re.compile(r"(?:<fake_token_around_image>(?:<row_\d_col_\d>|<global-img>)(?:<image>)+\n*)+"
                      r"<fake_token_around_image>")


@pytest.fixture(scope="module")
def idefics3(real_vocab_dir):
    """(tokenizer with the tiny Idefics3's image rule, its ``Idefics3Processor``)."""
    from transformers import Idefics3Processor

    from qlora_train.masking import set_image_rule
    from qlora_train.tiny import IDEFICS3_TINY, build_idefics3_tokenizer, tiny_image_processor
    from qlora_train.vision import family_named, layout_rule

    real_vocab_dir("llama3")
    tok = build_idefics3_tokenizer()
    config = {"vision_config": {k: IDEFICS3_TINY[k] for k in ("image_size", "patch_size")},
              "scale_factor": IDEFICS3_TINY["scale_factor"]}
    set_image_rule(tok, layout_rule(family_named("idefics3"), tiny_image_processor("idefics3"), tok, config))
    return tok, Idefics3Processor(image_processor=image_rule(tok).image_processor, tokenizer=tok, image_seq_len=4)


def processor_out(proc, text: str, sizes: list[tuple[int, int]]) -> dict:
    """The processor's own output for the template's render (each image's expansion back to ``<image>``) and
    images of ``sizes`` (the render already holds the bos: no special tokens added)."""
    return processor_output(proc, EXPANDED.sub(IMAGE, text), sizes, return_tensors="pt")


TWO = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": f"{IMAGE_SLOT}What is this? {IMAGE_SLOT}",
        "images": [image(50, 30), image(30, 30)]},
       {"role": "assistant", "content": "A red box."}]


def test_layout_and_ids_exact(idefics3):
    tok, proc = idefics3
    m = mask_conversation(TWO, tok)
    run = IMAGE * 4
    # 50x30 -> 64x38 -> up to whole tiles 64x64: 2x2 tiles and the global image; 30x30 -> 64x64 likewise
    tiles = (f"{FAKE}<row_1_col_1>{run}{FAKE}<row_1_col_2>{run}\n{FAKE}<row_2_col_1>{run}{FAKE}<row_2_col_2>{run}\n"
             f"\n{FAKE}{GLOBAL}{run}{FAKE}")
    assert m.text == (f"<|begin_of_text|>System: Be brief.<end_of_utterance>\nUser:{tiles}What is this? {tiles}"
                      "<end_of_utterance>\nAssistant: A red box.<end_of_utterance>\n")
    assert m.input_ids == processor_out(proc, m.text, sizes_of(TWO))["input_ids"]
    assert tok.decode(trained(m)) == " A red box.<end_of_utterance>"


def test_an_image_of_one_tile_is_its_global_image_alone(idefics3):
    tok, proc = idefics3
    msgs = [{"role": "user", "content": f"{IMAGE_SLOT}Hi", "images": [image(64, 20)]},
            {"role": "assistant", "content": "Wide."}]
    m = mask_conversation(msgs, tok)  # 64x20 -> 64x20 -> 64x32: two tiles in a row
    assert m.text.count("<row_") == 2 and "<row_2_col_1>" not in m.text
    assert m.input_ids == processor_out(proc, m.text, [(64, 20)])["input_ids"]
    layout = image_rule(tok).layout
    assert layout.grid(32, 32) == (2, 2)  # upscaled to 64x64 first
    import dataclasses
    single = dataclasses.replace(layout, splitting=False)
    assert single.expansion_of(500, 20)[0] == f"{FAKE}{GLOBAL}{IMAGE * 4}{FAKE}"


def expected_marks(rule, sizes) -> list[str]:
    """The markers of each image in order, as the rule's grid makes them."""
    out = []
    for w, h in sizes:
        rows, cols = rule.layout.grid(w, h)
        out += [m for r in range(rows) for c in range(cols) for m in (FAKE, f"<row_{r + 1}_col_{c + 1}>")]
        out += [FAKE, GLOBAL, FAKE]
    return out


@hsettings(max_examples=200, deadline=None)
@given(vision_rows())
@example([{"role": "user", "content": f"{IMAGE_SLOT}", "images": [image(8, 700)]},  # one tile wide, 2 tall
          {"role": "assistant", "content": "thin"}])
@example([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # no image at all
def test_rows_with_images_match_the_processor(idefics3, msgs):
    tok, proc = idefics3
    m = mask_conversation(msgs, tok)
    sizes = sizes_of(msgs)
    out = processor_out(proc, m.text, sizes)
    assert m.input_ids == out["input_ids"]
    rule = image_rule(tok)
    marks = set(tok.convert_tokens_to_ids(list(rule.other_tokens)))
    assert [tok.convert_ids_to_tokens(i) for i in m.input_ids if i in marks] == expected_marks(rule, sizes)
    image_id = tok.convert_tokens_to_ids(IMAGE)
    tiles = sum(r * c + 1 for r, c in (rule.layout.grid(w, h) for w, h in sizes))
    assert m.input_ids.count(image_id) == 4 * tiles
    assert not (marks | {image_id}) & set(trained(m))  # no image, tile or global marker trained
    assert trained(m) == trained(mask_conversation(without_images(msgs), tok))  # exactly the text row's


@pytest.mark.parametrize("content, why", [
    (f"<row_1_col_1> {IMAGE_SLOT}", "'<row_1_col_1>'"),  # what only the processor writes
    (f"{IMAGE_SLOT}<global-img>", "'<global-img>'"),
    (f"{IMAGE_SLOT}<fake_token_around_image>", "'<fake_token_around_image>'"),
    (f"<image> {IMAGE_SLOT}", "2 image placeholder(s)"),  # the image token as text
])
def test_refused_with_bad_image(idefics3, content, why):
    tok, _ = idefics3
    msgs = [{"role": "user", "content": content, "images": [image(50, 50)]}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RowRejected) as exc:
        mask_conversation(msgs, tok)
    assert exc.value.reason == DropReason.BAD_IMAGE and why in exc.value.detail


def test_collator_feeds_every_tile_in_the_ids_order(idefics3, tmp_path):
    """``ImageCollator`` with Idefics3's rule: every image's tiles and its global image, in order, one a row of
    ``[tiles, 1, 3, 32, 32]``: the processor's pixels flattened, and its ``pixel_attention_mask``."""
    import torch

    from qlora_train.train.collator import ImageCollator

    tok, proc = idefics3
    refs = []
    for k, picture in enumerate(pictures(sizes_of(TWO))):
        refs.append(str(tmp_path / f"{k}.png"))
        picture.save(refs[-1])
    m = mask_conversation(TWO, tok)
    batch = ImageCollator(tok.pad_token_id, image_rule(tok))([{"input_ids": m.input_ids, "labels": m.labels,
                                                               "images": refs}])
    ours = processor_out(proc, m.text, sizes_of(TWO))
    assert "token_type_ids" not in batch and "mm_token_type_ids" not in batch
    assert batch["pixel_values"].shape == (10, 1, 3, 32, 32)
    assert torch.equal(batch["pixel_values"][:, 0], ours["pixel_values"][0])
    assert torch.equal(batch["pixel_attention_mask"][:, 0], ours["pixel_attention_mask"][0])


@hsettings(max_examples=50, deadline=None)
@given(image_pairs())
def test_image_pairs_share_the_prompts_image_tokens(idefics3, pair):
    """DPO / ORPO pairs on Idefics3: each side's ids are the processor's, both sides hold the prompt's tiles and
    markers identically in the prompt they share, none trained on either side."""
    from qlora_train.data.pairs import build_preference_example
    from qlora_train.masking import SIDES

    tok, proc = idefics3
    prompt, chosen, rejected = pair
    ex = build_preference_example(prompt, chosen, rejected, tok)
    n = ex["prompt_length"]
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n]
    marks = set(tok.convert_tokens_to_ids([IMAGE, *image_rule(tok).other_tokens]))
    for side in SIDES:
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        assert not marks & {t for t in labels if t != IGNORE_INDEX}
        assert [i for i in ids[n:] if i in marks] == []
        assert ids == processor_out(proc, tok.decode(ids), sizes_of(prompt))["input_ids"]


def test_rule_read_from_the_models_config_and_packing_refused(idefics3, tmp_path):
    """``vision.image_rule_for`` on an Idefics3 folder: ``(image_size // patch_size)² / scale_factor²`` image tokens
    a tile (the real model's 364 // 14 = 26, 676 / 4 = 169), the image processor's edges and splitting; packed image
    rows are refused at config time with the reason."""
    from qlora_train.masking.image_layouts import Idefics3Tiles

    tok, _ = idefics3
    real = {"model_type": "idefics3", "vision_config": {"image_size": 364, "patch_size": 14}, "scale_factor": 2}
    rule = rule_of_folder(tmp_path / "m", "idefics3", real, tok)
    assert rule.layout == Idefics3Tiles(169, 64, 32) and rule.type_ids == ""
    assert rule.tokens(50, 30) == 5 * 169  # 2x2 tiles and the global image
    problem = packing_problem(tmp_path / "p", real)
    assert problem.startswith("train.packing: packed image rows are not supported for ") and "(idefics3)" in problem


def test_a_saved_processor_that_disagrees_with_the_model_is_refused(idefics3, tmp_path):
    """A ``processor_config.json`` whose ``image_seq_len`` is not the model config's: refused when the rule is
    made (the processor would write another count of ``<image>`` a tile than the model reads)."""
    from qlora_train.errors import ModelLoadError

    tok, _ = idefics3
    config = {"model_type": "idefics3", "vision_config": {"image_size": 32, "patch_size": 8}, "scale_factor": 2}
    assert rule_of_folder(tmp_path, "idefics3", config, tok, {"image_seq_len": 4}).layout.image_seq_len == 4
    with pytest.raises(ModelLoadError, match="image_seq_len 169 differs from the model config's 4"):
        rule_of_folder(tmp_path, "idefics3", config, tok, {"image_seq_len": 169})
