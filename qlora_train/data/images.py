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
never the run. What is read, and how (docs/trust.md#images): only a regular file (a named pipe or a device is never
opened: ``image_file``), only a format whose size is in a header read before any pixel (``READ_FORMATS``; others
refused by name), with Pillow's own decompression-bomb guard set to ``data.max_image_pixels`` while it is read
(``_header``); an image stands upright as its EXIF orientation says, in its size and in its pixels, and a 16-bit one
is scaled to 8 bits (``open_image``).
"""

from __future__ import annotations

import ast
import base64
import binascii
import contextlib
import io
import os
import re
import stat
import struct
import warnings
import zlib
from typing import Any
from urllib.parse import unquote, urlparse

from qlora_train.config import DEFAULT_MAX_IMAGE_PIXELS, ImageCheck
from qlora_train.masking import DropReason, ImageInfo, RowRejected

REF_KEYS = ("path", "url", "image")  # keys of a mapping that holds a reference (besides an HF Image's "bytes")


class ImageUnreadable(ValueError):
    """Why an image is not read (what the row's ``bad_image`` detail says after the file): not a regular file,
    a format not read, over the pixel limit, 32-bit pixels, corrupt ..."""


_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _open_regular(path: str):
    """A path -> its file, open for reading; ``ImageUnreadable`` for anything but a regular file. Checked before
    the open (a named pipe would block it until a writer comes, forever) and again on what was opened (a path
    swapped meanwhile); opened non-blocking all the same."""
    try:
        kind = _not_regular(os.stat(path).st_mode)
    except FileNotFoundError:
        raise ImageUnreadable("no such file") from None
    except (OSError, ValueError) as exc:  # permissions, a NUL in the path, a name too long
        raise ImageUnreadable(f"cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
                              if isinstance(exc, OSError) else f"not a path ({exc})") from None
    if kind is None:
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            raise ImageUnreadable(f"cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None
        kind = _not_regular(os.fstat(fd).st_mode)
        if kind is None:
            return os.fdopen(fd, "rb")
        os.close(fd)
    raise ImageUnreadable(f"{kind}, not an image file: only regular files are read")


@contextlib.contextmanager
def image_file(ref: str):
    """A reference -> its bytes as a binary file: a ``data:`` URI's decoded payload, or the regular file at the
    path (``ImageUnreadable`` for anything else: a named pipe, a device, a directory, a missing file)."""
    if ref.startswith("data:"):
        _, _, payload = ref.partition(",")
        try:
            data = base64.b64decode(payload)
        except (binascii.Error, ValueError) as exc:
            raise ImageUnreadable(f"a data: URI whose base64 does not decode ({exc})") from None
        yield io.BytesIO(data)
        return
    with _open_regular(ref) as fh:
        yield fh


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


def image_ref(value: Any, base_dir: str | None, where: str, *, root: str | None = None) -> str:
    """What a row holds for an image -> its reference: an absolute path or a ``data:`` URI.

    ``value``: a path (relative ones resolved against ``base_dir``, the data file's directory; the current
    directory when None), a ``file://`` URL, a ``data:image/…;base64,`` URI (kept), a Hugging Face ``Image`` value
    ``{"bytes": …, "path": …}`` (bytes -> a ``data:`` URI; a path alone -> the path), or a mapping with ``url`` /
    ``path``. ``http(s)://`` URLs are refused: images are not downloaded. With ``root`` (``data.image_root``), a
    path whose file (its links followed) lies outside that directory is refused."""
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
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (an undecodable byte of the data file): the ref is stored as UTF-8
        raise _refuse(where, f"an image reference that is not valid text ({shown(value)!a})") from None
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
    ref = os.path.abspath(os.path.join(os.path.expanduser(base_dir or ""), path))  # abspath: against the cwd
    if root is not None and not inside_root(ref, root):
        raise _refuse(where, f"{ref}: outside data.image_root={root} (links followed)")
    return ref


def inside_root(path: str, root: str) -> bool:
    """Whether the file ``path`` names, its symbolic links followed, lies inside the directory ``root`` (its own
    links followed too)."""
    real, top = os.path.realpath(path), os.path.realpath(os.path.expanduser(root))
    return os.path.commonpath([real, top]) == top


# The image formats read: those whose size is in a header read before any pixel is decoded. Others are refused by
# name: ICO and ICNS decode their largest frame while opening, EPS runs Ghostscript, PSD and the rest are not
# training images.
READ_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # (JPEG's reader also opens MPO: a phone's JPEG)
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")  # one 16-bit channel: scaled to 8 bits (v / 257)
WIDE_MODES = {"I": "32-bit integer", "F": "32-bit float"}  # no fixed range to scale from: refused
ORIENTATION = 0x0112  # the EXIF tag
_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
              7: "TRANSVERSE", 8: "ROTATE_90"}  # EXIF orientation -> what stands the image upright (exif_transpose)
_SWAPPED = (5, 6, 7, 8)  # orientations whose upright image has its width and height swapped

# what Pillow raises on a file that is not an image, truncated or corrupt (PNG chunks: SyntaxError)
_READ_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, IndexError)
_PIXELS = re.compile(r"\((\d+) pixels\)")


def _format_named(fh) -> str:
    """Why a file that no reader of ``READ_FORMATS`` opens is not read: the format another Pillow reader knows it
    by (found by its accept test on the first bytes; the file is not opened as one), or not an image at all."""
    from PIL import Image

    fh.seek(0)
    head = fh.read(64)
    Image.init()
    for name, (_, accept) in Image.OPEN.items():
        if name not in READ_FORMATS and accept is not None:
            try:
                if accept(head):
                    return f"an image of format {name}, which is not read (read: {', '.join(READ_FORMATS)})"
            except Exception:  # noqa: BLE001 - a plugin's accept test on hostile bytes: not that format
                continue
    return "not an image Pillow can read"


def _readers() -> list[str]:
    """``READ_FORMATS`` this Pillow has a reader of (WEBP needs libwebp)."""
    from PIL import Image

    Image.init()
    return [name for name in READ_FORMATS if name in Image.OPEN]


@contextlib.contextmanager
def _header(ref: str, max_pixels: int):
    """A reference -> its image as Pillow opens it (the header read, no pixel decoded), with Pillow's own
    decompression-bomb guard set to ``max_pixels`` (an error, not a warning, past it) while it is in use. Every
    problem -> ``ImageUnreadable``."""
    from PIL import Image

    limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, max_pixels
    try:
        with warnings.catch_warnings(), image_file(ref) as fh:
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            try:
                im = Image.open(fh, formats=_readers())
            except Image.UnidentifiedImageError:
                raise ImageUnreadable(_format_named(fh)) from None
            with im:
                yield im
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        found = _PIXELS.search(str(exc))
        raise ImageUnreadable(f"{found[1] if found else 'more'} pixels is over data.max_image_pixels={max_pixels} "
                              "(read from the header, before decoding)") from None
    except ImageUnreadable:
        raise
    except (*_READ_ERRORS, binascii.Error) as exc:  # also decoding in the caller's block (load, verify, convert)
        why = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise ImageUnreadable(f"unreadable or corrupt ({type(exc).__name__}: {why})") from None
    finally:
        Image.MAX_IMAGE_PIXELS = limit


def _orientation(im) -> int:
    """The EXIF orientation of an opened image (1: upright), read without decoding its pixels: from the EXIF
    Pillow read with the header (a PNG's eXIf chunk after its pixels is not looked for)."""
    from PIL import Image

    exif = Image.Image.getexif(im)  # the base class's: PngImageFile.getexif decodes the pixels first
    value = exif.get(ORIENTATION, 1)
    return value if isinstance(value, int) and value in _TRANSPOSE else 1


def _checked_size(im, max_pixels: int) -> tuple[int, int]:
    """An opened image -> its upright ``(width, height)``; ``ImageUnreadable`` when it is empty, over
    ``max_pixels`` or of 32-bit pixels."""
    width, height = im.size
    if width <= 0 or height <= 0:
        raise ImageUnreadable(f"an image of zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageUnreadable(f"{width}x{height} = {width * height} pixels is over data.max_image_pixels={max_pixels}")
    if im.mode in WIDE_MODES:
        raise ImageUnreadable(f"{WIDE_MODES[im.mode]} pixels (mode {im.mode}): their range is not known, so they "
                              "are not scaled to 8 bits; save the image with 8 or 16 bits a channel")
    return (height, width) if _orientation(im) in _SWAPPED else (width, height)


def _upright_rgb(im, orientation: int):
    """A decoded image -> upright (its EXIF orientation applied, as transformers' ``load_image`` does) and in RGB,
    a 16-bit channel scaled to 8 bits (``convert`` alone would clip it to 0 or 255)."""
    import numpy as np
    from PIL import Image

    if im.mode in SIXTEEN_BIT_MODES:
        wide = np.asarray(im).astype(np.uint32)
        im = Image.fromarray(((wide + 128) // 257).astype(np.uint8), "L")
    if orientation != 1:
        im = im.transpose(getattr(Image.Transpose, _TRANSPOSE[orientation]))
    return im.convert("RGB")


def open_image(ref: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, draft: int | None = None):
    """A reference -> its image, decoded, upright and in RGB (what an image processor takes); ``ImageUnreadable``
    (a ``ValueError``) saying why it cannot be read, checked as ``image_info`` checks it before decoding. ``draft``
    (a thumbnail's side): a JPEG decoded at the smallest scale that keeps that many pixels a side."""
    with _header(ref, max_pixels) as im:
        _checked_size(im, max_pixels)
        orientation = _orientation(im)
        if draft is not None:
            im.draft("RGB", (draft, draft))
        im.load()
        return _upright_rgb(im, orientation)


def upright_size(ref: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, verify: bool = False) -> tuple[int, int]:
    """A reference -> its upright ``(width, height)`` (EXIF orientation applied) read from its header, no pixel
    decoded; ``verify``: its structure checked too (``Image.verify``). ``ImageUnreadable`` as ``image_info`` says."""
    with _header(ref, max_pixels) as im:
        size = _checked_size(im, max_pixels)
        if verify:
            im.verify()
    return size


def image_info(ref: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, check: ImageCheck = "decode",
               where: str = "image") -> ImageInfo:
    """A reference -> ``ImageInfo(ref, width, height)`` (its upright size: EXIF orientation applied), the image
    checked; ``bad_image`` naming ``where`` and the file when it is not a regular file (a named pipe, a device:
    never opened), missing, unreadable, not an image, of a format not read (``READ_FORMATS``), of zero size, over
    ``max_pixels`` (read from the header, before any pixel is decoded; Pillow's own guard set to it), of 32-bit
    pixels, or corrupt: ``Image.verify`` (PNG chunk checksums and structure, no decode) always, and with
    ``check="decode"`` its pixels decoded once (a corrupt JPEG is caught), then dropped."""
    try:
        width, height = upright_size(ref, max_pixels=max_pixels, verify=True)
        if check == "decode":
            with _header(ref, max_pixels) as im:  # verify leaves the image unusable: opened again
                im.load()
    except ImageUnreadable as exc:
        raise _refuse(where, f"{shown(ref)}: {exc}") from None
    return ImageInfo(ref=ref, width=int(width), height=int(height))
