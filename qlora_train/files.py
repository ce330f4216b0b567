"""Output files written so that a reader never sees half of one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write to a temporary name beside ``path``, then rename it into place."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data, encoding="utf-8")
    os.replace(tmp, path)


def publish_dir(staging: Path, dest: Path) -> None:
    """Put the fully written directory ``staging`` at ``dest`` (same filesystem), replacing an older one.

    The old directory is renamed aside, the new one renamed into place, then the old one
    removed: ``dest`` is at every moment the old directory or the new one, whole (or, between
    the two renames, absent), never a mix or a half-written one.
    """
    staging, dest = Path(staging), Path(dest)
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
