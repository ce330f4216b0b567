"""Errors the CLI turns into exit codes, defined where every layer can raise them without importing another."""

from __future__ import annotations


class ConfigError(Exception):
    """Every problem of a config, one line each, naming the key path."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


class ModelLoadError(Exception):
    """The tokenizer or model named in the config cannot be loaded (missing files, no network for a hub id)."""
