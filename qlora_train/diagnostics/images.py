"""Images in ``--debug-samples``: each image's run of image tokens found in a sample's ids and shown as one marker,
``[image 448x448 → 256 tokens]``, never as its hundreds of ``<|image_pad|>`` tokens; a thumbnail of it in the page.

The run is found in the ids (the image rule's token, ``masking.image_rule``, with the template's
``<|vision_start|>`` / ``<|vision_end|>`` around it when they are there), so its token count is what training gets;
the k-th run is the row's k-th image (the processed row's ``images``). The image's size is read from its file's
header (``data.images.image_info`` with ``check="header"``: no pixel is decoded); a reference that cannot be read
now is said so in its marker, with the reason the row would be refused for it.

    >>> ImageRun(3, 9, 5, "/d/cat.png", (448, 448)).marker
    '[image 448x448 → 5 tokens]'
    >>> ImageRun(3, 9, 5, "/d/gone.png", None, "image: /d/gone.png: no such file").marker
    '[image: /d/gone.png: no such file → 5 tokens]'
"""

from __future__ import annotations

import base64
import io
import sys
from dataclasses import dataclass

from qlora_train.config import DataConfig
from qlora_train.data.images import ImageUnreadable, image_info, image_ref, open_image
from qlora_train.masking import RowRejected, image_rule

THUMBNAIL_PX = 96  # the longer side of a thumbnail in the page
RUN_OPEN, RUN_CLOSE = "<|vision_start|>", "<|vision_end|>"  # around a Qwen-VL image's tokens, shown in its marker


@dataclass(frozen=True)
class ImageRun:
    """One image in a sample: its tokens ``[start, end)`` (its open and close markers with them), how many of
    them are the image's tokens, its reference and its size (``None`` when the reference cannot be read, with
    ``problem`` saying why)."""

    start: int
    end: int
    tokens: int
    ref: str = ""  # "" when the row's images do not match its runs (then only the token count is shown)
    size: tuple[int, int] | None = None
    problem: str = ""
    now_tokens: int | None = None  # the tokens its size makes now, where that differs from the ids' (file changed)
    source: str = ""  # where the row has it (``image_sources``): its file, or the column and index of inline bytes

    @property
    def marker(self) -> str:
        now = f"; its file now makes {self.now_tokens}" if self.now_tokens is not None else ""
        if self.size:
            return f"[image {self.size[0]}x{self.size[1]} → {self.tokens} tokens{now}]"
        if self.problem:
            return f"[{self.problem} → {self.tokens} tokens]"
        return f"[image (its reference is not known) → {self.tokens} tokens]"


def image_size(ref: str) -> tuple[tuple[int, int] | None, str]:
    """A reference -> ``((width, height), "")`` from its header (no pixel decoded; no size limit: a debug view
    shows what is there), or ``(None, why)``: the ``bad_image`` detail ``data.images.image_info`` gives."""
    try:
        info = image_info(ref, max_pixels=sys.maxsize, check="header")
    except RowRejected as exc:
        return None, exc.detail
    return (info["width"], info["height"]), ""


def thumbnail_uri(ref: str, max_px: int = THUMBNAIL_PX) -> str | None:
    """A reference -> a ``data:image/png`` URI of its thumbnail (longer side ``max_px``), or None when it cannot be
    read (``data.images.open_image``: a regular file of a format read, at most ``DEFAULT_MAX_IMAGE_PIXELS``).
    Decodes the image: for the few samples a page shows, never for statistics."""
    try:
        thumb = open_image(ref, draft=max_px)  # a JPEG decodes at a reduced scale
    except ImageUnreadable:
        return None
    thumb.thumbnail((max_px, max_px))
    png = io.BytesIO()
    thumb.save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode("ascii")


def _token_id(tokenizer, token: str) -> int | None:
    i = tokenizer.convert_tokens_to_ids(token)
    return i if isinstance(i, int) and i != tokenizer.unk_token_id else None


