"""Images in a conversation: where they sit in the messages, what the template writes for each, and the
processor's expansion of each into its image tokens, made on the render so that the char mask follows it exactly.

A message with images holds ``IMAGE_SLOT`` (U+FFFC, the object replacement character) in its ``content`` where
each image sits, and ``images``: one ``ImageInfo`` per slot, in order (``data.parse`` makes both from a row's
content parts, ``<image>`` placeholders and image columns). The template reads such a message as content parts
(``template_content``: text parts and ``{"type": "image"}`` parts), and writes its own placeholder for each image
(Qwen2.5-VL: ``<|vision_start|><|image_pad|><|vision_end|>``).

The processor then replaces each image token (``<|image_pad|>``) by as many image tokens as the image's size makes
(``ImageRule.tokens``: the image processor's own rule). ``expand_images`` makes that replacement on the render, its
text and its char mask together (every character of an image's tokens untrained), so that tokenizing the expanded
render gives exactly the processor's ids, and every span of the render moves with it.

    >>> rule = ImageRule("<|image_pad|>", 151655, _Fixed(3))
    >>> r = RenderedConversation("<u><|image_pad|>x<a>y", np.array([0] * 20 + [1], np.uint8), (17, 21), ())
    >>> e = expand_images(r, [ImageInfo(ref="a.png", width=28, height=28)], rule)
    >>> e.text, e.message_ends, "".join(c for c, m in zip(e.text, e.char_mask) if m)
    ('<u><|image_pad|><|image_pad|><|image_pad|>x<a>y', (43, 47), 'y')

The rule reaches the pipeline on the tokenizer it renders with (``set_image_rule`` where a vision-language model's
processor is loaded, ``image_rule`` where rows are rendered): the tokenizer is what turns a row into ids, and for
such a model the image processor's rule is part of that.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

from qlora_train.masking.messages import IMAGE_SLOT, DropReason, ImageInfo, RowRejected, message_images
from qlora_train.masking.rendered import ImageRuns, RenderedConversation, TurnSpan


@dataclass(frozen=True)
class ImageRule:
    """The processor's rule for images: what the template writes for an image (``placeholder``) and what the
    processor writes in its place: ``before`` + the image token repeated ``tokens(width, height)`` times +
    ``after``. Qwen-VL: the placeholder is the image token itself, no wrapper, one token a merged patch (the image
    processor's ``get_number_of_image_patches``, ``merge_size``² patches to a token, as the processor's
    ``_get_num_multimodal_tokens`` counts them). Gemma 3: the placeholder ``<start_of_image>`` becomes
    ``\\n\\n<start_of_image>`` + ``fixed_tokens`` x ``<image_soft_token>`` + ``<end_of_image>\\n\\n`` whatever the
    image's size (every image is resized to the tower's square).

    ``type_ids`` names the model input that marks the image tokens (1 at each, 0 elsewhere): Qwen-VL's 3D
    positions read ``mm_token_type_ids``, Gemma 3's bidirectional attention among an image's tokens
    ``token_type_ids``."""

    image_token: str  # "<|image_pad|>": the token the processor repeats, one per image feature
    image_token_id: int
    image_processor: Any  # a transformers image processor (or anything with that method and ``merge_size``)
    other_tokens: tuple[str, ...] = ()  # tokens no render may hold (``<|video_pad|>``: no video is read)
    placeholder: str = ""  # what the template writes for an image ("" -> ``image_token``)
    before: str = ""  # the processor's text before an image's tokens (Gemma 3: "\n\n<start_of_image>")
    after: str = ""  # and after them (Gemma 3: "<end_of_image>\n\n")
    fixed_tokens: int | None = None  # tokens an image of any size (Gemma 3's ``image_seq_length``); None: by size
    type_ids: str = "mm_token_type_ids"  # the model input marking image tokens
    # a structured expansion (``image_layouts``: Pixtral's rows, Idefics3's tiles): several runs of the image token
    # an image, between markers the image's size decides; None: ``before`` + one run + ``after``
    layout: Any = None
    # the family's own count (width, height, images in the row) -> tokens, where neither a patch grid nor a fixed
    # count makes it (LLaVA-OneVision's anyres: ``vision.AnyresCount``); None: the rules above
    counter: Any = None

    @classmethod
    def of(cls, image_processor, tokenizer, image_token: str = "<|image_pad|>",
           other_tokens: tuple[str, ...] = ("<|video_pad|>",)) -> ImageRule:
        """The rule of a Qwen2-VL-style processor: ``image_token`` repeated once per merged patch."""
        return cls(image_token, tokenizer.convert_tokens_to_ids(image_token), image_processor,
                   tuple(t for t in other_tokens if t in tokenizer.get_added_vocab()))

    @classmethod
    def wrapped(cls, image_processor, tokenizer, *, placeholder: str, image_token: str, before: str, after: str,
                tokens: int, type_ids: str, other_tokens: tuple[str, ...] = ()) -> ImageRule:
        """The rule of a processor that writes a fixed count of ``image_token`` between ``before`` and ``after``
        in place of the template's ``placeholder`` (Gemma 3)."""
        return cls(image_token, tokenizer.convert_tokens_to_ids(image_token), image_processor,
                   tuple(t for t in other_tokens if t in tokenizer.get_added_vocab()), placeholder, before, after,
                   int(tokens), type_ids)

    @property
    def written(self) -> str:
        """What the template writes for an image."""
        return self.placeholder or self.image_token

    def tokens(self, width: int, height: int, images: int = 1) -> int:
        """Image tokens of an image of this size in a row of ``images`` images (only a ``counter`` reads it:
        LLaVA-OneVision writes a multi-image row's images unpatched); ``RowRejected`` (``bad_image``) for one the
        processor refuses (an aspect ratio over 200:1). A structured expansion's: every run's together."""
        if self.counter is not None:
            return int(self.counter(width, height, images))
        if self.layout is not None:
            return sum(n for _, n in self.layout.expansion_of(width, height)[1])
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        try:
            patches = self.image_processor.get_number_of_image_patches(height, width, {})
        except ValueError as exc:
            raise RowRejected(DropReason.BAD_IMAGE, f"image {width}x{height}: {exc}") from None
        return int(patches) // int(self.image_processor.merge_size) ** 2

    def expansion(self, n: int) -> str:
        """What the processor writes for an image of ``n`` tokens."""
        return self.before + self.image_token * n + self.after

    def expansion_of(self, width: int, height: int, images: int = 1) -> tuple[str, tuple[tuple[int, int], ...]]:
        """What the processor writes for an image of this size, and where its runs of image tokens sit in that
        text: ``(text, ((first character, tokens), ...))``, in a row of ``images`` images. One run after ``before``
        for the one-run families; a
        structured expansion's (``layout``) runs between its markers (Pixtral: a run a row, ``[IMG_BREAK]``
        between rows, ``[IMG_END]`` last).

        >>> ImageRule("<i>", 7, _Fixed(2), before="[", after="]").expansion_of(28, 28)
        ('[<i><i>]', ((1, 2),))
        """
        if self.layout is not None:
            return self.layout.expansion_of(width, height)
        n = self.tokens(width, height, images)
        return self.expansion(n), ((len(self.before), n),)


