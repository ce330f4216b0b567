"""Output files written so that a reader never sees half of one, and never through a path someone else put there.

A temporary file or staging directory is always created new (``O_CREAT | O_EXCL``, ``mkdir``), never opened
where something already is: a symbolic link planted at its name in the output directory is not followed.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to a new temporary file beside ``path`` (a random hidden name, created
    exclusively), flush it to disk, then rename it over ``path``. On any failure the temporary file is removed and
    ``path`` is left as it was. A symbolic link at ``path`` is replaced, not written through."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp, fd = _new_file(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _new_file(path: Path) -> tuple[Path, int]:
    """A new, empty file beside ``path`` (mode 0o666 less the umask): ``(its path, an fd open for writing)``."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return tmp, os.open(tmp, _NEW_FILE, 0o666)
        except FileExistsError:  # taken (by chance, or planted): draw another name
            continue
    raise FileExistsError(f"no free temporary name beside {path} after 100 tries")


def remove(path: Path) -> None:
    """Remove what is at ``path``, if anything, without following it: a symbolic link or a file is unlinked, a
    directory removed with its contents."""
    path = Path(path)
    if path.is_symlink() or path.exists() and not path.is_dir():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def fresh_dir(path: Path) -> Path:
    """An empty directory made new at ``path``: whatever was there is removed first without following it (a
    symbolic link or a file unlinked, a directory removed with its contents), then ``mkdir`` creates it, failing
    (``FileExistsError``) rather than reusing anything that appears meanwhile. Its parents are made as needed."""
    path = Path(path)
    remove(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    return path


def publish_dir(staging: Path, dest: Path) -> None:
    """Put the fully written directory ``staging`` at ``dest`` (same filesystem), replacing an older one.

    The old directory is renamed aside, the new one renamed into place, then the old one
    removed: ``dest`` is at every moment the old directory or the new one, whole (or, between
    the two renames, absent), never a mix or a half-written one.
    """
    staging, dest = Path(staging), Path(dest)
    old = dest.with_name(f".{dest.name}.old")
    remove(old)
    if dest.exists():
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)
