"""Mistral 3's images through the mask engine, checked against ``PixtralProcessor`` (the tiny model's PIL image
processor, the real Llama 3 vocabulary with Mistral 3's tokens added: Mistral's Tekken vocabulary is not available
offline): the template writes ``[IMG]`` for an image, the processor writes a row of ``[IMG]`` per token row of the
resized image (a token a 16-pixel square, up to 128 pixels a side), ``[IMG_BREAK]`` after each row but the last,
``[IMG_END]`` last. On rows with 0-4 images of random sizes (``test_images.vision_rows``) the ids equal the
processor's, every row of image tokens and every marker sits where the processor puts it, none is trained, and the
trained tokens are exactly those of the same rows without images.

``PixtralProcessor``'s module imports the torchvision image processor, which this machine lacks: the PIL one (the
same ``get_resize_output_image_size``) stands in for that import; the processor's own expansion code runs as is.
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

MARKERS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
EXPANDED = re.compile(r"(?:\[IMG\]|\[IMG_BREAK\])*\[IMG_END\]")


def pixtral_processor_class():
    """``PixtralProcessor``, importable without torchvision (its module's resize helper from the PIL module)."""
    import importlib
    import sys

    try:
        import torchvision  # noqa: F401
    except ImportError:
        import transformers.models.pixtral.image_processing_pil_pixtral as pil

        sys.modules.setdefault("transformers.models.pixtral.image_processing_pixtral", pil)
    return importlib.import_module("transformers.models.pixtral.processing_pixtral").PixtralProcessor


@pytest.fixture(scope="module")
def mistral3(real_vocab_dir):
    """(tokenizer with the tiny Mistral 3's image rule, its ``PixtralProcessor``)."""
    from qlora_train.masking import set_image_rule
    from qlora_train.tiny import MISTRAL3_TINY, build_mistral3_tokenizer, tiny_image_processor
    from qlora_train.vision import family_named, layout_rule

    real_vocab_dir("llama3")
    tok = build_mistral3_tokenizer()
    config = {"vision_config": {"patch_size": MISTRAL3_TINY["patch_size"]},
              "spatial_merge_size": MISTRAL3_TINY["spatial_merge_size"]}
    set_image_rule(tok, layout_rule(family_named("mistral3"), tiny_image_processor("mistral3"), tok, config))
    proc = pixtral_processor_class()(image_processor=image_rule(tok).image_processor, tokenizer=tok,
                                     patch_size=MISTRAL3_TINY["patch_size"],
                                     spatial_merge_size=MISTRAL3_TINY["spatial_merge_size"])
    return tok, proc


def processor_out(proc, text: str, sizes: list[tuple[int, int]]) -> dict:
    """The processor's own output for the template's render (each image's expansion back to ``[IMG]``) and images
    of ``sizes`` (the render already holds the bos: no special tokens added)."""
    return processor_output(proc, EXPANDED.sub("[IMG]", text), sizes)


TWO = [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": f"{IMAGE_SLOT}What is this? {IMAGE_SLOT}",
        "images": [image(50, 30), image(300, 500)]},
       {"role": "assistant", "content": "A red box."}]


def test_layout_and_ids_exact(mistral3):
    tok, proc = mistral3
    m = mask_conversation(TWO, tok)
    # 50x30 -> 64x32: 2 rows of 4; 300x500 -> shrunk to 76x128 -> 80x128: 8 rows of 5
    first = "[IMG]" * 4 + "[IMG_BREAK]" + "[IMG]" * 4 + "[IMG_END]"
    second = "[IMG_BREAK]".join(["[IMG]" * 5] * 8) + "[IMG_END]"
    assert m.text == (f"<|begin_of_text|>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]{first}What is this? "
                      f"{second}[/INST]A red box.<|end_of_text|>")
    assert m.input_ids == processor_out(proc, m.text, sizes_of(TWO))["input_ids"]
    assert m.input_ids.count(tok.convert_tokens_to_ids("[IMG]")) == 8 + 40
    assert tok.decode(trained(m)) == "A red box.<|end_of_text|>"


def expected_marks(rule, sizes) -> list[str]:
    """The image tokens and markers of each image in order, as the rule's grid (rows x cols) makes them."""
    out = []
    for w, h in sizes:
        rows, cols = rule.layout.grid(w, h)
        for r in range(rows):
            out += ["[IMG]"] * cols + ["[IMG_BREAK]" if r < rows - 1 else "[IMG_END]"]
    return out


@hsettings(max_examples=200, deadline=None)
@given(vision_rows())
@example([{"role": "user", "content": f"{IMAGE_SLOT}", "images": [image(8, 700)]},  # one token wide, 8 rows
          {"role": "assistant", "content": "thin"}])
@example([{"role": "user", "content": f"a {IMAGE_SLOT}", "images": [image(16, 16)]},  # one row: [IMG][IMG_END]
          {"role": "assistant", "content": "dot"}])
