"""Structured image expansions: processors that write an image as several runs of its image token between marker
tokens that the image's size decides (``ImageRule.layout``), each a pure function of the image's upright size, as
the family's processor computes it (read from its source in transformers, never guessed).

``PixtralRows`` (Mistral 3, Pixtral): the image, shrunk to fit ``longest_edge`` and its sides rounded up to whole
tokens of ``patch`` pixels, becomes a row of ``[IMG]`` per token row, ``[IMG_BREAK]`` after each row but the
last, ``[IMG_END]`` after the last (``PixtralProcessor.replace_image_token``):

    >>> text, runs = PixtralRows(patch=16, longest_edge=64).expansion_of(50, 30)  # 50x30 -> 64x32: 2 rows of 4
    >>> text
    '[IMG][IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG][IMG_END]'
    >>> runs
    ((0, 4), (31, 4))

A layout also says how its family's image processor is called (``pixel_kwargs``) and how the processed images of a
batch become the model's pixel inputs (``batch_pixels``), for ``train.collator.ImageCollator`` and generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qlora_train.masking.messages import DropReason, RowRejected


@dataclass(frozen=True)
class PixtralRows:
    """Pixtral's expansion (``PixtralProcessor``): ``patch`` is the pixels a token's side covers (the tower's
    ``patch_size`` x the model's ``spatial_merge_size``), ``longest_edge`` the image processor's
    ``size["longest_edge"]``."""

    patch: int
    longest_edge: int
    image_token: str = "[IMG]"
    break_token: str = "[IMG_BREAK]"
    end_token: str = "[IMG_END]"

    @property
    def markers(self) -> tuple[str, ...]:
        """Tokens only the processor writes, besides the image token (a render holding one is refused)."""
        return self.break_token, self.end_token

    @property
    def pixel_kwargs(self) -> dict:
        """The image processor's call as the processor makes it: resized to whole tokens (``_process_images``)."""
        return {"patch_size": self.patch}

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of tokens of an image of this size: shrunk (floored) to fit ``longest_edge`` when over
        it, each side rounded up to whole tokens (``get_resize_output_image_size``); ``bad_image`` for one so thin
        that a side has no token (the processor fails on it)."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        rows, cols = (height - 1) // self.patch + 1, (width - 1) // self.patch + 1
        if rows <= 0 or cols <= 0:
            raise RowRejected(DropReason.BAD_IMAGE, f"image {width}x{height}: a side shrinks to no token "
                              f"(longest edge {self.longest_edge}, {self.patch}-pixel tokens)")
        return rows, cols

    def expansion_of(self, width: int, height: int) -> tuple[str, tuple[tuple[int, int], ...]]:
        """The processor's text for the image and its runs of ``[IMG]`` (one a row) in it."""
        rows, cols = self.grid(width, height)
        line = self.image_token * cols
        step = len(line) + len(self.break_token)
        return (self.break_token.join([line] * rows) + self.end_token,
                tuple((r * step, cols) for r in range(rows)))

    @staticmethod
    def batch_pixels(processed: list) -> dict:
        """The images' pixels as one ``[images, 3, H, W]`` tensor, each padded with zeros right and below to the
        largest (as the image processor pads a batch), and ``image_sizes`` (each image's own ``[h, w]``: the tower
        reads only its patches)."""
        import torch

        pixels = [p["pixel_values"] for p in processed]
        h, w = max(x.shape[-2] for x in pixels), max(x.shape[-1] for x in pixels)
        padded = [torch.nn.functional.pad(x, (0, w - x.shape[-1], 0, h - x.shape[-2])) for x in pixels]
        sizes = [torch.as_tensor(p["image_sizes"]).reshape(-1, 2) for p in processed]
        return {"pixel_values": torch.cat(padded), "image_sizes": torch.cat(sizes)}
