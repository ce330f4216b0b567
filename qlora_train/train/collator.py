"""Batching: pad what the dataset module made; never re-mask or re-tokenize."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from qlora_train.config import DEFAULT_MAX_IMAGE_PIXELS
from qlora_train.errors import DataError
from qlora_train.masking import IGNORE_INDEX, SIDES


def _width(features: list[dict], multiple: int) -> int:
    """The longest ``input_ids`` rounded up to ``multiple`` (0: not rounded)."""
    longest = max(len(f["input_ids"]) for f in features)
    return -(-longest // multiple) * multiple if multiple else longest


def _pad(features: list[dict], key: str, width: int, fill: int) -> torch.Tensor:
    """``features[i][key]`` right-padded with ``fill`` to ``width`` -> ``[batch, width]`` long tensor."""
    out = torch.full((len(features), width), fill, dtype=torch.long)
    for row, f in enumerate(features):
        out[row, :len(f[key])] = torch.as_tensor(f[key])
    return out


@dataclass
class PadCollator:
    """Right-pad ``input_ids`` with the pad id, ``labels`` with -100, ``attention_mask`` with 0.

    >>> PadCollator(0, 4)([{"input_ids": [5, 6], "attention_mask": [1, 1], "labels": [-100, 6]}])["labels"]
    tensor([[-100,    6, -100, -100]])
    """

    pad_token_id: int
    pad_to_multiple_of: int = 8

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = _width(features, self.pad_to_multiple_of)
        ids = _pad(features, "input_ids", width, self.pad_token_id)
        mask = torch.zeros_like(ids)
        for row, f in enumerate(features):
            mask[row, :len(f["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": _pad(features, "labels", width, IGNORE_INDEX)}


@dataclass
class ImageCollator:
    """A vision-language model's batches: ``PadCollator``'s, plus the pixels of the rows' images (``images``: the
    references the rows keep, loaded here with ``data.images.open_image``: upright, RGB), made by the image
    processor of ``rule`` (``masking.ImageRule``) one image at a time (the same patches as one call on all; a batch
    holds one decoded image at a time): ``pixel_values`` (every image's patches, row by row, image by image),
    ``image_grid_thw`` (one ``[t, h, w]`` patch grid per image: the Qwen-VL families) and the rule's ``type_ids``
    input (1 at each image token: Qwen-VL's 3D positions read ``mm_token_type_ids``, Gemma 3's attention
    ``token_type_ids``). A batch of text rows alone (no ``images``) is ``PadCollator``'s exactly.

    Every row is checked against its ids: its image tokens must be the count its images make (``image_tokens``:
    a grid's ``t * h * w // merge_size**2``, or the family's fixed count), else ``DataError`` naming the row and its
    images (an image that changed since the rows were processed: the ids were expanded from the sizes read then).

    >>> ImageCollator(0, None, 4)([{"input_ids": [5, 6], "labels": [-100, 6], "images": []}])["input_ids"]
    tensor([[5, 6, 0, 0]])
    """

    pad_token_id: int
    rule: Any  # masking.ImageRule
    pad_to_multiple_of: int = 8
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # data.max_image_pixels: an image over it now is a DataError

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = PadCollator(self.pad_token_id, self.pad_to_multiple_of)(features)
        refs = [list(f.get("images") or ()) for f in features]
        if not any(refs):
            return batch
        sizes, pixels, grids, each, image_sizes = [], [], [], [], []
        layout = self.rule.layout
        by_row = self.rule.counter is not None  # LLaVA-OneVision: a row's images processed together (batch_num_images)
        for row, row_refs in enumerate(refs):  # one image decoded at a time (by_row: one row's images)
            opened = []
            for ref in row_refs:
                image = _open(ref, row, self.max_pixels)
                sizes.append(image.size)
                if by_row:
                    opened.append(image)
                    continue
                processed = self.rule.image_processor(images=[image], return_tensors="pt",
                                                      **getattr(layout, "pixel_kwargs", {}))
                del image
                each.append(processed)
                pixels.append(processed["pixel_values"])
                if "image_grid_thw" in processed:
                    grids.append(processed["image_grid_thw"])
            if by_row and opened:
                processed = self.rule.image_processor(images=[opened], return_tensors="pt")
                del opened
                pixels.append(processed["pixel_values"])
                image_sizes.append(processed["image_sizes"])
        tokens = image_tokens(self.rule, grids, len(sizes), sizes, [len(r) for r in refs])
        is_image = batch["input_ids"] == self.rule.image_token_id  # (pads are never the image token)
        at = 0
        for row, (held, row_refs) in enumerate(zip(is_image.sum(dim=1).tolist(), refs)):
            made = tokens[at:at + len(row_refs)]
            if held != sum(made):
                sizes = ", ".join(f"{ref} {w}x{h} -> {n} tokens"
                                  for ref, (w, h), n in zip(row_refs, sizes[at:], made))
                raise DataError(f"batch row {row}: its ids hold {held} image tokens {self.rule.image_token!r}, its "
                                f"{len(row_refs)} image(s) make {sum(made)} ({sizes or 'none'}): did an image change "
                                "since the rows were processed (the datasets cache, data.prepared_path)?")
            at += len(row_refs)
        if layout is not None:  # a structured expansion's family batches its images its own way
            batch.update(layout.batch_pixels(each))
        elif by_row:  # [images, crops, C, H, W]: each row's crops padded to the batch's most (the model cuts them)
            most = max(p.shape[1] for p in pixels)
            batch["pixel_values"] = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1]))
                                               for p in pixels])
            batch["image_sizes"] = torch.cat(image_sizes)
            batch["batch_num_images"] = torch.tensor([len(r) for r in refs if r])
        else:
            batch["pixel_values"] = torch.cat(pixels)
        if grids:
            batch["image_grid_thw"] = torch.cat(grids)
        if self.rule.type_ids:
            batch[self.rule.type_ids] = is_image.int()
        return batch


def image_tokens(rule, grids: list, images: int, sizes: list[tuple[int, int]] = (),
                 per_row: list[int] = ()) -> list[int]:
    """Each image's tokens as its pixels make them: the fixed count of a fixed-count family (Gemma 3), a structured
    expansion's by the decoded image's size (``sizes``, upright), a counter's by that size in its row of images
    (``per_row``: each row's images; LLaVA-OneVision), else its grid's merged patches (``t * h * w //
    merge_size**2``, the Qwen-VL families)."""
    if rule.counter is not None:
        counts = [n for n in per_row for _ in range(n)]
        return [rule.tokens(w, h, n) for (w, h), n in zip(sizes, counts)]
    if rule.layout is not None:
        return [rule.tokens(w, h) for w, h in sizes]
    if rule.fixed_tokens is not None:
        return [rule.fixed_tokens] * images
    return (torch.cat(grids).prod(dim=1) // int(rule.image_processor.merge_size) ** 2).tolist()


def _open(ref: str, row: int, max_pixels: int):
    """A row's image, decoded (``data.images.open_image``: upright, RGB); ``DataError`` naming it when it cannot
    be read any more (it was read when the rows were processed)."""
    from qlora_train.data.images import ImageUnreadable, open_image

    try:
        return open_image(ref, max_pixels=max_pixels)
    except ImageUnreadable as exc:
        raise DataError(f"batch row {row}: cannot read its image {ref[:200]}: {exc}") from None


@dataclass
class PackedCollator:
    """Packed examples (``input_ids``, ``labels``, ``position_ids``, ``seq_lens``) -> a batch where
    attention never crosses examples.

    ``attention="mask"`` (eager / SDPA, CPU or CUDA): rows are right-padded
    and ``attention_mask`` is a 4D mask ``[batch, 1, width, width]``: query i
    may see key j when both are in the same segment and j <= i. With
    ``mask_dtype=torch.bool`` (for SDPA) that is True; with a float dtype (for
    eager, which adds the mask to the scores) 0, and the dtype's minimum where
    it may not. transformers hands a 4D mask to the attention unchanged.
    Padding forms its own segment (its labels are -100).

    ``attention="position_ids"`` (flash-attention on CUDA): the whole micro-batch
    is flattened into one row without padding or mask; the restarting
    ``position_ids`` let transformers call the variable-length kernel per segment.

        >>> b = PackedCollator(0, attention="mask")([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7],
        ...                                           "position_ids": [0, 1, 0], "seq_lens": [2, 1]}])
        >>> (b["attention_mask"][0, 0, :3, :3] == 0).int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """

    pad_token_id: int
    pad_to_multiple_of: int = 8
    attention: str = "mask"
    mask_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.attention not in ("mask", "position_ids"):
            raise ValueError(f"attention must be 'mask' or 'position_ids', got {self.attention!r}")

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if self.attention == "position_ids":
            return {key: torch.tensor([sum((list(f[key]) for f in features), [])], dtype=torch.long)
                    for key in ("input_ids", "labels", "position_ids")}
        width = _width(features, self.pad_to_multiple_of)
        n_rows = len(features)
        for f in features:
            n = len(f["input_ids"])
            if sum(f["seq_lens"]) != n or len(f["labels"]) != n or len(f["position_ids"]) != n:
                raise ValueError("packed example: input_ids, labels, position_ids and seq_lens disagree in length")
        ids = _pad(features, "input_ids", width, self.pad_token_id)
        labels = _pad(features, "labels", width, IGNORE_INDEX)
        positions = _pad(features, "position_ids", width, 0)
        segment = torch.full((n_rows, width), -1, dtype=torch.long)  # -1: padding
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            positions[row, n:] = torch.arange(width - n)
            segment[row, :n] = torch.repeat_interleave(torch.arange(len(f["seq_lens"])),
                                                       torch.as_tensor(f["seq_lens"]))
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = (segment[:, :, None] == segment[:, None, :]) & causal
        if self.mask_dtype is torch.bool:  # SDPA reads True as "may attend"
            mask = allowed[:, None]
        else:  # eager adds the mask to the attention scores
            mask = torch.zeros((n_rows, 1, width, width), dtype=self.mask_dtype)
            mask.masked_fill_(~allowed[:, None], torch.finfo(self.mask_dtype).min)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


@dataclass
class PackedImageCollator:
    """Packed rows of a Qwen-VL model (``input_ids``, ``labels``, ``position_ids``, ``seq_lens`` and ``images``: each
    packed example's images, in order) -> ``PackedCollator``'s batch (its block-diagonal 4D mask: attention never
    crosses examples) with ``ImageCollator``'s pixel inputs, and the 3D rotary positions made per packed example:
    ``position_ids`` ``[3, batch, width]``, each example's as the model makes them for it alone (``rope_index``: its
    ``get_rope_index`` on the example's ids and its images' grids; an example without images counts 0, 1, 2, ... on
    all three axes, as the model does for text), so that a packed example is computed exactly as the same example
    unpacked. Padding counts on from 0 (untrained, attending to itself only)."""

    pad_token_id: int
    rule: Any  # masking.ImageRule
    rope_index: Any  # the model's get_rope_index(input_ids, mm_token_type_ids, image_grid_thw) -> (positions, deltas)
    mask_dtype: torch.dtype = torch.float32
    pad_to_multiple_of: int = 8
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = PackedCollator(self.pad_token_id, self.pad_to_multiple_of, mask_dtype=self.mask_dtype)(features)
        pixels = ImageCollator(self.pad_token_id, self.rule, self.pad_to_multiple_of, self.max_pixels)(
            [{"input_ids": f["input_ids"], "labels": f["labels"], "images": list(f.get("images") or ())}
             for f in features])  # the same width: the same padding rule
        width = batch["input_ids"].shape[1]
        positions = torch.arange(width).repeat(3, len(features), 1)
        grids = pixels.get("image_grid_thw", torch.zeros((0, 3), dtype=torch.long))
        tokens = (grids.prod(dim=1) // int(self.rule.image_processor.merge_size) ** 2).tolist()
        is_image = batch["input_ids"] == self.rule.image_token_id
        at = 0  # the next image of the batch (row by row, example by example)
        for row, f in enumerate(features):
            start = 0
            for n in f["seq_lens"]:
                held, first = int(is_image[row, start:start + n].sum()), at
                while held > 0:  # the example's images: those whose tokens it holds (ImageCollator checked the row)
                    held -= tokens[at]
                    at += 1
                if at > first:
                    ids = batch["input_ids"][row:row + 1, start:start + n]
                    made, _ = self.rope_index(input_ids=ids, mm_token_type_ids=is_image[row:row + 1, start:start + n]
                                              .int(), image_grid_thw=grids[first:at])
                    positions[:, row, start:start + n] = made[:, 0]
                else:
                    positions[:, row, start:start + n] = torch.arange(n)
                start += n
        batch["position_ids"] = positions
        batch.update({k: pixels[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in pixels})
        return batch


@dataclass
class PairCollator:
    """Preference pairs (``chosen_input_ids``, ``chosen_labels``, ``rejected_*``, as ``build_preference_example``
    makes them) -> one padded ``[2B, width]`` batch: the B chosen rows first, then the B rejected rows in the same
    order, so that row i and row B + i are one pair. Padding as ``PadCollator``'s (labels with -100).

    With an image ``rule`` (a vision-language model), a pair's ``images`` (its prompt's) go with both its rows:
    ``ImageCollator``'s batch, each side's image tokens checked against them and fed their pixels (chosen rows'
    images first, then rejected rows').

    >>> b = PairCollator(0, 4)([{"chosen_input_ids": [5, 6, 7], "chosen_labels": [-100, 6, 7],
    ...                          "rejected_input_ids": [5, 8], "rejected_labels": [-100, 8]}])
    >>> b["input_ids"].tolist(), b["labels"].tolist()
    ([[5, 6, 7, 0], [5, 8, 0, 0]], [[-100, 6, 7, -100], [-100, 8, -100, -100]])
    """

    pad_token_id: int
    pad_to_multiple_of: int = 8
    rule: Any = None  # masking.ImageRule of a vision-language model
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = [{"input_ids": f[f"{side}_input_ids"], "labels": f[f"{side}_labels"],
                 "images": list(f.get("images") or ())}
                for side in SIDES for f in features]  # every chosen row, then every rejected
        if self.rule is None:
            return PadCollator(self.pad_token_id, self.pad_to_multiple_of)(rows)
        return ImageCollator(self.pad_token_id, self.rule, self.pad_to_multiple_of, self.max_pixels)(rows)


@dataclass
class UnpairedCollator:
    """Unpaired preference rows (KTO: ``input_ids``, ``labels``, ``prompt_length``, ``desirable``, as
    ``build_unpaired_example`` makes them) -> one padded ``[2B, width]`` batch and ``desirable`` ``[B]`` bool: the B
    rows first, then B mismatched rows for the KL estimate, row B + i being row i's prompt with row i - 1's
    completion (row 0's with the last row's), its labels that completion's: TRL's shift of completions within a
    batch (``KTOTrainer``'s ``KL_completion_ids``), made per batch here so that any sampler order works. A
    mismatched row over ``max_length`` is cut on the right. Padding as ``PadCollator``'s.

    With an image ``rule`` (a vision-language model), a row's ``images`` (its prompt's) go with both its rows (row i
    and row B + i hold the same prompt): ``ImageCollator``'s batch, each row's image tokens checked against them, the
    second half's pixels the first half's again, in the same order (``preference.rows_of`` splits them so).

    >>> b = UnpairedCollator(0, pad_to_multiple_of=4)([
    ...     {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "prompt_length": 1, "desirable": 1},
    ...     {"input_ids": [8, 9, 4], "labels": [-100, -100, 4], "prompt_length": 2, "desirable": 0}])
    >>> b["input_ids"].tolist(), b["labels"][2:].tolist(), b["desirable"].tolist()
    ([[5, 6, 7, 0], [8, 9, 4, 0], [5, 4, 0, 0], [8, 9, 6, 7]], [[-100, 4, -100, -100], [-100, -100, 6, 7]], \
[True, False])
    """

    pad_token_id: int
    max_length: int | None = None
    pad_to_multiple_of: int = 8
    rule: Any = None  # masking.ImageRule of a vision-language model
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = [{"input_ids": f["input_ids"], "labels": f["labels"]} for f in features]
        for i, f in enumerate(features):
            other = features[i - 1]
            p, q = f["prompt_length"], other["prompt_length"]
            ids = list(f["input_ids"][:p]) + list(other["input_ids"][q:])
            labels = [IGNORE_INDEX] * p + list(other["labels"][q:])
            if self.max_length is not None:
                ids, labels = ids[:self.max_length], labels[:self.max_length]
            rows.append({"input_ids": ids, "labels": labels})
        if self.rule is not None:  # the prompt's images, with both of its rows
            images = [list(f.get("images") or ()) for f in features]
            for row, refs in zip(rows, images + images):
                row["images"] = refs
            batch = ImageCollator(self.pad_token_id, self.rule, self.pad_to_multiple_of, self.max_pixels)(rows)
        else:
            batch = PadCollator(self.pad_token_id, self.pad_to_multiple_of)(rows)
        batch["desirable"] = torch.tensor([bool(f["desirable"]) for f in features])
        return batch
