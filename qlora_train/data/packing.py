"""After the dataset is assembled (optional): pack whole examples into sequences of at most ``capacity`` tokens.

    >>> best_fit_decreasing([5, 3, 4, 2], capacity=8)
    [[Piece(index=0, start=0, stop=5), Piece(index=1, start=0, stop=3)],
     [Piece(index=2, start=0, stop=4), Piece(index=3, start=0, stop=2)]]
    >>> pack_examples([{"input_ids": [1, 2], "labels": [-100, 2]},
    ...                {"input_ids": [3, 4, 5], "labels": [3, 4, 5]}])
    {'input_ids': [1, 2, 3, 4, 5], 'labels': [-100, 2, -100, 4, 5],
     'position_ids': [0, 1, 0, 1, 2], 'seq_lens': [2, 3]}

Packing never makes labels: it concatenates what ``tokenize.make_labels``
made and sets ONE label per packed segment, the first, to ``IGNORE_INDEX``.
That token would otherwise be predicted from the previous example's last
token, across the boundary. Attention across segments is prevented later, by
the packing collator (a block-diagonal mask, or position ids that restart at 0
for flash-attention's variable-length kernels).

Best-fit-decreasing: examples are placed longest first, each into the open
bin whose free space is the smallest that still fits it (a new bin when none
fits). An example longer than ``capacity`` is an error unless ``split_long``:
then it is cut into ``capacity``-token pieces, each packed like an example.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from qlora_train.masking import IGNORE_INDEX


class Piece(NamedTuple):
    """Tokens ``[start, stop)`` of example ``index``: a whole example unless it was split."""

    index: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def split_pieces(lengths: list[int], capacity: int, *, split_long: bool = False) -> list[Piece]:
    """Example lengths -> pieces of at most ``capacity`` tokens (one per example unless ``split_long``).

    Empty examples produce no piece. Raises ``ValueError`` for an example over
    ``capacity`` without ``split_long``.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    pieces = []
    for i, n in enumerate(lengths):
        if n > capacity and not split_long:
            raise ValueError(f"example {i} has {n} tokens, more than the packing capacity {capacity} "
                             "(set split_long to cut it into pieces, or raise the capacity)")
        pieces += [Piece(i, a, min(a + capacity, n)) for a in range(0, n, capacity)]
    return pieces


def best_fit_decreasing(lengths: list[int], capacity: int, *, split_long: bool = False) -> list[list[Piece]]:
    """Example lengths -> bins (lists of pieces) with at most ``capacity`` tokens each.

    Every token of every example is in exactly one bin; deterministic (ties
    keep input order). Cost O(n log n) plus O(capacity) list moves per placement.
    """
    pieces = split_pieces(lengths, capacity, split_long=split_long)
    pieces.sort(key=lambda p: (-p.length, p.index, p.start))
    bins: list[list[Piece]] = []
    by_free: dict[int, deque[int]] = {}  # free space -> open bins with exactly that much free
    free_sizes: list[int] = []  # sorted keys of by_free
    for piece in pieces:
        k = bisect_left(free_sizes, piece.length)
        if k < len(free_sizes):  # the tightest open bin that fits
            free = free_sizes[k]
            b = by_free[free].popleft()  # ties: the oldest bin
            if not by_free[free]:
                del by_free[free], free_sizes[k]
        else:
            free, b = capacity, len(bins)
            bins.append([])
        bins[b].append(piece)
        free -= piece.length
        if free > 0:
            if free not in by_free:
                by_free[free] = deque()
                insort(free_sizes, free)
            by_free[free].append(b)
    return bins


def pack_examples(examples: list[dict], pieces: list[Piece] | None = None) -> dict[str, list[int]]:
    """Examples (``input_ids``, ``labels``) -> one packed example.

    ``pieces`` (default: each example whole, in order) says which tokens of
    which example go in, in order. Returns ``input_ids`` and ``labels``
    concatenated, ``position_ids`` restarting at 0 per piece, ``seq_lens``.
    """
    if pieces is None:
        pieces = [Piece(i, 0, len(ex["input_ids"])) for i, ex in enumerate(examples)]
    with_images = any("images" in ex for ex in examples)
    images: list[str] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    seq_lens: list[int] = []
    for p in pieces:
        ex = examples[p.index]
        if len(ex["input_ids"]) != len(ex["labels"]):
            raise ValueError(f"example {p.index}: input_ids and labels differ in length")
        if with_images and ex.get("images"):
            if (p.start, p.stop) != (0, len(ex["input_ids"])):
                raise ValueError(f"example {p.index} holds images, whose tokens are never cut: it is not split "
                                 "(train.split_long)")
            images += ex["images"]
        seg_labels = list(ex["labels"][p.start:p.stop])
        seg_labels[0] = IGNORE_INDEX  # the boundary: predicted from the previous segment's last token
        ids += ex["input_ids"][p.start:p.stop]
        labels += seg_labels
        positions += range(p.length)
        seq_lens.append(p.length)
    out = {"input_ids": ids, "labels": labels, "position_ids": positions, "seq_lens": seq_lens}
    return {**out, "images": images} if with_images else out