@example([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # no image at all
def test_rows_with_images_match_the_processor(mistral3, msgs):
    tok, proc = mistral3
    m = mask_conversation(msgs, tok)
    sizes = sizes_of(msgs)
    assert m.input_ids == processor_out(proc, m.text, sizes)["input_ids"]
    marks = set(tok.convert_tokens_to_ids(list(MARKERS)))
    assert [tok.convert_ids_to_tokens(i) for i in m.input_ids if i in marks] == expected_marks(image_rule(tok), sizes)
    assert not marks & set(trained(m))  # no image token, row break or image end trained
    assert trained(m) == trained(mask_conversation(without_images(msgs), tok))  # exactly the text row's


@pytest.mark.parametrize(("content", "size", "why"), [
    (f"[IMG_BREAK] {IMAGE_SLOT}", (50, 50), "'[IMG_BREAK]'"),  # what only the processor writes
    (f"{IMAGE_SLOT}[IMG_END]", (50, 50), "'[IMG_END]'"),
    (f"[IMG] {IMAGE_SLOT}", (50, 50), "2 image placeholder(s)"),  # the image token as text
    (f"{IMAGE_SLOT}", (1, 300), "no token"),  # shrunk to 0 pixels wide: the processor fails on it
])
def test_refused_with_bad_image(mistral3, content, size, why):
    tok, _ = mistral3
    msgs = [{"role": "user", "content": content, "images": [image(*size)]}, {"role": "assistant", "content": "x"}]
    with pytest.raises(RowRejected) as exc:
        mask_conversation(msgs, tok)
    assert exc.value.reason == DropReason.BAD_IMAGE and why in exc.value.detail


def test_collator_feeds_pixels_and_image_sizes(mistral3, tmp_path):
    """``ImageCollator`` with Mistral 3's rule: each image resized to whole 16-pixel tokens as the processor resizes
    it, padded to the largest (the processor's own batch), and ``image_sizes``; no type ids."""
    import torch

    from qlora_train.train.collator import ImageCollator

    tok, proc = mistral3
    refs = []
    for k, picture in enumerate(pictures(sizes_of(TWO))):
        refs.append(str(tmp_path / f"{k}.png"))
        picture.save(refs[-1])
    m = mask_conversation(TWO, tok)
    batch = ImageCollator(tok.pad_token_id, image_rule(tok))([{"input_ids": m.input_ids, "labels": m.labels,
                                                               "images": refs}])
    ours = processor_out(proc, m.text, sizes_of(TWO))
    assert "token_type_ids" not in batch and "mm_token_type_ids" not in batch
    assert batch["image_sizes"].tolist() == ours["image_sizes"].tolist() == [[32, 64], [128, 80]]
    assert torch.equal(batch["pixel_values"], ours["pixel_values"])


@hsettings(max_examples=50, deadline=None)
@given(image_pairs())
def test_image_pairs_share_the_prompts_image_tokens(mistral3, pair):
    """DPO / ORPO pairs on Mistral 3: each side's ids are the processor's, both sides hold the prompt's image rows
    and markers identically in the prompt they share, none trained on either side."""
    from qlora_train.data.pairs import build_preference_example
    from qlora_train.masking import SIDES

    tok, proc = mistral3
    prompt, chosen, rejected = pair
    ex = build_preference_example(prompt, chosen, rejected, tok)
    n = ex["prompt_length"]
    assert ex["chosen_input_ids"][:n] == ex["rejected_input_ids"][:n]
    marks = set(tok.convert_tokens_to_ids(list(MARKERS)))
    for side in SIDES:
        ids, labels = ex[f"{side}_input_ids"], ex[f"{side}_labels"]
        assert not marks & {t for t in labels if t != IGNORE_INDEX}
        assert [i for i in ids[n:] if i in marks] == []
        assert ids == processor_out(proc, tok.decode(ids), sizes_of(prompt))["input_ids"]


def test_rule_read_from_the_models_config_and_packing_refused(mistral3, tmp_path):
    """``vision.image_rule_for`` on a Mistral 3 folder: a token ``vision_config.patch_size`` x
    ``spatial_merge_size`` pixels a side (the real models' 14 x 2), the image processor's longest edge; packed
    image rows are refused at config time with the reason."""
    from qlora_train.masking.image_layouts import PixtralRows

    tok, _ = mistral3
    real = {"model_type": "mistral3", "vision_config": {"patch_size": 14}, "spatial_merge_size": 2}
    rule = rule_of_folder(tmp_path / "m", "mistral3", real, tok)
    assert rule.layout == PixtralRows(28, 128) and rule.type_ids == "" and rule.other_tokens == MARKERS[1:]
    assert rule.tokens(1000, 500) == 5 * 3  # 128x64 -> 5 columns of 28 pixels, 3 rows
    problem = packing_problem(tmp_path / "p", real)
    assert problem.startswith("train.packing: packed image rows are not supported for ") and "(mistral3)" in problem
    assert "not proved" in problem


def test_debug_samples_show_one_run_an_image(mistral3, tmp_path):
    """``diagnostics.images.image_runs``: an image's rows (runs of ``[IMG]`` between its markers) read as one
    image, named by its reference, its count the rule's for its size."""
    from qlora_train.diagnostics.images import image_runs

    tok, _ = mistral3
    refs = []
    for k, picture in enumerate(pictures(sizes_of(TWO))):
        refs.append(str(tmp_path / f"{k}.png"))
        picture.save(refs[-1])
    m = mask_conversation(TWO, tok)
    runs = image_runs(m.input_ids, refs, tok)
    assert [(r.ref, r.tokens, r.now_tokens) for r in runs] == [(refs[0], 8, None), (refs[1], 40, None)]
    assert tok.decode(m.input_ids[runs[0].start:runs[0].end]).startswith("[IMG]")


def test_a_saved_processor_that_disagrees_with_the_model_is_refused(mistral3, tmp_path):
    from qlora_train.errors import ModelLoadError

    tok, _ = mistral3
    config = {"model_type": "mistral3", "vision_config": {"patch_size": 14}, "spatial_merge_size": 2}
    rule = rule_of_folder(tmp_path, "mistral3", config, tok, {"patch_size": 14, "spatial_merge_size": 2})
    assert rule.layout.patch == 28
    with pytest.raises(ModelLoadError, match="patch_size x spatial_merge_size 14 differs from the model config's 28"):
        rule_of_folder(tmp_path, "mistral3", config, tok, {"patch_size": 14})  # its default merge: 1
