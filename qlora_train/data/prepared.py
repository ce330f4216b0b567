"""The datasets training is fed, built from the raw sources or read back from a directory ``--preprocess`` wrote.

``training_data(cfg, tokenizer)`` is what ``train()`` calls: with ``data.prepared_path`` unset it runs the whole
pipeline (``build_datasets``, then packing when ``train.packing``); with it set it loads what ``write_prepared``
saved there, after checking that the saved fingerprint matches the current one. A prepared directory::

    train/ eval/            the datasets training feeds (Arrow shards, ``Dataset.save_to_disk``), packed when
                            ``train.packing`` was set; ``eval/`` only with an eval split
    rows/raw rows/processed every raw row and its processed row, aligned (``load_and_process``): the diagnostics
    dataset_report.json     the report training prints and writes
    data_config.yaml        the data config as resolved
    images.json             each image the rows refer to (by path): its size in bytes and modification time
    fingerprint.json        the fingerprint and its parts, and each saved file's hash (``shards``: written into
                            the staging directory last)

The fingerprint is a blake2b over seven part hashes, each cheap and deterministic:

    data         the data config as canonical JSON, less the keys that do not change the rows
                 (``UNFINGERPRINTED``), source paths written relative to the working directory
    tokenizer    its pipeline (the model as it serializes itself: vocabulary, merges, settings; normalizer,
                 pre-tokenizer, post-processor, decoder), the added tokens and the special-token map
                 (``identity.tokenizer_identity``)
    template     the chat template text (``model.chat_template_kwargs`` and ``model.template_layout`` are baked
                 into it)
    layout       the resolved layout (``template_layout``: probed, with the declared parts), every part by name:
                 a probe that reads the same template differently refuses the data too
    code         ``pipeline_code_hash()``: the data package, ``chat_templates.py`` and the shipped templates
    packing      ``train.packing``, its length and ``split_long`` (training only; the diagnostics skip it)
    images       each image file the saved rows refer to: its path, size in bytes and modification time (whole
                 seconds), as ``images.json`` lists them; ``data:`` URIs are in the rows themselves

What was saved is checked when it is read back (``prepared_checks``): each file of a dataset read, and the report,
must have the hash written beside it (an Arrow shard edited, swapped or added since is named), and the rows training
reads must hold tokens a run can train on (ids and labels of one length, ids inside the tokenizer's vocabulary, each
label -100 or its token's id), else ``ConfigError`` naming the file or the row, before the model loads.

The raw files' contents are not fingerprinted: a prepared directory stands for the files as they were. Images are:
the rows keep their references, not their pixels (training reads the files), and each image's tokens in the ids
were counted from its size then, so a file changed since (or missing) is a difference the check names. A copy
that does not keep modification times (``cp -p`` and ``rsync -a`` keep them) reads as changed.

    >>> differing_keys({"max_length": 128, "mask": {"user": "mask"}}, {"max_length": 256, "mask": {"user": "mask"}})
    ['max_length: 128 when prepared, 256 now']
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from qlora_train.config import Config
from qlora_train.data.dataset import DatasetReport, datasets_from_processed, load_and_process, pipeline_code_hash
from qlora_train.data.identity import tokenizer_identity
from qlora_train.data.packing import PackingStats, example_lengths, pack_dataset
from qlora_train.data.prepared_checks import changed_files, shard_hashes, token_problem
from qlora_train.errors import ConfigError
from qlora_train.files import fresh_dir, publish_dir, write_atomic
from qlora_train.masking import layout_dict, template_layout

log = logging.getLogger(__name__)
# what a prepared directory holds, beyond what the fingerprint's parts say; 2: a render's ids are cut where each
# trained turn's generated part begins (masking.encode_rendered), so directories of format 1 are refused; 3: the
# files' hashes (``shards``), checked when read
FORMAT = 3
FINGERPRINT_FILE, REPORT_FILE, DATA_CONFIG_FILE = "fingerprint.json", "dataset_report.json", "data_config.yaml"
IMAGES_FILE = "images.json"
TRAIN_DIR, EVAL_DIR, RAW_DIR, PROCESSED_DIR = "train", "eval", "rows/raw", "rows/processed"
DATASET_DIRS = (TRAIN_DIR, EVAL_DIR, RAW_DIR, PROCESSED_DIR)
# data keys that change how the rows are computed, not what they are (num_proc: tested to give the same rows)
UNFINGERPRINTED = ("prepared_path", "num_proc", "batch_size", "cache_dir")
PARTS = ("data", "tokenizer", "template", "layout", "code", "packing", "images")
SHOWN_IMAGES = 3  # changed images named in the check's message (and how many more)


@dataclass
class TrainingData:
    """What ``train()`` feeds the Trainer, and what it reports."""

    train: object  # datasets.Dataset
    eval: object | None
    report: DatasetReport
    packing: PackingStats | None = None


# --- the fingerprint ---


def _hash(value) -> str:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def portable_path(path: str) -> str:
    """A source path as the fingerprint compares it: relative to the working directory when inside it
    (``/repo/configs/x.jsonl`` run from ``/repo`` -> ``configs/x.jsonl``), else absolute; hub ids unchanged."""
    absolute = os.path.abspath(path)
    relative = os.path.relpath(absolute, os.getcwd())
    return absolute if relative.startswith("..") else relative


def data_identity(cfg: Config) -> dict:
    """The data config as the fingerprint compares it (``UNFINGERPRINTED`` keys out, portable source paths)."""
    # data.prompt_tools only when set: a config without it keeps the fingerprint it had before it existed
    data = cfg.data.model_dump(mode="json", exclude=set(UNFINGERPRINTED) | (set() if cfg.data.prompt_tools
                                                                              else {"prompt_tools"}))
    if cfg.data.prompt_tools:  # what the prompts are rendered with: the schemas (a changed docstring changes them)
        from qlora_train.data.prompts import tool_schemas

        data["prompt_tools"] = {"names": data["prompt_tools"], "schemas": tool_schemas(tuple(cfg.data.prompt_tools))}
    for section in ("datasets", "eval_datasets"):
        for src in data[section]:
            src["path"] = ([portable_path(p) for p in src["path"]] if isinstance(src["path"], list)
                           else portable_path(src["path"]))
    return data


def packing_identity(cfg: Config) -> dict:
    t = cfg.train
    return {"packing": True, "packing_length": cfg.packing_length, "split_long": t.split_long} if t.packing \
        else {"packing": False}


def image_refs(*datasets) -> list[str]:
    """The image files the rows of ``datasets`` (None skipped) refer to, each once, in first-seen order; ``data:``
    URIs left out (their pixels are in the rows)."""
    seen: dict[str, None] = {}
    for ds in datasets:
        if ds is None or "images" not in ds.column_names:
            continue
        for refs in ds["images"][:]:  # the column read at once (iterating it reads a row at a time: ~20 µs each)
            seen.update(dict.fromkeys(r for r in refs if not r.startswith("data:")))
    return list(seen)


def image_stamps(refs: list[str]) -> list[list]:
    """Each image file -> ``[path, size in bytes, modification time in whole seconds]`` (``None`` twice when it is
    missing): what ``images`` fingerprints. A stat per file, no read."""
    out = []
    for ref in refs:
        try:
            st = os.stat(ref)
        except OSError:
            out.append([ref, None, None])
            continue
        out.append([ref, st.st_size, int(st.st_mtime)])
    return out


def with_images(stamp: dict, stamps: list[list]) -> dict:
    """A fingerprint with its ``images`` part made from ``stamps`` (``image_stamps``), the whole hash again."""
    parts = {**stamp["parts"], "images": _hash(stamps)}
    return {**stamp, "fingerprint": _hash(parts), "parts": parts, "images": stamps}


def fingerprint(cfg: Config, tokenizer, image_files: list[list] | None = None) -> dict:
    """The fingerprint of what ``cfg`` and ``tokenizer`` make: ``{"fingerprint": hex, "parts": {part: hex}, …}``
    with the compared values themselves (data config, packing, tokenizer name, layout, the image files'
    ``image_stamps``: none by default) to say what differs."""
    data, packing, tok = data_identity(cfg), packing_identity(cfg), tokenizer_identity(tokenizer)
    layout = layout_dict(template_layout(tokenizer))
    parts = {"data": _hash(data), "tokenizer": tok["hash"], "template": _hash(tokenizer.chat_template),
             "layout": _hash(layout), "code": pipeline_code_hash(), "packing": _hash(packing)}
    return with_images({"format": FORMAT, "parts": parts, "data_config": data, "packing": packing,
                        "tokenizer": {"name_or_path": tok["name_or_path"], "size": tok["size"]}, "layout": layout},
                       image_files or [])


def changed_images(saved: list[list], now: list[list]) -> list[str]:
    """The image files whose stamps differ, one line each: ``/d/a.png: missing`` or ``/d/a.png: 1200 bytes,
    modified 1700000000 when prepared; 1300 bytes, modified 1700000100 now``."""
    out = []
    for (ref, size, mtime), (_, size_now, mtime_now) in zip(saved, now):
        if (size, mtime) == (size_now, mtime_now):
            continue
        if size_now is None:
            out.append(f"{ref}: missing")
        else:
            out.append(f"{ref}: {size} bytes, modified {mtime} when prepared; {size_now} bytes, modified "
                       f"{mtime_now} now")
    return out


_ABSENT = object()


def _show(value) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value, ensure_ascii=False)


def differing_keys(saved: dict, now: dict, prefix: str = "", *, then: str = "when prepared") -> list[str]:
    """Two config dicts -> ``"key: <saved> when prepared, <now> now"`` (``then`` names the saved side) for every key
    path whose value differs (into mappings on both sides, and lists of mappings of one length, such as the
    sources)."""
    out = []
    for key in sorted(saved.keys() | now.keys()):
        a, b, path = saved.get(key, _ABSENT), now.get(key, _ABSENT), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differing_keys(a, b, f"{path}.", then=then)
        elif (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
              and all(isinstance(x, dict) for x in a + b)):
            for i, (x, y) in enumerate(zip(a, b)):
                out += differing_keys(x, y, f"{path}[{i}].", then=then)
        elif a != b:
            out.append(f"{path}: {_show(a)} {then}, {_show(b)} now")
    return out


def _packing_note(p: dict) -> str:
    return f"packing_length={p['packing_length']}, split_long={p['split_long']}" if p.get("packing") \
        else "without packing"


def fingerprint_problems(saved: dict, now: dict, *, parts: tuple[str, ...] = PARTS) -> list[str]:
    """What differs between the fingerprint a directory was prepared with and the current one, one line each."""
    problems = []
    differ = [p for p in parts if saved["parts"].get(p) != now["parts"][p]]
    if "data" in differ:
        keys = differing_keys(saved.get("data_config", {}), now["data_config"])
        problems += [f"data.{line}" for line in keys] or ["the data config differs"]
    if "tokenizer" in differ:
        was, is_ = saved.get("tokenizer", {}), now["tokenizer"]
        problems.append(f"the tokenizer differs (vocabulary or special tokens): prepared with {was.get('name_or_path')}"
                        f" ({was.get('size')} tokens), now {is_['name_or_path']} ({is_['size']} tokens)")
    if "template" in differ:
        problems.append("the chat template differs (model.chat_template, model.chat_template_kwargs or "
                        "model.template_layout)")
    if "layout" in differ:
        keys = differing_keys(saved.get("layout", {}), now["layout"])
        problems += [f"the template layout differs: {line}" for line in keys] or ["the template layout differs"]
    if "code" in differ:
        problems.append("the data pipeline code differs (qlora_train/data, chat_templates.py or a shipped template "
                        "changed since the data was prepared)")
    if "packing" in differ:
        problems.append(f"the packing settings differ: prepared {_packing_note(saved.get('packing', {}))}, now "
                        f"{_packing_note(now['packing'])}")
    if "images" in differ:
        changed = changed_images(saved.get("images", []), now.get("images", []))
        more = f" (and {len(changed) - SHOWN_IMAGES} more)" if len(changed) > SHOWN_IMAGES else ""
        problems += [f"an image changed since the data was prepared (its tokens were counted from its size then): "
                     f"{line}" for line in changed[:SHOWN_IMAGES]] or ["the image files differ"]
        problems[-1] += more
    return problems


# --- building and writing ---


def pack_splits(cfg: Config, train_ds, eval_ds):
    """``train.packing``: both splits packed into ``cfg.packing_length``. Returns (train, eval, PackingStats of
    train); an example longer than that without ``split_long`` is a ``ConfigError``."""
    t = cfg.train
    try:
        train_ds, stats = pack_dataset(train_ds, cfg.packing_length, split_long=t.split_long)
        if eval_ds is not None:
            eval_ds, _ = pack_dataset(eval_ds, cfg.packing_length, split_long=t.split_long)
    except ValueError as err:
        raise ConfigError([f"train.packing_length: {err}"]) from None
    return train_ds, eval_ds, stats


def with_lengths(train_ds):
    """``train.group_by_length``: the ``length`` column the length-grouped sampler reads."""
    return train_ds.add_column("length", example_lengths(train_ds))


def pack_or_group(cfg: Config, train_ds, eval_ds):
    """``train.packing`` (``pack_splits``), else ``train.group_by_length`` (``with_lengths``). Returns (train,
    eval, PackingStats of train or None)."""
    if cfg.train.packing:
        return pack_splits(cfg, train_ds, eval_ds)
    return (with_lengths(train_ds) if cfg.train.group_by_length else train_ds), eval_ds, None


def _packed(cfg: Config, train_ds, eval_ds, report: DatasetReport) -> TrainingData:
    """Packing when ``train.packing`` (recorded in the report); the length column is added at training."""
    packing = None
    if cfg.train.packing:
        train_ds, eval_ds, packing = pack_splits(cfg, train_ds, eval_ds)
        report.packing = {**asdict(packing), "efficiency": packing.efficiency}
    return TrainingData(train_ds, eval_ds, report, packing)


def build_training_data(cfg: Config, tokenizer) -> TrainingData:
    """The raw sources -> the datasets training feeds (packed with ``train.packing``; length column with
    ``train.group_by_length``)."""
    _, processed = load_and_process(cfg.data, tokenizer)
    return _grouped(cfg, _packed(cfg, *datasets_from_processed(processed, cfg.data, tokenizer)))


def _grouped(cfg: Config, data: TrainingData) -> TrainingData:
    if data.packing is None and cfg.train.group_by_length:
        data.train = with_lengths(data.train)
    return data


def default_prepared_dir(cfg: Config) -> Path:
    """``data.prepared_path``, else ``<train.output_dir>/prepared``."""
    return Path(cfg.data.prepared_path or Path(cfg.train.output_dir) / "prepared")


def write_prepared(cfg: Config, tokenizer, dest: str | Path) -> TrainingData:
    """Run the whole pipeline as training would and write the result to ``dest`` (see the module doc).

    Staged in ``.<dest>.tmp`` beside it and renamed into place (``publish_dir``): ``dest`` is the old directory or
    the new one, whole. Refuses (``ConfigError``) to replace a non-empty directory that is not a prepared one.
    """
    dest = Path(dest)
    if dest.is_dir() and any(dest.iterdir()) and not (dest / FINGERPRINT_FILE).is_file():
        raise ConfigError([f"--preprocess-dir: {dest} is a non-empty directory without {FINGERPRINT_FILE}, not "
                           "prepared data: refusing to replace it (name a new or a prepared directory)"])
    if dest.exists() and not dest.is_dir():
        raise ConfigError([f"--preprocess-dir: {dest} is a file"])
    stamp = fingerprint(cfg, tokenizer)
    raw, processed = load_and_process(cfg.data, tokenizer)
    data = _packed(cfg, *datasets_from_processed(processed, cfg.data, tokenizer))
    # the files the saved rows refer to, as they are now (the rows were just made from them)
    stamp = with_images(stamp, image_stamps(image_refs(processed, data.train, data.eval)))
    staging = fresh_dir(dest.with_name(f".{dest.name}.tmp"))  # made new: nothing planted there is written through
    save = lambda ds, sub: ds.save_to_disk(str(staging / sub))
    save(data.train, TRAIN_DIR)
    if data.eval is not None:
        save(data.eval, EVAL_DIR)
    save(raw, RAW_DIR)
    save(processed, PROCESSED_DIR)
    write_atomic(staging / REPORT_FILE, data.report.to_json())
    write_atomic(staging / DATA_CONFIG_FILE, yaml.safe_dump(cfg.data.model_dump(mode="json"), sort_keys=False))
    images = stamp.pop("images")  # their own file: a run's thousands of images are not printed with the rest
    write_atomic(staging / IMAGES_FILE, json.dumps(images, ensure_ascii=False))
    shards = shard_hashes(staging, (*DATASET_DIRS, REPORT_FILE))
    write_atomic(staging / FINGERPRINT_FILE, json.dumps(
        {**stamp, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "shards": shards}, indent=1, ensure_ascii=False))
    publish_dir(staging, dest)
    return data


# --- reading back ---


def _saved_fingerprint(path: Path) -> dict:
    where = f"data.prepared_path: {path}"
    if not path.is_dir():
        raise ConfigError([f"{where}: directory not found (write it with `qlora-train --config … --preprocess`)"])
    try:
        saved = json.loads((path / FINGERPRINT_FILE).read_text())
    except FileNotFoundError:
        raise ConfigError([f"{where}: no {FINGERPRINT_FILE}, not a directory written by --preprocess"]) from None
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{where}: {FINGERPRINT_FILE} cannot be read ({exc}); run --preprocess again"]) from None
    if (not isinstance(saved, dict) or saved.get("format") != FORMAT or not isinstance(saved.get("parts"), dict)
            or not isinstance(saved.get("shards"), dict)):
        raise ConfigError([f"{where}: {FINGERPRINT_FILE} is not of format {FORMAT}; run --preprocess again"])
    try:
        saved["images"] = json.loads((path / IMAGES_FILE).read_text())
    except FileNotFoundError:  # written before images were fingerprinted: the code part names the difference
        saved["images"] = []
    except (OSError, ValueError) as exc:
        raise ConfigError([f"{where}: {IMAGES_FILE} cannot be read ({exc}); run --preprocess again"]) from None
    if not isinstance(saved["images"], list) or not all(isinstance(s, list) and len(s) == 3 for s in saved["images"]):
        raise ConfigError([f"{where}: {IMAGES_FILE} is not a list of [path, size, mtime]; run --preprocess again"])
    return saved


def check_prepared(cfg: Config, tokenizer, *, parts: tuple[str, ...] = PARTS) -> tuple[Path, dict]:
    """``data.prepared_path`` -> (its path, its saved fingerprint), once the fingerprint matches ``cfg`` and
    ``tokenizer`` on ``parts``.

    Raises ``ConfigError`` naming ``data.prepared_path`` and every difference, one line each.
    """
    path = Path(cfg.data.prepared_path)
    saved = _saved_fingerprint(path)
    now = fingerprint(cfg, tokenizer, image_stamps([ref for ref, *_ in saved["images"]]))
    problems = fingerprint_problems(saved, now, parts=parts)
    if problems:
        raise ConfigError([f"data.prepared_path: {path} was prepared differently: {p}" for p in problems] + [
            "data.prepared_path: run `qlora-train --config … --preprocess` again, or unset data.prepared_path to "
            "process the raw files"])
    log.info("data: read from %s (fingerprint %s)", path, saved["fingerprint"][:12])
    return path, saved


def _check_files(path: Path, sub: str, saved: dict) -> None:
    """``ConfigError`` naming the files of ``path/sub`` that are not the ones ``--preprocess`` hashed."""
    changed = changed_files(path, sub, saved["shards"])
    if changed:
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        raise ConfigError([f"data.prepared_path: {path / name}" for name in changed[:3]] + [
            f"data.prepared_path: {path / sub} is not what --preprocess wrote{more}; run --preprocess again"])


def _load(path: Path, sub: str, saved: dict):
    """One saved dataset, its files checked against the hashes written beside them first."""
    import datasets

    _check_files(path, sub, saved)
    try:
        return datasets.load_from_disk(str(path / sub))
    except Exception as exc:  # missing or damaged shards, state.json or dataset_info.json
        raise ConfigError([f"data.prepared_path: {path / sub} cannot be read ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:200]}); run --preprocess again"]) from None


def _trainable(ds, where: Path, tokenizer):
    """A dataset training reads, its every row's tokens checked (``prepared_checks.token_problem``)."""
    problem = token_problem(ds, vocab_size=len(tokenizer))
    if problem is not None:
        raise ConfigError([f"data.prepared_path: {where} {problem}: not what --preprocess makes with this "
                           "tokenizer; run --preprocess again"])
    return ds