def image_sources(raw_row: str, refs: list[str], data: DataConfig) -> list[str]:
    """A row's image references -> where the row has each, for the debug page: a file's path; for an image the
    row holds inline (its ``data:`` reference made from bytes) the images column and index it came from
    (``column 'images'[1]``), or ``inline in a message's content`` (an image part holding a ``data:`` URI).

        >>> image_sources('{"images": ["a.png", "data:image/png;base64,iVBO"]}',
        ...               ["/d/a.png", "data:image/png;base64,iVBO"], DataConfig())
        ['/d/a.png', "column 'images'[1]"]
    """
    inline: dict[str, str] | None = None
    out = []
    for ref in refs:
        if not ref.startswith("data:"):
            out.append(ref)
            continue
        if inline is None:
            inline = _inline_column_images(raw_row, data)
        out.append(inline.get(ref, "inline in a message's content"))
    return out


def _inline_column_images(raw_row: str, data: DataConfig) -> dict[str, str]:
    """``data:`` reference -> ``column 'name'[k]`` for the images the row's images column holds inline."""
    from qlora_train.data.batches import read_json
    from qlora_train.data.parse import map_fields, row_image_column

    try:
        row = read_json(raw_row)
    except ValueError:
        return {}
    found = row_image_column(map_fields(row, data.field_mappings), data) if isinstance(row, dict) else None
    if found is None:
        return {}
    column, values = found
    out: dict[str, str] = {}
    for k, value in enumerate(values):
        try:
            ref = image_ref(value, None, f"column '{column}'[{k}]")
        except RowRejected:
            continue
        if ref.startswith("data:"):
            out.setdefault(ref, f"column '{column}'[{k}]")
    return out


def _grouped(spans: list[tuple[int, int, int]], refs: list[str], rule) -> list[tuple[int, int, int]]:
    """A structured expansion's runs (``rule.layout``: Pixtral's rows, Idefics3's tiles) grouped into one span an
    image, by the runs each reference's size makes, where every size reads and they add up to the runs found
    (else the runs as found)."""
    if rule.layout is None or not refs:
        return spans
    counts = []
    for ref in refs:
        size, _ = image_size(ref)
        if size is None:
            return spans
        try:
            counts.append(len(rule.expansion_of(*size)[1]))
        except RowRejected:
            return spans
    if sum(counts) != len(spans):
        return spans
    out, at = [], 0
    for k in counts:
        group = spans[at:at + k]
        out.append((group[0][0], group[-1][1], sum(n for _, _, n in group)))
        at += k
    return out


def image_runs(ids: list[int], refs: list[str], tokenizer, sources: list[str] = ()) -> tuple[ImageRun, ...]:
    """A sample's ids and its row's image references -> its images' runs, in order (``()`` for a text model).

    Each maximal run of the image token is one image (a structured expansion's runs grouped by image, ``_grouped``),
    with the open and close markers right around it; the k-th
    run is ``refs[k]`` (from ``sources[k]``, ``image_sources``) when there are as many runs as references (else no
    reference is named: only the counts)."""
    rule = image_rule(tokenizer)
    if rule is None:
        return ()
    pad, open_id, close_id = rule.image_token_id, _token_id(tokenizer, RUN_OPEN), _token_id(tokenizer, RUN_CLOSE)
    spans = []
    p = 0
    while p < len(ids):
        if ids[p] != pad:
            p += 1
            continue
        q = p
        while q < len(ids) and ids[q] == pad:
            q += 1
        start = p - 1 if p and open_id is not None and ids[p - 1] == open_id else p
        end = q + 1 if q < len(ids) and close_id is not None and ids[q] == close_id else q
        spans.append((start, end, q - p))
        p = end
    spans = _grouped(spans, refs, rule)
    named = refs if len(refs) == len(spans) else [""] * len(spans)
    where = list(sources) if len(sources) == len(named) and refs == named else [""] * len(spans)
    out = []
    for (start, end, n), ref, source in zip(spans, named, where):
        size, problem = image_size(ref) if ref else (None, "")
        now = None
        if size is not None:
            try:
                made = rule.tokens(*size, len(spans))  # (LLaVA-OneVision counts a row of several otherwise)
            except RowRejected:  # the processor refuses its size now: shown as a change
                made = -1
            now = made if made != n else None
        out.append(ImageRun(start, end, n, ref, size, problem, now, source))
    return tuple(out)
