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
its file and line number instead of failing the load, and a JSON array that does
not parse whole is read one element at a time, ``_array_elements``) into an Arrow file of the
datasets cache named by the files' paths, sizes and modification times (``_json_dataset``); Parquet, CSV and Arrow
by the datasets builders, directories written by ``save_to_disk`` by
``load_from_disk``, and anything else that is not on disk but looks like a hub
id by ``load_dataset(path, name, split=, data_files=)``. All are cached
(Arrow, fingerprinted on the file's path, size and modification time).
A row may be a mapping or, in JSON files, a bare list (of messages).
"""

from __future__ import annotations

import copy
import functools
import glob as globlib
import hashlib
import json
import os
import re
import sys
from pathlib import Path

import datasets
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter

from qlora_train.config import DatasetSource
from qlora_train.data.batches import read_json
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


def _json_rows(files: list[str]):
    """Rows of JSON-array or JSON-lines files."""
    for file in files:
        # a BOM skipped; bad bytes counted; lines end at "\n" alone (a stray "\r" in a row is the row's, not a break)
        with open(file, encoding="utf-8-sig", errors="surrogateescape", newline="\n") as fh:
            head = fh.read(4096).lstrip()
            fh.seek(0)
            if not (head.startswith("[") and not file.endswith(".jsonl")):  # a .jsonl file is lines even of lists
                yield from _json_lines(fh, file)
                continue
            text = fh.read()
        try:
            rows = [{"row": row_json(item), "location": f"{file}[{i}]", "load_error": ""}
                    for i, item in enumerate(json.loads(text))]
        except json.JSONDecodeError:
            first = head.split("\n", 1)
            if len(first) > 1 and first[0].rstrip().endswith("]"):  # JSON lines whose rows are bare lists
                with open(file, encoding="utf-8-sig", errors="surrogateescape", newline="\n") as fh:
                    yield from _json_lines(fh, file)
                continue
            rows = _array_rows(text, file)
        except (ValueError, RecursionError):  # an element Python's reader refuses (a huge integer, deep nesting)
            rows = _array_rows(text, file)
        yield from rows


# a JSON string (closed), a lone quote (a string never closed), or one of the characters that frame an array
_FRAME = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|"|[][{},]')
_CLOSES = {"]": "[", "}": "{"}


def _array_elements(text: str, file: str) -> list[tuple[int, str]]:
    """A JSON array's top-level elements as (line, text), found by its brackets, commas and strings alone, so that
    one element that does not parse is not the whole file's loss. ``SourceError`` naming the file and place when
    even that frame does not hold (a string or bracket never closed, text after the array).

    >>> _array_elements('[{"a": [1, "],"]},\\n 2 ]', "f.json")
    [(1, '{"a": [1, "],"]}'), (2, '2')]
    """
    if not text.lstrip().startswith("["):
        raise _frame_error(file, text, len(text) - len(text.lstrip()), "not a JSON array")
    open_, spans, start, end = [], [], 0, None
    for m in _FRAME.finditer(text):
        char = m.group()[0]
        if char == '"':
            if len(m.group()) == 1:
                raise _frame_error(file, text, m.start(), "a string that is never closed")
        elif char in "[{":
            open_.append(char)
            if len(open_) == 1:
                start = m.end()
        elif char in "]}":
            if not open_ or open_.pop() != _CLOSES[char]:
                raise _frame_error(file, text, m.start(), f"a {char!r} that closes nothing open")
            if not open_:
                spans.append((start, m.start()))
                end = m.end()
                break
        elif len(open_) == 1:  # a comma between two elements
            spans.append((start, m.start()))
            start = m.end()
    if end is None:
        raise _frame_error(file, text, len(text), f"a {open_[-1]!r} that is never closed")
    if text[end:].strip():
        raise _frame_error(file, text, end, "text after the array")
    if len(spans) == 1 and not text[slice(*spans[0])].strip():
        return []  # the empty array
    out = []
    for a, b in spans:
        body = text[a:b]
        out.append((text.count("\n", 0, a + len(body) - len(body.lstrip())) + 1, body.strip()))
    return out


def _frame_error(file: str, text: str, at: int, why: str) -> SourceError:
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1
    return SourceError(f"{file}: not a JSON array, even read one element at a time: {why} (line {line}, column "
                       f"{column})")


def _array_rows(text: str, file: str) -> list[dict]:
    """A JSON array file that does not parse as a whole -> its elements, each read on its own: one that does not
    parse is counted as ``unparseable_json`` with its index and line (``batches.read_json`` says why)."""
    rows = []
    for i, (line, element) in enumerate(_array_elements(text, file)):
        try:
            read_json(element)
        except ValueError as exc:
            rows.append({"row": "", "location": f"{file}[{i}]",
                         "load_error": f"unparseable JSON element (line {line}): {exc}"})
            continue
        rows.append(_raw_row(element, f"{file}[{i}]"))
    return rows


def _raw_row(text: str, location: str) -> dict:
    """One row's JSON text -> a raw row: stored as it is (parsed later, once, by ``batches.parse_readable``,
    which names it when it does not parse), unless Arrow cannot store it (a lone surrogate from undecodable bytes):
    then parsed here and stored escaped by ``row_json``, or counted as ``unparseable_json`` when it does not
    parse."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            text = row_json(read_json(text))
        except (ValueError, RecursionError) as exc:  # RecursionError: json.dumps, near read_json's depth limit
            return {"row": "", "location": location, "load_error": f"unparseable JSON line: {exc}"}
    return {"row": text, "location": location, "load_error": ""}


