"""Hostile image files, made by hand: headers that claim a size their bytes never hold (what a decompression bomb's
header says, without its megabytes), and the wrappers that make Pillow decode on open (ICO, ICNS). The tests use
them small; benchmarks/bench_hostile_images.py streams real pixels into the same headers."""

from __future__ import annotations

import struct
import zlib

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(width: int, height: int, idat: bytes | None = None, *, color_type: int = 0) -> bytes:
    """A PNG whose IHDR (checksum right) claims ``width`` x ``height`` of 8-bit pixels (grey by default), with
    ``idat`` as its compressed pixels (a few zero bytes by default: its pixels never exist)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    idat = zlib.compress(b"\0\0\0\0") if idat is None else idat
    return PNG_MAGIC + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def ico_bytes(frame: bytes) -> bytes:
    """An ICO of one frame (a PNG's bytes), its directory entry saying 256 x 256: Pillow decodes the frame when the
    file is opened."""
    header = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(frame), 6 + 16)
    return header + entry + frame


def icns_bytes(frame: bytes) -> bytes:
    """An ICNS of one ``ic10`` (1024 x 1024 @2x) entry holding a PNG's bytes."""
    entry = b"ic10" + struct.pack(">I", 8 + len(frame)) + frame
    return b"icns" + struct.pack(">I", 8 + len(entry)) + entry


def tiff_bytes(width: int, height: int, strip: bytes = b"\0" * 16) -> bytes:
    """A little-endian greyscale TIFF of one uncompressed strip (``strip``: its bytes, far fewer than it claims)."""
    tags = [(256, 4, width), (257, 4, height), (258, 3, 8), (259, 3, 1), (262, 3, 1), (273, 4, 0), (277, 3, 1),
            (278, 4, height), (279, 4, len(strip))]
    ifd_at = 8
    data_at = ifd_at + 2 + 12 * len(tags) + 4
    tags = [(t, k, data_at if t == 273 else v) for t, k, v in tags]
    ifd = struct.pack("<H", len(tags)) + b"".join(
        struct.pack("<HHI", t, k, 1) + (struct.pack("<HH", v, 0) if k == 3 else struct.pack("<I", v))
        for t, k, v in tags) + struct.pack("<I", 0)
    return b"II*\0" + struct.pack("<I", ifd_at) + ifd + strip


def psd_bytes(width: int, height: int) -> bytes:
    """A PSD header (3 channels, 8 bits, RGB; 30,000 a side is the format's most), its image data cut short."""
    return (b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, height, width, 8, 3) + struct.pack(">III", 0, 0, 0)
            + struct.pack(">H", 0) + b"\0" * 64)


def eps_bytes(width: int, height: int) -> bytes:
    """An EPS whose bounding box is ``width`` x ``height`` points (its pixels are Ghostscript's to draw)."""
    return (f"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 {width} {height}\n%%EndComments\n"
            "showpage\n%%EOF\n").encode()


BOMB_SIDE = 30_000
# name -> (file name, its bytes as the tests write them: the size claimed, the pixels absent)
BOMBS = {
    "ico": ("bomb.ico", lambda: ico_bytes(png_bytes(BOMB_SIDE, BOMB_SIDE))),
    "icns": ("bomb.icns", lambda: icns_bytes(png_bytes(BOMB_SIDE, BOMB_SIDE))),
    "tiff": ("bomb.tif", lambda: tiff_bytes(BOMB_SIDE, BOMB_SIDE)),
    "psd": ("bomb.psd", lambda: psd_bytes(BOMB_SIDE, BOMB_SIDE)),
    "eps": ("bomb.eps", lambda: eps_bytes(BOMB_SIDE, BOMB_SIDE)),
}