class _Fixed:
    """A stand-in image processor: ``n`` tokens per image (doctests)."""

    merge_size = 1

    def __init__(self, n: int):
        self.n = n

    def get_number_of_image_patches(self, height: int, width: int, kwargs: dict) -> int:
        return self.n


def image_rule(tokenizer) -> ImageRule | None:
    """The image rule set on this tokenizer (``set_image_rule``); None for a text-only model."""
    return getattr(tokenizer, "qlora_image_rule", None)


def set_image_rule(tokenizer, rule: ImageRule | None):
    """Carry ``rule`` on ``tokenizer`` (pickled with it into ``datasets`` workers and its fingerprint)."""
    tokenizer.qlora_image_rule = rule
    return tokenizer


def expanded_text(text: str, images: list[ImageInfo], rule: ImageRule) -> str:
    """A render with no mask to carry (a generation prompt) -> its text as the processor expands it: the
    template's image token for each image repeated ``rule.tokens`` times (``bad_image`` where the template did not
    write one per image).

    >>> expanded_text("a<i>b<i>", [ImageInfo(ref="x", width=28, height=28)] * 2, ImageRule("<i>", 7, _Fixed(2)))
    'a<i><i>b<i><i>'
    """
    pieces = text.split(rule.written)
    if len(pieces) != len(images) + 1:
        raise RowRejected(DropReason.BAD_IMAGE, f"the template wrote {len(pieces) - 1} image placeholder(s) "
                          f"{rule.written!r} for {len(images)} image(s)")
    out = [pieces[0]]
    for im, piece in zip(images, pieces[1:]):
        out += [rule.expansion_of(im["width"], im["height"], len(images))[0], piece]
    return "".join(out)


