"""Load the configured data sources into one ``datasets.Dataset`` of raw rows.

Every source becomes the same four columns::

    row        the raw row as JSON text ("" when it could not be read)
    location   "file:line" (JSON lines), "file[i]" (others), for messages naming the row
    load_error why the row could not be read ("" when it could)
    source     which ``data.datasets`` entry the row came from (``source_label``), for per-source reports

Rows are stored as JSON text on purpose: Arrow would merge the differing
nested shapes of rows (tool arguments, optional message keys) into one struct
and fill every missing key with null, changing what the template renders.
JSON and JSON lines are read by a generator (so a broken line is counted with
its file and line number instead of failing the load); Parquet, CSV and Arrow
by the datasets builders, directories written by ``save_to_disk`` by
``load_from_disk``, and anything else that is not on disk but looks like a hub
id by ``load_dataset(path, name, split=, data_files=)``. All are cached by
datasets (Arrow, fingerprinted on the file's path, size and modification time).
A row may be a mapping or, in JSON files, a bare list (of messages).
"""

from __future__ import annotations

import glob as globlib
import json
import os
from pathlib import Path

import datasets
import pyarrow as pa

from qlora_train.config import DatasetSource
from qlora_train.data.handlers import apply_row_handlers, row_json
from qlora_train.errors import DataError
from qlora_train.locations import BUILDERS, is_glob, looks_like_hub_id

FEATURES = datasets.Features(
    {"row": datasets.Value("string"), "location": datasets.Value("string"), "load_error": datasets.Value("string")}
)


class SourceError(DataError):
    """A data source cannot be read at all (missing file, unknown format)."""