@dataclass(frozen=True)
class PackingStats:
    """What packing did to a dataset."""

    examples: int
    sequences: int
    tokens: int
    capacity: int

    @classmethod
    def of(cls, lengths: list[int], bins: list[list[Piece]], capacity: int) -> PackingStats:
        """The examples' ``lengths`` packed into ``bins`` of ``capacity`` tokens."""
        return cls(len(lengths), len(bins), sum(lengths), capacity)

    @property
    def efficiency(self) -> float:
        """Real tokens / tokens processed with one ``capacity``-token sequence per bin (a lower bound:
        the collator pads a batch only to its longest sequence)."""
        return self.tokens / (self.sequences * self.capacity) if self.sequences else 1.0

    def line(self) -> str:
        return (f"packing {self.examples} examples into {self.sequences} sequences of <= {self.capacity} tokens: "
                f"{self.efficiency:.1%} real tokens")


def padded_efficiency(lengths: list[int], batch_size: int) -> float:
    """Real tokens / tokens processed when batches of ``batch_size`` (in order) are padded to their longest."""
    processed = sum(max(lengths[s:s + batch_size]) * len(lengths[s:s + batch_size])
                    for s in range(0, len(lengths), batch_size))
    return sum(lengths) / processed if processed else 1.0


# --- datasets glue: the same functions applied to a processed dataset, streamed through Arrow ---


def example_lengths(ds) -> list[int]:
    """``len(input_ids)`` of every row, read from Arrow in chunks (no row is materialised in Python)."""
    import pyarrow.compute as pc

    lengths: list[int] = []
    for chunk in ds.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=8192):
        lengths += pc.list_value_length(chunk["input_ids"]).to_pylist()
    return lengths


def _has_images(ds) -> bool:
    """Whether any row of ``ds`` holds an image (its ``images`` column read from Arrow in chunks)."""
    import pyarrow.compute as pc

    return any(pc.sum(pc.list_value_length(chunk["images"])).as_py()
               for chunk in ds.select_columns(["images"]).with_format("arrow").iter(batch_size=8192))


def _pack_bins(batch: dict, source) -> dict:
    """datasets.map function over bins: piece columns -> packed examples (rows fetched by one Arrow take)."""
    wanted = sorted({i for bin_ in batch["index"] for i in bin_})
    rows = source[wanted]
    local = {i: k for k, i in enumerate(wanted)}
    examples = [{"input_ids": ids, "labels": lab} for ids, lab in zip(rows["input_ids"], rows["labels"])]
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": [], "seq_lens": []}
    if "images" in rows:  # a vision-language model's rows: each packed example's images, in order
        for ex, refs in zip(examples, rows["images"]):
            ex["images"] = refs
        out["images"] = []
    for idx, starts, stops in zip(batch["index"], batch["start"], batch["stop"]):
        packed = pack_examples(examples, [Piece(local[i], a, b) for i, a, b in zip(idx, starts, stops)])
        for key in out:
            out[key].append(packed[key])
    return out


def pack_dataset(ds, capacity: int, *, split_long: bool = False, batch_size: int = 64):
    """Processed dataset (``input_ids``, ``labels``) -> (packed dataset, ``PackingStats``).

    Bins are planned on the lengths alone; the packed rows are then written by
    a batched ``datasets.map`` over the bins (cached by the source's
    fingerprint, the capacity and ``split_long``). Columns: ``input_ids``,
    ``labels``, ``position_ids``, ``seq_lens``, and ``images`` where the rows hold
    images (each packed row's, in order: an example with images is never split).
    """
    import datasets

    lengths = example_lengths(ds)
    bins = best_fit_decreasing(lengths, capacity, split_long=split_long)
    plan = datasets.Dataset.from_dict({
        "index": [[p.index for p in b] for b in bins],
        "start": [[p.start for p in b] for b in bins],
        "stop": [[p.stop for p in b] for b in bins],
    })
    images = "images" in ds.column_names and _has_images(ds)
    source = ds.select_columns(["input_ids", "labels", *(["images"] if images else [])])
    fingerprint = datasets.fingerprint.Hasher.hash((ds._fingerprint, capacity, split_long, "pack-v1",
                                                    *(["images"] if images else [])))
    packed = plan.map(_pack_bins, batched=True, batch_size=batch_size, fn_kwargs={"source": source},
                      remove_columns=plan.column_names, new_fingerprint=fingerprint, desc="packing")
    return packed, PackingStats.of(lengths, bins, capacity)
