"""What a data or model location names: a glob, a data file, or a Hugging Face Hub id (one definition of each).

    >>> [looks_like_hub_id(p) for p in ("Qwen/Qwen3-1.7B", "squad", ".cache/m", "_x/y", "a/b/c", "d/x.jsonl")]
    [True, True, False, False, False, False]
"""

from __future__ import annotations

import re

GLOB_CHARS = "*?["
# data-file suffix -> the ``datasets`` builder that reads it
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_glob(path: str) -> bool:
    return any(ch in path for ch in GLOB_CHARS)


def looks_like_hub_id(value: str) -> bool:
    """A hub id is ``name`` or ``org/name``, each part starting with a letter or digit; anything with a leading
    ``.``, ``_``, ``/`` or ``~``, more than one ``/``, or a data-file suffix is a local path. Whether it exists on
    disk is the caller's question (a local directory wins over a hub id of the same name)."""
    return bool(_HUB_ID.match(value)) and not value.lower().endswith(tuple(BUILDERS))