def _is_saved_dataset(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk``."""
    return path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _data_file_patterns(src: DatasetSource) -> list[str]:
    files = src.data_files
    if isinstance(files, dict):
        if src.split not in files:
            raise SourceError(f"data_files has no entry for split {src.split!r} (keys: {sorted(files)})")
        files = files[src.split]
    return [files] if isinstance(files, str) else list(files or [])


def _files(path: str, src: DatasetSource) -> list[Path]:
    """One local path (file, directory, glob) -> its data files, sorted."""
    p = Path(path)
    if is_glob(path):
        files = sorted(Path(f) for f in globlib.glob(path, recursive=True) if Path(f).is_file())
    elif p.is_dir():
        patterns = _data_file_patterns(src)
        if patterns:
            files = sorted({Path(f) for pat in patterns for f in globlib.glob(str(p / pat), recursive=True)})
        else:
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")
                           and (src.builder or f.suffix.lower() in BUILDERS)
                           and not (f.suffix == ".json" and _is_saved_dataset(f.parent)))  # its metadata
    elif p.is_file():
        files = [p]
    else:
        raise SourceError(f"data.datasets path not found: {path}")
    if not files:
        raise SourceError(f"data.datasets path {path}: no data files found")
    return files


def _builder(file: Path, src: DatasetSource) -> str:
    builder = src.builder or BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise SourceError(f"{file}: unknown extension; set `builder` (json, parquet, csv, arrow) for this source")
    return builder


def _json_rows(files: list[str], stamps: list[str]):
    """Rows of JSON-array or JSON-lines files (``stamps`` only feed the cache fingerprint)."""
    for file in files:
        with open(file, encoding="utf-8", errors="surrogateescape") as fh:  # bad bytes -> counted, not replaced
            head = fh.read(4096).lstrip()
            fh.seek(0)
            if head.startswith("[") and not file.endswith(".jsonl"):  # a .jsonl file is lines even of lists
                try:
                    items = json.load(fh)
                except json.JSONDecodeError as exc:
                    if "\n" in head and head.split("\n", 1)[0].rstrip().endswith("]"):
                        fh.seek(0)  # JSON lines whose rows are bare lists of messages
                        yield from _json_lines(fh, file)
                        continue
                    yield {"row": "", "location": f"{file}:{exc.lineno}", "load_error": f"invalid JSON: {exc.msg}"}
                    continue
                for i, item in enumerate(items):
                    yield {"row": row_json(item), "location": f"{file}[{i}]", "load_error": ""}
                continue
            yield from _json_lines(fh, file)


def _json_lines(fh, file: str):
    """Each non-blank line as it is, parsed later, once (``batches.parse_readable``, which names a line that does
    not parse). A line Arrow cannot store (a lone surrogate from undecodable bytes) is parsed here and stored
    escaped by ``row_json``."""
    for lineno, line in enumerate(fh, 1):
        text = line.strip()
        if not text:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            try:
                text = row_json(json.loads(text))
            except json.JSONDecodeError as exc:
                yield {"row": "", "location": f"{file}:{lineno}", "load_error": f"unparseable JSON line: {exc.msg}"}
                continue
        yield {"row": text, "location": f"{file}:{lineno}", "load_error": ""}


def _to_rows(batch: dict, indices: list[int], name: str) -> dict:
    keys = list(batch)
    rows = [{k: batch[k][j] for k in keys} for j in range(len(indices))]
    return {
        "row": [row_json(r) for r in rows],
        "location": [f"{name}[{i}]" for i in indices],
        "load_error": [""] * len(indices),
    }


def _as_raw(ds: datasets.Dataset, name: str) -> datasets.Dataset:
    """A datasets table -> Dataset(row, location, load_error), one JSON row per table row."""
    return ds.map(_to_rows, batched=True, with_indices=True, fn_kwargs={"name": name},
                  remove_columns=ds.column_names, features=FEATURES, desc=f"reading {name}")


def _load_hub(path: str, src: DatasetSource, cache_dir: str | None) -> datasets.Dataset:
    try:
        ds = datasets.load_dataset(path, src.name, split=src.split, data_files=src.data_files, cache_dir=cache_dir)
    except Exception as exc:  # offline, unknown id, missing config: one clear line naming the source
        raise SourceError(f"data.datasets path {path}: not a local file, directory or glob, and loading it as a "
                          f"hub dataset failed: {type(exc).__name__}: {exc}") from None
    return _as_raw(ds, path)


def _load_path(path: str, src: DatasetSource, cache_dir: str | None) -> list[datasets.Dataset]:
    """One path of a source -> raw-row datasets (JSON files read together, others one per file)."""
    if not Path(path).exists() and looks_like_hub_id(path):
        return [_load_hub(path, src, cache_dir)]
    if _is_saved_dataset(Path(path)):
        return [_as_raw(datasets.load_from_disk(path), path)]
    files = _files(path, src)
    builders = {f: _builder(f, src) for f in files}
    parts = []
    json_files = [f for f in files if builders[f] == "json"]
    if json_files:
        stamps = [f"{f}:{os.path.getsize(f)}:{os.path.getmtime(f)}" for f in json_files]
        parts.append(datasets.Dataset.from_generator(
            _json_rows, gen_kwargs={"files": [str(f) for f in json_files], "stamps": stamps},
            features=FEATURES, cache_dir=cache_dir,
        ))
    for file in files:
        if builders[file] == "json":
            continue
        ds = datasets.load_dataset(builders[file], data_files=str(file), split="train", cache_dir=cache_dir)
        parts.append(_as_raw(ds, str(file)))
    return parts


def load_source(src: DatasetSource, *, cache_dir: str | None = None) -> datasets.Dataset:
    """One ``data.datasets`` entry -> Dataset(row, location, load_error).

    Every path of the entry is read and concatenated, then the entry's row
    handlers run, then ``max_samples`` keeps the first rows.
    """
    parts = [part for path in src.paths for part in _load_path(path, src, cache_dir)]
    out = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    out = apply_row_handlers(out, src.handlers)
    if src.max_samples is not None and len(out) > src.max_samples:
        out = out.select(range(src.max_samples))
    return out


def source_label(index: int, src: DatasetSource) -> str:
    """``data.datasets[i]`` entry -> the name reports use for it, e.g. ``"0:data/chat.jsonl"``."""
    return f"{index}:{src.path if isinstance(src.path, str) else '+'.join(src.path)}"


def _label_rows(batch: pa.Table, label: str) -> pa.Table:
    return batch.append_column("source", pa.array([label] * batch.num_rows, pa.string()))


def load_labelled_source(index: int, src: DatasetSource, *, cache_dir: str | None = None) -> datasets.Dataset:
    """The ``index``-th entry -> its raw rows, each tagged with ``source = source_label(index, src)``.

    The rows stay Arrow tables through the map (a column appended), not read into Python and written back."""
    return load_source(src, cache_dir=cache_dir).with_format("arrow").map(
        _label_rows, batched=True, fn_kwargs={"label": source_label(index, src)},
        desc="labelling rows").with_format(None)


def load_sources(sources: list[DatasetSource], *, cache_dir: str | None = None) -> datasets.Dataset:
    """All sources, concatenated in order, each row tagged with its ``source`` label."""
    if not sources:
        raise SourceError("data.datasets is empty: name at least one data source")
    parts = [load_labelled_source(i, s, cache_dir=cache_dir) for i, s in enumerate(sources)]
    return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
