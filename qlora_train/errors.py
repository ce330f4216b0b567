"""The errors a run ends on, each with its exit code, defined where every layer can raise them.

The CLI maps any ``QloraError`` to its message and ``exit_code`` without
importing the module that raised it (so a diagnostic never imports the training
stack to name a training error):

    0 done · 1 data or model error · 2 config or usage error · 3 CUDA out of memory ·
    70 a bug in qlora-train (unexpected exceptions on more than 1% of the rows) ·
    128 + signal: stopped by Ctrl-C / SIGTERM after saving a checkpoint
"""

from __future__ import annotations


class QloraError(Exception):
    """An expected failure: one clear message, no traceback, and an exit code."""

    exit_code = 1

    def cli_message(self) -> str:
        return f"error: {self}"


class ConfigError(QloraError):
    """Every problem of a config, one line each, naming the key path."""

    exit_code = 2

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))

    def cli_message(self) -> str:
        return "invalid config:\n" + "\n".join(f"  {problem}" for problem in self.problems)


class UsageError(QloraError):
    """What a command was asked to do cannot be done as asked (e.g. nothing to export): exit 2."""

    exit_code = 2


class DataError(QloraError):
    """The data cannot give a training set: an unreadable source, every row dropped, a bad row under
    ``data.on_bad_row: error``."""


class InternalError(QloraError):
    """A bug in our code, not bad data: rows failed with exceptions no stage foresaw (``rows.guarded``) on
    more than ``UNEXPECTED_ROWS_STOP`` of a dataset. The message carries the first one's traceback."""

    exit_code = 70  # EX_SOFTWARE

    def cli_message(self) -> str:
        return f"internal error (a bug in qlora-train; please report it with this message): {self}"


class ModelLoadError(QloraError):
    """The tokenizer or model named in the config cannot be loaded (missing files, no network for a hub id)."""


class Interrupted(QloraError):
    """Stopped on a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        self.exit_code = 128 + signum
        super().__init__(message)

    def cli_message(self) -> str:
        return f"interrupted: {self}"