JSON_SPACE = " \t\r\n"


def _json_lines(fh, file: str):
    """Each non-blank line as it is, parsed later, once (``batches.parse_readable``, which names a line that does
    not parse). A line Arrow cannot store (a lone surrogate from undecodable bytes) is parsed here and stored
    escaped by ``row_json``."""
    for lineno, line in enumerate(fh, 1):
        text = line.strip(JSON_SPACE)  # JSON's whitespace: a line of other blanks (NEL, U+2028) is a bad row
        if text:
            yield _raw_row(text, f"{file}:{lineno}")


def _to_rows(batch: dict, indices: list[int], name: str) -> dict:
    keys = list(batch)
    rows = [{k: batch[k][j] for k in keys} for j in range(len(indices))]
    return {
        "row": [row_json(r) for r in rows],
        "location": [f"{name}[{i}]" for i in indices],
        "load_error": [""] * len(indices),
    }


def _undecoded(feature):
    """A feature with each ``Image`` in it not decoded (its stored ``{"bytes", "path"}``); None when it has none."""
    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False) if feature.decode else None
    if isinstance(feature, dict):
        inner = {k: _undecoded(v) for k, v in feature.items()}
        return None if all(v is None for v in inner.values()) else {
            k: feature[k] if v is None else v for k, v in inner.items()}
    if isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)):
        inner = _undecoded(feature.feature)
        if inner is None:
            return None
        out = copy.copy(feature)
        out.feature = inner
        return out
    return None


def _as_raw(ds: datasets.Dataset, name: str) -> datasets.Dataset:
    """A datasets table -> Dataset(row, location, load_error), one JSON row per table row. ``Image`` columns are
    read as stored, ``{"bytes", "path"}`` (``data.images.image_ref`` reads them), not decoded into pictures."""
    for column, feature in ds.features.items():
        undecoded = _undecoded(feature)
        if undecoded is not None:
            ds = ds.cast_column(column, undecoded)
    return ds.map(_to_rows, batched=True, with_indices=True, fn_kwargs={"name": name},
                  remove_columns=ds.column_names, features=FEATURES, desc=f"reading {name}")


def _load_hub(path: str, src: DatasetSource, cache_dir: str | None) -> datasets.Dataset:
    try:
        ds = datasets.load_dataset(path, src.name, split=src.split, data_files=src.data_files, cache_dir=cache_dir)
    except Exception as exc:  # offline, unknown id, missing config: one clear line naming the source
        raise SourceError(f"data.datasets path {path}: not a local file, directory or glob, and loading it as a "
                          f"hub dataset failed: {type(exc).__name__}: {exc}") from None
    return _as_raw(ds, path)


ROWS_DIR = "qlora_train_rows"  # under the datasets cache: JSON and JSON-lines files read into Arrow (``_json_dataset``)


def _json_dataset(files: list[Path], cache_dir: str | None) -> datasets.Dataset:
    """JSON and JSON-lines files -> one dataset of their raw rows (``_json_rows``), written once to an Arrow file
    of the datasets cache (``cache_dir``, else datasets' own) named by what it is read from: each file's path,
    size and modification time, and the reading code (this module, ``handlers``, ``batches``); a changed file
    or reader gives a new name. Written as datasets' generator builder would write it, without the builder (whose
    streaming patches import scipy.io and pandas' readers: a tenth of a second of every run); the file is
    written beside its final name and renamed into place (processes reading the same files race harmlessly).
    The dataset is read from the file (memory-mapped; its maps are cached beside it)."""
    stamps = [f"{f}:{os.path.getsize(f)}:{os.path.getmtime(f)}" for f in files]
    key = hashlib.blake2b(json.dumps([ROWS_FORMAT, [str(f) for f in files], stamps, _reader_code()]).encode(),
                          digest_size=16).hexdigest()
    folder = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / ROWS_DIR
    path = folder / f"rows-{key}.arrow"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".rows-{key}.{os.getpid()}.partial"
        try:
            with ArrowWriter(features=FEATURES, path=str(partial)) as writer:
                for row in _json_rows([str(f) for f in files]):
                    writer.write(row)
                rows, _ = writer.finalize()
            if not rows:
                raise SourceError(f"{', '.join(map(str, files))}: no rows (the file is empty, blank lines only, or an "
                                  "empty array)")
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return datasets.Dataset.from_file(str(path))


ROWS_FORMAT = 1  # of the rows' Arrow file: a change gives every file's rows a new name


@functools.cache
def _reader_code() -> str:
    """A hash of the code that reads rows out of JSON files (this module, ``handlers.row_json``, ``batches``)."""
    h = hashlib.blake2b(digest_size=16)
    for module in (sys.modules[__name__], sys.modules[row_json.__module__], sys.modules[read_json.__module__]):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()


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
        parts.append(_json_dataset(json_files, cache_dir))
    for file in files:
        if builders[file] == "json":
            continue
        try:
            ds = datasets.load_dataset(builders[file], data_files=str(file), split="train", cache_dir=cache_dir)
        except datasets.exceptions.DatasetGenerationError as exc:  # the builder read no row (bytes, types, shape)
            cause = exc.__cause__ or exc
            why = " ".join(f"{type(cause).__name__}: {cause}".split())
            raise SourceError(f"{file}: cannot be read as {builders[file]}: {why[:300]}") from None
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
