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


IDEFICS3_MAX_SIDE = 4096  # the image processor's absolute bound on a resized side (its MAX_IMAGE_SIZE)


@dataclass(frozen=True)
class Idefics3Tiles:
    """Idefics3's expansion (``Idefics3Processor``; SmolVLM's is the same text): the image resized so that its
    longest edge is ``longest_edge`` (the image processor's ``size``), then up to whole ``tile``-pixel tiles
    (``max_image_size``); each tile row writes, per tile, ``<fake_token_around_image><row_R_col_C>`` + ``<image>`` x
    ``image_seq_len``, then ``\\n``; then the whole image shrunk to one tile: ``\\n<fake_token_around_image>
    <global-img>`` + ``<image>`` x ``image_seq_len`` + ``<fake_token_around_image>``. An image of one tile (or
    ``splitting`` off) is the global image alone, without the leading ``\\n``.

    >>> text, runs = Idefics3Tiles(1, 64, 32).expansion_of(60, 30)  # 64x32 -> 2 tiles in a row, then the global
    >>> text.replace("<fake_token_around_image>", "F")
    'F<row_1_col_1><image>F<row_1_col_2><image>\\n\\nF<global-img><image>F'
    >>> runs
    ((38, 1), (83, 1), (129, 1))
    """

    image_seq_len: int
    longest_edge: int
    tile: int
    splitting: bool = True
    image_token: str = "<image>"
    fake_token: str = "<fake_token_around_image>"
    global_token: str = "<global-img>"

    @property
    def markers(self) -> tuple[str, ...]:
        """Tokens only the processor writes, besides the image token (a render holding one is refused)."""
        return (self.fake_token, self.global_token, *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))

    @property
    def pixel_kwargs(self) -> dict:
        """The image processor's call as the processor makes it: as saved."""
        return {}

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The image's (width, height) after the image processor's resize: its longest edge to ``longest_edge``
        (the other side floored, then made even), both under 4096 pixels."""
        aspect = width / height
        if width >= height:
            width, height = self.longest_edge, int(self.longest_edge / aspect)
            height += height % 2
        else:
            height, width = self.longest_edge, int(self.longest_edge * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        aspect = width / height
        if width >= height and width > IDEFICS3_MAX_SIDE:
            width, height = IDEFICS3_MAX_SIDE, int(IDEFICS3_MAX_SIDE / aspect)
        elif height > width and height > IDEFICS3_MAX_SIDE:
            height, width = IDEFICS3_MAX_SIDE, int(IDEFICS3_MAX_SIDE * aspect)
        return max(width, 1), max(height, 1)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of tiles of an image of this size, (0, 0) for the global image alone: the resized image
        brought up to whole tiles (``resize_for_vision_encoder``), split where it is more than one."""
        if not self.splitting:
            return 0, 0
        width, height = self.resized(width, height)
        aspect, t = width / height, self.tile
        if width >= height:
            width = math.ceil(width / t) * t
            height = math.ceil(int(width / aspect) / t) * t
        else:
            height = math.ceil(height / t) * t
            width = math.ceil(int(height * aspect) / t) * t
        if height > t or width > t:
            return (height - t) // t + 1, (width - t) // t + 1
        return 0, 0

    def expansion_of(self, width: int, height: int) -> tuple[str, tuple[tuple[int, int], ...]]:
        """The processor's text for the image and its runs of ``<image>`` (one a tile, then the global image's)."""
        rows, cols = self.grid(width, height)
        run = self.image_token * self.image_seq_len
        text, runs = "", []
        for r in range(rows):
            for c in range(cols):
                text += f"{self.fake_token}<row_{r + 1}_col_{c + 1}>"
                runs.append((len(text), self.image_seq_len))
                text += run
            text += "\n"
        text += ("\n" if rows else "") + self.fake_token + self.global_token
        runs.append((len(text), self.image_seq_len))
        return text + run + self.fake_token, tuple(runs)

    @staticmethod
    def batch_pixels(processed: list) -> dict:
        """Every image's tiles (its global image last), in order, as ``[tiles, 1, 3, tile, tile]`` and their
        ``pixel_attention_mask``: the model reads its pixels as ``[batch, images, ...]`` flattened, so one tile a
        "row" keeps the order of the ids' ``<image>`` runs (and halves of a batch split by tiles)."""
        import torch

        out = {"pixel_values": torch.cat([p["pixel_values"][0] for p in processed]).unsqueeze(1)}
        if all("pixel_attention_mask" in p for p in processed):
            out["pixel_attention_mask"] = torch.cat([p["pixel_attention_mask"][0] for p in processed]).unsqueeze(1)
        return out


