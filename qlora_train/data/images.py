"""A row's images on disk or inline: references resolved where rows are read, their sizes read without their
pixels, and their pixels read only where the model is fed (``open_image``).

A reference (``masking.ImageInfo.ref``) is an absolute path or a ``data:`` URI (base64). ``image_ref`` makes one
from what a row holds; ``image_info`` reads and checks the image it names:

    >>> image_ref("cats/1.png", "/data/set", "messages[0]")
    '/data/set/cats/1.png'
    >>> image_ref({"url": "http://x.io/a.jpg"}, None, "images[0]")
    Traceback (most recent call last):
    ...
    qlora_train.masking.messages.RowRejected: bad_image: images[0]: remote images are not downloaded: http://x.io/a.jpg\
 (download them and name the local files; relative paths are found under data.image_dir)

Every problem with one image refuses its row (``RowRejected``, ``bad_image``, naming where in the row and the file),
never the run.
"""

from __future__ import annotations

import ast
import base64
import binascii
import contextlib
import io
import os
import struct
import zlib
from typing import Any
from urllib.parse import unquote, urlparse

from qlora_train.config import DEFAULT_MAX_IMAGE_PIXELS, ImageCheck
from qlora_train.masking import DropReason, ImageInfo, RowRejected

REF_KEYS = ("path", "url", "image")  # keys of a mapping that holds a reference (besides an HF Image's "bytes")


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


def shown(ref: str) -> str:
    """A reference as a drop detail names it: a ``data:`` URI cut to its head."""
    return ref if not ref.startswith("data:") or len(ref) <= 48 else ref[:40] + f"… ({len(ref)} chars)"


def _refuse(where: str, why: str) -> RowRejected:
    return RowRejected(DropReason.BAD_IMAGE, f"{where}: {why}")


def _mime(data: bytes, path: str | None) -> str:
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data.startswith(b"\xff\xd8"):
        return "image/jpeg"
    ext = os.path.splitext(path or "")[1].lower().lstrip(".")
    return f"image/{'jpeg' if ext == 'jpg' else ext or 'unknown'}"


def _bytes_value(value: Any, where: str) -> bytes:
    """An HF ``Image`` feature's ``bytes`` as a row holds it: bytes, base64 text, or the ``b'…'`` text JSON made of
    bytes (``handlers.row_json``)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value[:2] in ("b'", 'b"'):
        try:
            out = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out = None
        if isinstance(out, bytes):
            return out
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            pass
    raise _refuse(where, f"'bytes' is neither bytes nor base64 text ({type(value).__name__})")


def image_ref(value: Any, base_dir: str | None, where: str) -> str:
    """What a row holds for an image -> its reference: an absolute path or a ``data:`` URI.

    ``value``: a path (relative ones resolved against ``base_dir``, the data file's directory; the current
    directory when None), a ``file://`` URL, a ``data:image/…;base64,`` URI (kept), a Hugging Face ``Image`` value
    ``{"bytes": …, "path": …}`` (bytes -> a ``data:`` URI; a path alone -> the path), or a mapping with ``url`` /
    ``path``. ``http(s)://`` URLs are refused: images are not downloaded."""
    if isinstance(value, dict):
        if value.get("bytes"):
            data = _bytes_value(value["bytes"], where)
            path = value.get("path") if isinstance(value.get("path"), str) else None
            return f"data:{_mime(data, path)};base64," + base64.b64encode(data).decode("ascii")
        ref = next((value[k] for k in REF_KEYS if value.get(k)), None)
        if ref is None:
            raise _refuse(where, f"an image mapping without {' / '.join(('bytes', *REF_KEYS))} (keys: "
                          f"{sorted(value)[:6]})")
        value = ref
    if not isinstance(value, str):
        raise _refuse(where, f"an image reference of type {type(value).__name__} (a path, a data: URI or "
                      "{\"bytes\", \"path\"} expected)")
    value = value.strip()
    if not value:
        raise _refuse(where, "an empty image reference")
    if value.startswith("data:"):
        head = value[:value.find(",")] if "," in value else value
        if not (head.startswith("data:image/") and head.endswith(";base64")):
            raise _refuse(where, f"a data: URI that is not data:image/…;base64 ({head[:40]})")
        return value
    scheme = urlparse(value).scheme.lower() if "://" in value else ""
    if scheme in ("http", "https"):
        raise _refuse(where, f"remote images are not downloaded: {value} (download them and name the local files; "
                      "relative paths are found under data.image_dir)")
    if scheme == "file":
        url = urlparse(value)
        if url.netloc not in ("", "localhost"):
            raise _refuse(where, f"a file:// URL on another host: {value}")
        value = unquote(url.path)
    elif scheme:
        raise _refuse(where, f"an image URL of scheme {scheme}:// (a local path or a data: URI expected): {value}")
    path = os.path.expanduser(value)
    return os.path.abspath(os.path.join(os.path.expanduser(base_dir or ""), path))  # abspath: against the cwd


@contextlib.contextmanager
def _no_pil_pixel_limit():
    """Pillow's own decompression-bomb limit off while we read (``data.max_image_pixels`` is checked instead, from
    the header, before any pixel is decoded); restored after."""
    from PIL import Image

    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = limit


# what Pillow raises on a file that is missing, not an image, truncated or corrupt (PNG chunks: SyntaxError)
_READ_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError)


def image_info(ref: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, check: ImageCheck = "decode",
               where: str = "image") -> ImageInfo:
    """A reference -> ``ImageInfo(ref, width, height)``, the image checked; ``bad_image`` naming ``where`` and the
    file when it is missing, unreadable, not an image, of zero size, over ``max_pixels`` (read from the header,
    before any pixel is decoded), or corrupt: ``Image.verify`` (PNG chunk checksums and structure, no decode)
    always, and with ``check="decode"`` its pixels decoded once (a corrupt JPEG is caught), then dropped."""
    from PIL import Image

    what = shown(ref)
    with _no_pil_pixel_limit():
        try:
            with Image.open(image_bytes_or_path(ref)) as im:  # lazy: the header only
                width, height = im.size
                if width <= 0 or height <= 0:
                    raise _refuse(where, f"{what}: an image of zero size ({width}x{height})")
                if width * height > max_pixels:
                    raise _refuse(where, f"{what}: {width}x{height} = {width * height} pixels is over "
                                  f"data.max_image_pixels={max_pixels}")
                im.verify()
            if check == "decode":
                with Image.open(image_bytes_or_path(ref)) as im:  # verify leaves the image unusable: opened again
                    im.load()
        except FileNotFoundError:
            raise _refuse(where, f"{what}: no such file") from None
        except Image.UnidentifiedImageError:
            raise _refuse(where, f"{what}: not an image Pillow can read") from None
        except (*_READ_ERRORS, binascii.Error) as exc:
            why = " ".join(str(exc).split())[:160] or type(exc).__name__
            raise _refuse(where, f"{what}: unreadable or corrupt ({type(exc).__name__}: {why})") from None
    return ImageInfo(ref=ref, width=int(width), height=int(height))
