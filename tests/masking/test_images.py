"""Images through the mask engine: the render's image placeholders expanded as the processor expands them. Checked
against the real processor of each family (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``, with
the tiny models' PIL image processors and the real Qwen vocabulary): on rows with 0-4 images of random sizes in user
turns (also the turn right before an answer, and turns of earlier exchanges), the ids equal the processor's own for
the render and the images, no image token is trained, and the trained tokens are exactly those of the same messages
without their images.
"""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from qlora_train.masking import (
    IGNORE_INDEX,
    IMAGE_SLOT,
    DropReason,
    ImageRule,
    LossPolicy,
    RowRejected,
    check_with_rule,
    image_rule,
    mask_conversation,
    render_example,
)
from qlora_train.masking.images import expand_images

PAD = "<|image_pad|>"


@pytest.fixture(scope="module")
def vision(vl_tok):
    """(tokenizer with the image rule, the processor): the real Qwen vocabulary, the qwen2.5-vl template."""
    from transformers import Qwen2_5_VLProcessor

    # its video processor needs torchvision, which this machine lacks: the class check is skipped (images only)
    mp = pytest.MonkeyPatch()
    mp.setattr(Qwen2_5_VLProcessor, "check_argument_for_proper_class", lambda self, name, arg: None)
    proc = Qwen2_5_VLProcessor(image_processor=image_rule(vl_tok).image_processor, tokenizer=vl_tok)
    mp.undo()
    return vl_tok, proc


def image(w: int, h: int, ref: str = "") -> dict:
    return {"ref": ref or f"/img/{w}x{h}.png", "width": w, "height": h}


def processor_ids(proc, text: str, sizes: list[tuple[int, int]]) -> list[int]:
    """The processor's own ids for the template's render (each image placeholder once) and images of ``sizes``."""
    from PIL import Image

    plain = re.sub(f"(?:{re.escape(PAD)})+", PAD, text)
    images = [Image.new("RGB", s, (40 * k % 255, 90, 200)) for k, s in enumerate(sizes)] or None
    return proc(text=[plain], images=images)["input_ids"][0]


def without_images(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "images"} | {"content": m["content"].replace(IMAGE_SLOT, "")}
            for m in messages]


def trained(m) -> list[int]:
    return [t for t in m.labels if t != IGNORE_INDEX]


def test_two_images_exact(vision):
    tok, proc = vision
    msgs = [{"role": "user", "content": f"{IMAGE_SLOT}What is this? {IMAGE_SLOT}",
             "images": [image(100, 60), image(300, 500)]},
            {"role": "assistant", "content": "A red box."}]
    m = mask_conversation(msgs, tok)
    # 100x60 -> 112x56 (the 28-multiple nearest) -> 8 merged tokens; 300x500 over max_pixels -> 168x280 -> 60
    assert m.input_ids.count(tok.convert_tokens_to_ids(PAD)) == 8 + 60
    assert m.input_ids == processor_ids(proc, m.text, [(100, 60), (300, 500)])
    assert tok.decode(trained(m)) == "A red box.<|im_end|>"


def test_each_familys_template_and_token_squares(family_vision):
    """Qwen3-VL: no default system prompt, one token a 32x32 square (16-pixel patches merged 2x2); Qwen2-VL and
    Qwen2.5-VL: the default system prompt, 28x28 squares."""
    tok, proc = family_vision
    msgs = [{"role": "user", "content": f"{IMAGE_SLOT}What is this? {IMAGE_SLOT}",
             "images": [image(100, 60), image(300, 500)]},
            {"role": "assistant", "content": "A red box."}]
    m = mask_conversation(msgs, tok)
    qwen3 = type(proc).__name__ == "Qwen3VLProcessor"
    # Qwen3-VL: 100x60 -> 96x64 -> 3x2 tokens; 300x500 over max_pixels (64 tokens) -> 192x320 -> 6x10
    assert m.input_ids.count(tok.convert_tokens_to_ids(PAD)) == (6 + 60 if qwen3 else 8 + 60)
    assert m.text.startswith("<|im_start|>user\n" if qwen3 else "<|im_start|>system\nYou are a helpful assistant.")
    assert m.input_ids == processor_ids(proc, m.text, [(100, 60), (300, 500)])
    assert tok.decode(trained(m)) == "A red box.<|im_end|>"


@st.composite
def vision_rows(draw):
    """1-3 exchanges; each user turn with 0-2 images at random places among its words (0-4 in all)."""
    exchanges, msgs, left = draw(st.integers(1, 3)), [], 4
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.sampled_from(["Be brief.", "You see images."]))})
    words = st.sampled_from(["what", "is", "this", "a", "shape", "colour", "?", "here", "left", "and", "right"])
    for _ in range(exchanges):
        n = draw(st.integers(0, min(2, left)))
        left -= n
        pieces = draw(st.lists(words, min_size=1, max_size=6))
        for _ in range(n):
            pieces.insert(draw(st.integers(0, len(pieces))), IMAGE_SLOT)
        sizes = [(draw(st.integers(8, 700)), draw(st.integers(8, 700))) for _ in range(n)]
        user = {"role": "user", "content": " ".join(pieces)}
        if n:
            user["images"] = [image(w, h, f"/img/{len(msgs)}-{k}.png") for k, (w, h) in enumerate(sizes)]
        msgs += [user, {"role": "assistant", "content": " ".join(draw(st.lists(words, min_size=1, max_size=5)))}]
    return msgs


@hsettings(max_examples=200, deadline=None)
@given(vision_rows())
@example([{"role": "user", "content": f"{IMAGE_SLOT}", "images": [image(8, 700)]},  # an edge of the sizes: 8 px wide
          {"role": "assistant", "content": "thin"}])
