"""Whose folder ``train.output_dir`` is, and which run is writing into it now.

A run writes only into a folder that is missing, empty, or one our runs wrote: ``.qlora-train`` (``MARKER_FILE``,
written when a run first claims the folder) is in it, or, for a folder written before the marker existed, a file
only our runs write (``LEGACY_SIGNS``). Anything else is refused (exit 2) before a file is written, whatever the
command: training, ``--stats-only`` / ``--debug-samples`` writing there, ``--preprocess`` writing its default
``<train.output_dir>/prepared``. Refused always, marker or not: ``/``, the home folder, the working folder, and a
folder that is or holds an input of the run (a data source, ``data.image_dir`` / ``data.image_root``, a local model
or tokenizer folder): a run's ``README.md``, ``config.yaml`` and ``dataset_report.json`` would replace its files.

One training run at a time: ``.qlora-train.lock`` (``LOCK_FILE``) is locked (``flock``) for the run's whole life, and
a second run on the folder is refused at its start, naming the first one's process. The kernel drops the lock when
the process ends, however it ends (``kill -9`` too): a killed run never leaves it stuck.

    >>> output_dir_problem("/", {})
    'train.output_dir: / is the root folder: name a folder of its own for the run'
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

from qlora_train.config import Config
from qlora_train.files import write_atomic
from qlora_train.locations import is_glob

MARKER_FILE = ".qlora-train"
LOCK_FILE = ".qlora-train.lock"
# files only a qlora-train run writes: a folder holding one was written by a run from before the marker
LEGACY_SIGNS = ("run_fingerprint.json", "training_complete.json", "template_layout.yaml", "prepared/fingerprint.json")
KEY = "train.output_dir"


def run_inputs(cfg: Config) -> dict[str, str]:
    """What a run reads from disk that its output folder must never be or hold: config key -> local path (the
    data sources' files, folders and globs' leading folders; image folders; local model and tokenizer folders)."""
    out = {}
    for section in ("datasets", "eval_datasets"):
        for i, src in enumerate(getattr(cfg.data, section)):
            for j, path in enumerate(src.paths):
                key = f"data.{section}[{i}].path" + (f"[{j}]" if len(src.paths) > 1 else "")
                if is_glob(path):
                    path = str(Path(*_fixed_parts(Path(path).expanduser())))
                if Path(path).expanduser().exists():
                    out[key] = path
    for key, path in (("data.image_dir", cfg.data.image_dir), ("data.image_root", cfg.data.image_root),
                      ("model.name_or_path", cfg.model.name_or_path), ("model.tokenizer", cfg.model.tokenizer)):
        if path and Path(path).expanduser().exists():
            out[key] = path
    return out


def _fixed_parts(path: Path) -> list[str]:
    parts = []
    for part in path.parts:
        if is_glob(part):
            break
        parts.append(part)
    return parts


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _holds(folder: Path, path: Path) -> bool:
    return path == folder or folder in path.parents


def output_dir_problem(path: str | Path, inputs: dict[str, str]) -> str | None:
    """None when a run may write into ``path``, else why not (one line naming ``train.output_dir``): the rule in
    the module doc. Only reads."""
    real, shown = _real(path), str(path)
    try:
        home = _real(Path.home())
    except (RuntimeError, KeyError):  # no home folder known
        home = None
    if real == Path(real.anchor):
        return f"{KEY}: {shown} is the root folder: name a folder of its own for the run"
    if real == home:
        return f"{KEY}: {shown} is the home folder: name a folder of its own for the run"
    if real == _real(os.getcwd()):
        return f"{KEY}: {shown} is the working folder: name a folder of its own for the run (e.g. outputs/run)"
    for key, source in inputs.items():
        if _holds(real, _real(source)):
            what = "is" if _real(source) == real else "holds"
            return (f"{KEY}: {shown} {what} {key} ({source}): a run would write its files among the run's inputs; "
                    "name a folder of its own for the run")
    if real.exists() and not real.is_dir():
        return f"{KEY}: {shown} is a file, not a folder"
    if real.is_dir() and not ours(real) and any(real.iterdir()):
        return (f"{KEY}: {shown} is a folder that qlora-train did not write (no {MARKER_FILE} in it) and not "
                "empty: a run writes only into a new or empty folder, or one of its own; name another folder")
    return None


def ours(folder: Path) -> bool:
    """Whether ``folder`` was written by our runs: its marker, or a file only they write."""
    return (folder / MARKER_FILE).is_file() or any((folder / sign).is_file() for sign in LEGACY_SIGNS)


def claim_output_dir(path: str | Path, inputs: dict[str, str]) -> Path:
    """``path`` made (with its parents) and marked as our runs' folder, once ``output_dir_problem`` has no
    objection; ``UsageError`` (exit 2) with it when it has."""
    from qlora_train.errors import UsageError

    problem = output_dir_problem(path, inputs)
    if problem is not None:
        raise UsageError(problem)
    return mark(Path(path))


def mark(folder: Path, **record) -> Path:
    """``folder`` made and its marker written (with ``record`` merged into what it holds: e.g. the names a run
    published, ``published``)."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / MARKER_FILE
    held = read_marker(folder)
    if not marker.is_file() or record:
        write_atomic(marker, json.dumps({**held, "written_by": "qlora-train", **record}, indent=1))
    return folder


def read_marker(folder: Path) -> dict:
    try:
        value = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class RunLock:
    """The lock one training run holds on its output folder (``LOCK_FILE``, ``fcntl.flock``): ``take`` returns None
    once it is held, or the line that refuses the run (another process holds it); ``release`` (or the process's
    end) lets it go. Where ``flock`` does not exist (Windows) no lock is taken. ``claim`` checks the folder first
    (``output_dir_problem``) and marks it; a folder it made is removed again on ``release`` when the run wrote
    nothing else into it (a run refused for its data leaves nothing)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None
        self._made = False

    def claim(self, inputs: dict[str, str]) -> str | None:
        problem = output_dir_problem(self.folder, inputs)
        if problem is not None:
            return problem
        self._made = not self.folder.exists()
        mark(self.folder)
        return self.take()

    def take(self) -> str | None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return None
        try:  # a link planted at its name is not followed
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                         0o666)
        except OSError as exc:
            return f"{KEY}: cannot lock {self.path} ({exc.strerror or exc}): remove what is there"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            return (f"{KEY}: {self.path.parent} is in use by another run ({holder or 'its process unknown'}): "
                    "wait for it to end, or train into another folder")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%H:%M:%S')}"
                  .encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops its lock
            self._fd = None
        if self._made and {p.name for p in self.folder.iterdir()} <= {MARKER_FILE, LOCK_FILE}:
            for name in (MARKER_FILE, LOCK_FILE):
                (self.folder / name).unlink(missing_ok=True)
            self.folder.rmdir()
        self._made = False

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
