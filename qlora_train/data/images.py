"""A row's images on disk or inline: references resolved where rows are read, their sizes read without their
pixels, and their pixels read only where the model is fed (``open_image``).

A reference (``masking.ImageInfo.ref``) is an absolute path or a ``data:`` URI (base64).
"""

from __future__ import annotations

import base64
import io


def image_bytes_or_path(ref: str) -> io.BytesIO | str:
    """A reference -> what Pillow opens: the decoded bytes of a ``data:`` URI, else the path."""
    if ref.startswith("data:"):
        _, _, payload = ref.partition(",")
        return io.BytesIO(base64.b64decode(payload))
    return ref


def open_image(ref: str):
    """A reference -> its image, decoded, in RGB (what an image processor takes)."""
    from PIL import Image

    with Image.open(image_bytes_or_path(ref)) as im:
        return im.convert("RGB")