@example([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])  # no image at all
def test_rows_with_images_match_the_processor(family_vision, msgs):
    tok, proc = family_vision
    images = [im for m in msgs for im in m.get("images", ())]
    m = mask_conversation(msgs, tok)
    assert m.input_ids == processor_ids(proc, m.text, [(im["width"], im["height"]) for im in images])
    pad = tok.convert_tokens_to_ids(PAD)
    markup = {pad, *tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])}
    assert not markup & set(trained(m))  # no image token trained
    rule = image_rule(tok)
    assert m.input_ids.count(pad) == sum(rule.tokens(im["width"], im["height"]) for im in images)
    text_only = mask_conversation(without_images(msgs), tok)
    assert trained(m) == trained(text_only)  # the trained tokens: exactly those of the text row


@hsettings(max_examples=30, deadline=None)
@given(vision_rows())
def test_image_runs_tokenized_once_equal_the_whole_text(family_vision, msgs):
    """``encode_rendered`` tokenizes each image's run as one token and repeats it: the ids and every offset equal
    the tokenization of the whole expanded text."""
    from qlora_train.masking.tokenize import _offset_pairs, encode_batch, encode_rendered

    tok, _ = family_vision
    r = render_example(LossPolicy().mark(msgs), tok).rendered
    (fast_ids, fast_offsets), = encode_rendered([r], tok)
    (ids, offsets), = encode_batch([r.text], tok, cuts=[r.cuts])
    assert fast_ids == ids
    assert _offset_pairs(fast_offsets).tolist() == _offset_pairs(offsets).tolist()


def test_all_turns_trained_and_rule_check_agree(vision):
    tok, _ = vision
    msgs = [{"role": "user", "content": f"one {IMAGE_SLOT}", "images": [image(64, 64)]},
            {"role": "assistant", "content": "first"},
            {"role": "user", "content": f"{IMAGE_SLOT} two {IMAGE_SLOT}", "images": [image(30, 90), image(500, 40)]},
            {"role": "assistant", "content": "second"}]
    policy = LossPolicy(last_turn_only=False)
    marked = policy.mark(msgs)
    ex = render_example(marked, tok, policy=policy)
    assert check_with_rule(marked, ex.rendered, tok, policy=policy).outcome == "agree"
    m = mask_conversation(msgs, tok, policy=policy)
    assert tok.decode(trained(m)) == "first<|im_end|>second<|im_end|>"


@pytest.mark.parametrize(("msgs", "why"), [
    ([{"role": "user", "content": "hi"},  # a model does not write images
      {"role": "assistant", "content": f"look {IMAGE_SLOT}", "images": [image(50, 50)]}], "in a trained turn"),
    ([{"role": "user", "content": f"{PAD} {IMAGE_SLOT}", "images": [image(50, 50)]},  # the placeholder as text
      {"role": "assistant", "content": "x"}], "2 image placeholder(s)"),
    ([{"role": "user", "content": "<|video_pad|>"}, {"role": "assistant", "content": "x"}], "video"),
    ([{"role": "user", "content": f"{IMAGE_SLOT}", "images": [image(20, 20 * 201)]},  # over 200:1
      {"role": "assistant", "content": "x"}], "aspect ratio"),
])
def test_refused_with_bad_image(vision, msgs, why):
    tok, _ = vision
    with pytest.raises(RowRejected) as exc:
        mask_conversation(msgs, tok)
    assert exc.value.reason == DropReason.BAD_IMAGE and why in exc.value.detail


def test_images_on_a_text_model_refused(qwen3_tok):
    msgs = [{"role": "user", "content": f"{IMAGE_SLOT}?", "images": [image(50, 50)]},
            {"role": "assistant", "content": "x"}]
    with pytest.raises(RowRejected) as exc:
        mask_conversation(msgs, qwen3_tok)
    assert exc.value.reason == DropReason.BAD_IMAGE and "not a vision-language model" in exc.value.detail


def test_expansion_moves_every_position():
    """Random placeholder layouts: every message end and turn boundary (never inside a placeholder) lands on the
    same text after expansion."""
    rng = random.Random(0)
    import numpy as np

    from qlora_train.masking.images import _Fixed
    from qlora_train.masking.rendered import RenderedConversation, TurnSpan

    for _ in range(200):
        n_img, n = rng.randint(0, 4), rng.randint(1, 9)
        chunks = [rng.choice(["ab", "c", "", "d\n"]) for _ in range(n_img + 1)]
        text = PAD.join(chunks) + "<a>answer<e>"
        mask = np.zeros(len(text), np.uint8)
        start = text.index("answer")
        mask[start:len(text)] = 1
        inside = {s + j for s in (m.start() for m in re.finditer(re.escape(PAD), text)) for j in range(1, len(PAD))}
        ends = tuple(sorted(rng.sample([p for p in range(len(text) + 1) if p not in inside], 3)))
        turn = TurnSpan(1, start, len(text), start, None, text.index("<e>"))
        r = RenderedConversation(text, mask, ends, (turn,))
        e = expand_images(r, [image(1, 1)] * n_img, ImageRule(PAD, 0, _Fixed(n)))
        assert e.text == PAD.join(c for c in chunks).replace(PAD, PAD * n) + "<a>answer<e>"
        for old, new in zip(r.message_ends, e.message_ends):
            assert e.text[new:] == r.text[old:].replace(PAD, PAD * n)
        assert e.text[e.turns[0].start:e.turns[0].end] == "answer<e>"
        assert "".join(c for c, k in zip(e.text, e.char_mask) if k) == "answer<e>"