def expand_images(rendered: RenderedConversation, images: list[ImageInfo], rule: ImageRule
                  ) -> RenderedConversation:
    """The render with each image token the template wrote replaced by the image's expansion
    (``rule.expansion_of`` its size: its image tokens and any markers around and between their runs), untrained;
    every position of the render (message ends, turns) moved with the text. The template must have written exactly
    one image token per image, and no other placeholder (``bad_image`` otherwise: an image it does not write, or a
    row whose text holds the placeholder itself)."""
    text, token, written = rendered.text, rule.image_token, rule.written
    for other in rule.other_tokens + ((token,) if written != token else ()):
        if other in text:
            raise RowRejected(DropReason.BAD_IMAGE, f"the render holds {other!r}, a token the processor writes "
                              "(an image's) or of inputs this trainer does not read (video)")
    starts, at = [], text.find(written)
    while at >= 0:
        starts.append(at)
        at = text.find(written, at + len(written))
    if len(starts) != len(images):
        raise RowRejected(DropReason.BAD_IMAGE, f"the template wrote {len(starts)} image placeholder(s) "
                          f"{written!r} for the row's {len(images)} image(s) (an image the template does not "
                          "write, or the placeholder in the row's text)")
    if not images:
        return rendered
    expansions = [rule.expansion_of(im["width"], im["height"], len(images)) for im in images]
    pieces, masks, prev = [], [], 0
    for s, (expansion, _) in zip(starts, expansions):
        if rendered.char_mask[s:s + len(written)].any():
            raise RowRejected(DropReason.BAD_IMAGE, "an image inside a trained turn: a model does not write images")
        pieces += [text[prev:s], expansion]
        masks += [rendered.char_mask[prev:s], np.zeros(len(expansion), np.uint8)]
        prev = s + len(written)
    pieces.append(text[prev:])
    masks.append(rendered.char_mask[prev:])
    grown = [len(expansion) - len(written) for expansion, _ in expansions]
    shift = np.concatenate([[0], np.cumsum(grown)])

    def moved(p: int) -> int:  # a position at or after a placeholder's end moves by the growth before it
        return p + int(shift[bisect.bisect_right(starts, p - len(written))]) if p > starts[0] else p

    turns = tuple(TurnSpan(t.index, moved(t.start), moved(t.end), moved(t.body_start),
                           None if t.reasoning is None else (moved(t.reasoning[0]), moved(t.reasoning[1])),
                           None if t.eot_start is None else moved(t.eot_start), t.reasoning_dropped)
                  for t in rendered.turns)
    runs = ImageRuns(token, rule.image_token_id,  # every run of every image, where its expansion puts it
                     tuple((moved(s) + at, n) for s, (_, image_runs) in zip(starts, expansions)
                           for at, n in image_runs))
    return rendered._replace(text="".join(pieces), char_mask=np.concatenate(masks),
                             message_ends=tuple(moved(e) for e in rendered.message_ends), turns=turns, images=runs,
                             extra_cuts=tuple(moved(c) for c in rendered.extra_cuts))


__all__ = ["IMAGE_SLOT", "ImageInfo", "ImageRule", "expand_images", "expanded_text", "image_rule", "message_images",
           "set_image_rule"]