def load_prepared(cfg: Config, tokenizer) -> TrainingData:
    """``data.prepared_path`` -> the datasets training feeds, after the fingerprint check, each file's hash and
    each row's tokens checked."""
    path, saved = check_prepared(cfg, tokenizer)
    _check_files(path, REPORT_FILE, saved)  # the report the run prints: the one written with the rows
    try:
        report = DatasetReport(**json.loads((path / REPORT_FILE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError([f"data.prepared_path: {path / REPORT_FILE} cannot be read ({exc}); "
                           "run --preprocess again"]) from None
    read = lambda sub: _trainable(_load(path, sub, saved), path / sub, tokenizer)
    eval_ds = read(EVAL_DIR) if (path / EVAL_DIR).exists() or report.eval_rows else None
    p = report.packing
    packing = PackingStats(p["examples"], p["sequences"], p["tokens"], p["capacity"]) if p else None
    return _grouped(cfg, TrainingData(read(TRAIN_DIR), eval_ds, report, packing))


def training_data(cfg: Config, tokenizer) -> TrainingData:
    """The datasets training feeds: from ``data.prepared_path`` when set, else built from the raw sources."""
    return load_prepared(cfg, tokenizer) if cfg.data.prepared_path else build_training_data(cfg, tokenizer)


def diagnostic_rows(cfg: Config, tokenizer):
    """(raw rows, processed rows), aligned: the saved ones under ``data.prepared_path`` (fingerprint checked,
    packing aside), else ``load_and_process``."""
    if not cfg.data.prepared_path:
        return load_and_process(cfg.data, tokenizer)
    path, saved = check_prepared(cfg, tokenizer, parts=tuple(p for p in PARTS if p != "packing"))
    return _load(path, RAW_DIR, saved), _load(path, PROCESSED_DIR, saved)
