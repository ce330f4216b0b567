"""Load the configured data sources into one ``datasets.Dataset`` of raw rows.

Every source becomes the same three columns::

    row        the raw row as JSON text ("" when it could not be read)
    location   "file:line" (JSON lines), "file[i]" (others), for messages naming the row
    load_error why the row could not be read ("" when it could)
    source     which ``data.datasets`` entry the row came from (``source_label``), for per-source reports

Rows are stored as JSON text on purpose: Arrow would merge the differing
nested shapes of rows (tool arguments, optional message keys) into one struct
and fill every missing key with null, changing what the template renders.
JSON and JSON lines are read by a generator (so a broken line is counted with
its file and line number instead of failing the load); Parquet, CSV and Arrow
by the datasets builders. Both are cached by datasets (Arrow, fingerprinted
on the file's path, size and modification time).
"""

from __future__ import annotations

import glob as globlib
import json
import os
from pathlib import Path

import datasets

from qlora_train.config import DatasetSource

BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
FEATURES = datasets.Features(
    {"row": datasets.Value("string"), "location": datasets.Value("string"), "load_error": datasets.Value("string")}
)


class SourceError(Exception):
    """A data source cannot be read at all (missing file, unknown format)."""


def _files(src: DatasetSource) -> list[Path]:
    path = Path(src.path)
    if any(ch in src.path for ch in "*?["):
        files = sorted(Path(p) for p in globlib.glob(src.path, recursive=True))
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS)
    elif path.is_file():
        files = [path]
    else:
        raise SourceError(f"data.datasets path not found: {src.path}")
    if not files:
        raise SourceError(f"data.datasets path {src.path}: no data files found")
    return files


def _builder(file: Path, src: DatasetSource) -> str:
    builder = src.builder or BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise SourceError(f"{file}: unknown extension; set `builder` (json, parquet, csv, arrow) for this source")
    return builder


def _dump(item) -> str:
    """A row -> JSON text. Lone surrogates (undecodable bytes, broken escapes) are kept as ``\\udcxx`` escapes:
    Arrow cannot store them raw, and the pipeline drops such rows as ``invalid_unicode`` with their location."""
    text = json.dumps(item, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(item, ensure_ascii=True, default=str)
    return text


def _json_rows(files: list[str], stamps: list[str]):
    """Rows of JSON-array or JSON-lines files (``stamps`` only feed the cache fingerprint)."""
    for file in files:
        with open(file, encoding="utf-8", errors="surrogateescape") as fh:  # bad bytes -> counted, not replaced
            head = fh.read(4096).lstrip()
            fh.seek(0)
            if head.startswith("["):
                try:
                    items = json.load(fh)
                except json.JSONDecodeError as exc:
                    yield {"row": "", "location": f"{file}:{exc.lineno}", "load_error": f"invalid JSON: {exc.msg}"}
                    continue
                for i, item in enumerate(items):
                    yield {"row": _dump(item), "location": f"{file}[{i}]", "load_error": ""}
                continue
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield {"row": "", "location": f"{file}:{lineno}", "load_error": f"unparseable JSON line: {exc.msg}"}
                    continue
                yield {"row": _dump(item), "location": f"{file}:{lineno}", "load_error": ""}


def _to_rows(batch: dict, indices: list[int], file: str) -> dict:
    keys = list(batch)
    rows = [{k: batch[k][j] for k in keys} for j in range(len(indices))]
    return {
        "row": [_dump(r) for r in rows],
        "location": [f"{file}[{i}]" for i in indices],
        "load_error": [""] * len(indices),
    }


def load_source(src: DatasetSource, *, cache_dir: str | None = None) -> datasets.Dataset:
    """One ``data.datasets`` entry -> Dataset(row, location, load_error)."""
    files = _files(src)
    parts = []
    json_files = [f for f in files if _builder(f, src) == "json"]
    if json_files:
        stamps = [f"{f}:{os.path.getsize(f)}:{os.path.getmtime(f)}" for f in json_files]
        parts.append(datasets.Dataset.from_generator(
            _json_rows, gen_kwargs={"files": [str(f) for f in json_files], "stamps": stamps},
            features=FEATURES, cache_dir=cache_dir,
        ))
    for file in files:
        builder = _builder(file, src)
        if builder == "json":
            continue
        ds = datasets.load_dataset(builder, data_files=str(file), split="train", cache_dir=cache_dir)
        parts.append(ds.map(_to_rows, batched=True, with_indices=True, fn_kwargs={"file": str(file)},
                            remove_columns=ds.column_names, features=FEATURES))
    out = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if src.max_samples is not None and len(out) > src.max_samples:
        out = out.select(range(src.max_samples))
    return out


def source_label(index: int, src: DatasetSource) -> str:
    """``data.datasets[i]`` entry -> the name reports use for it, e.g. ``"0:data/chat.jsonl"``."""
    return f"{index}:{src.path}"


def _label_rows(batch: dict, label: str) -> dict:
    return {"source": [label] * len(batch["row"])}


def load_sources(sources: list[DatasetSource], *, cache_dir: str | None = None) -> datasets.Dataset:
    """All sources, concatenated in order, each row tagged with its ``source`` label."""
    if not sources:
        raise SourceError("data.datasets is empty: name at least one data source")
    parts = [
        load_source(s, cache_dir=cache_dir).map(_label_rows, batched=True, fn_kwargs={"label": source_label(i, s)},
                                                 desc="labelling rows")
        for i, s in enumerate(sources)
    ]
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