@dataclass(frozen=True)
class InternVLTiles:
    """InternVL's expansion (``InternVLProcessor`` with its GotOcr2 image processor's ``crop_to_patches``, which the
    processor always asks for): the image cut into the grid of ``tile``-pixel tiles (between ``min_patches`` and
    ``max_patches`` of them) whose aspect ratio is closest to the image's, plus a thumbnail of the whole image where
    that grid is more than one tile; the image written as ``<img>`` + ``<IMG_CONTEXT>`` x ``image_seq_length`` x
    tiles + ``</img>``: one run an image.

    >>> text, runs = InternVLTiles(2, (32, 32), 1, 4).expansion_of(60, 30)  # a 2x1 grid and the thumbnail
    >>> text.replace("<IMG_CONTEXT>", "C"), runs
    ('<img>CCCCCC</img>', ((5, 6),))
    """

    image_seq_length: int
    tile: tuple[int, int]  # (height, width): the image processor's ``size``
    min_patches: int = 1
    max_patches: int = 12
    image_token: str = "<IMG_CONTEXT>"
    start_token: str = "<img>"
    end_token: str = "</img>"
    video_token: str = "<video>"

    @property
    def markers(self) -> tuple[str, ...]:
        """Tokens only the processor writes, besides the image token (a render holding one is refused)."""
        return self.start_token, self.end_token

    @property
    def unread(self) -> tuple[str, ...]:
        """Placeholders of inputs this trainer does not read (a render holding one is refused): the processor would
        expand ``<video>`` into a video's frames."""
        return (self.video_token,)

    @property
    def pixel_kwargs(self) -> dict:
        """The image processor's call as InternVLProcessor makes it (its ``images_kwargs``: ``crop_to_patches``)."""
        return {"crop_to_patches": True, "min_patches": self.min_patches, "max_patches": self.max_patches}

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(columns, rows) of tiles of an image of this size (``get_optimal_tiled_canvas``): of the grids of
        ``min_patches`` to ``max_patches`` tiles, in order of their tile count, the one whose aspect ratio is
        closest to the image's; on a tie the later one where the image's area is over half the grid's."""
        if self.max_patches <= 1:
            return 1, 1
        grids = sorted(((c, r) for c in range(1, self.max_patches + 1) for r in range(1, self.max_patches + 1)
                        if self.min_patches <= c * r <= self.max_patches), key=lambda g: g[0] * g[1])
        aspect, area, (th, tw) = width / height, width * height, self.tile
        best, best_diff = (1, 1), float("inf")
        for c, r in grids:
            diff = abs(aspect - c / r)
            if diff < best_diff:
                best, best_diff = (c, r), diff
            elif diff == best_diff and area > 0.5 * th * tw * c * r:
                best = (c, r)
        return best

    def tiles(self, width: int, height: int) -> int:
        """Tiles the processor makes of an image of this size: the grid's, plus the thumbnail where over one."""
        c, r = self.grid(width, height)
        return 1 if c * r == 1 else c * r + 1

    def expansion_of(self, width: int, height: int) -> tuple[str, tuple[tuple[int, int], ...]]:
        """The processor's text for the image and its one run of ``<IMG_CONTEXT>``."""
        n = self.image_seq_length * self.tiles(width, height)
        return self.start_token + self.image_token * n + self.end_token, ((len(self.start_token), n),)

    @staticmethod
    def batch_pixels(processed: list) -> dict:
        """Every image's tiles (its thumbnail last), in order, as one ``[tiles, 3, tile, tile]`` tensor: the model
        reads the tiles' features in the order of the ids' ``<IMG_CONTEXT>`` tokens."""
        import torch

        return {"pixel_values": torch.cat([p["pixel_values"] for p in processed])}
