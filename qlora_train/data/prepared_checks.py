"""What training checks of the prepared data it reads back, beyond the fingerprint of how it was made: that its
files are the ones ``--preprocess`` wrote (``shard_hashes`` at writing, ``changed_files`` at reading), and that
every row's tokens are ones a run can train on (``token_problem``: ids and labels of one length, ids in the
vocabulary, each label -100 or its token's id).

    >>> import datasets
    >>> ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[-100, 6, 9]]})
    >>> token_problem(ds, vocab_size=10)
    'row 0, position 2: label 9 is neither -100 nor its token id 7'

A check costs a read of every file (a hash, about 1 GB/s) and one pass over the token columns, a batch of rows at a
time; neither trusts ``fingerprint.json`` for more than the hashes it lists.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from qlora_train.masking import IGNORE_INDEX, SIDES

# the (ids, labels) columns of each row type: SFT and KTO rows, packed sequences, preference pairs' sides
TOKEN_COLUMNS = (("input_ids", "labels"), *((f"{side}_input_ids", f"{side}_labels") for side in SIDES))
ROWS_AT_ONCE = 4096


def file_hash(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def shard_hashes(folder: Path, names: tuple[str, ...]) -> dict[str, str]:
    """Every file of ``folder``'s ``names`` (folders: the Arrow shards and the ``datasets`` files beside them; or
    single files) -> its hash, keyed by its path relative to ``folder`` (``train/data-00000-of-00001.arrow``)."""
    out = {}
    for name in names:
        paths = [folder / name] if (folder / name).is_file() else sorted((folder / name).rglob("*"))
        for path in paths:
            if path.is_file():
                out[path.relative_to(folder).as_posix()] = file_hash(path)
    return out


def changed_files(folder: Path, sub: str, saved: dict[str, str]) -> list[str]:
    """The files of ``folder/sub`` (a folder, or one file) that are not the ones hashed when they were written
    (``saved``), one line each: missing, changed, or there but never written (an extra file beside the shards)."""
    mine = {name: digest for name, digest in saved.items() if name == sub or name.startswith(f"{sub}/")}
    out = []
    for name, digest in sorted(mine.items()):
        path = folder / name
        if not path.is_file():
            out.append(f"{name}: missing")
        elif file_hash(path) != digest:
            out.append(f"{name}: changed since --preprocess wrote it")
    where = folder / sub
    here = {p.relative_to(folder).as_posix() for p in ([where] if where.is_file() else where.rglob("*"))
            if p.is_file()}
    out += [f"{name}: not written by --preprocess" for name in sorted(here - mine.keys())]
    return out


def token_problem(ds, *, vocab_size: int) -> str | None:
    """The first row of ``ds`` (a ``datasets.Dataset``) whose tokens a run cannot train on, said in one line
    (``row 3: 12 ids and 11 labels``; ``row 5, position 0: id 200000 is outside the vocabulary of 151,669
    tokens``; ``row 0, position 2: label 9 is neither -100 nor its token id 7``), or None. Read a batch of rows
    at a time from the Arrow table, no Python loop over tokens."""
    table = ds.with_format("arrow")
    for ids_col, labels_col in TOKEN_COLUMNS:
        if ids_col not in ds.column_names or labels_col not in ds.column_names:
            continue
        for start in range(0, len(ds), ROWS_AT_ONCE):
            batch = table[start:start + ROWS_AT_ONCE]
            problem = _batch_problem(batch[ids_col], batch[labels_col], vocab_size)
            if problem is not None:
                row, what = problem
                side = ids_col.removesuffix("input_ids").removesuffix("_")
                return f"row {start + row}{f' ({side})' if side else ''}{what}"
    return None


def _batch_problem(ids, labels, vocab_size: int) -> tuple[int, str] | None:
    """One batch's ids and labels (Arrow list columns) -> (its first bad row, what is wrong), or None."""
    n_ids = ids.combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
    n_labels = labels.combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
    differ = np.flatnonzero(n_ids != n_labels)
    if differ.size:
        row = int(differ[0])
        return row, f": {n_ids[row]} ids and {n_labels[row]} labels"
    flat_ids = ids.combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    flat_labels = labels.combine_chunks().flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(n_ids)])
    outside = np.flatnonzero((flat_ids < 0) | (flat_ids >= vocab_size))
    if outside.size:
        at = int(outside[0])
        row = int(np.searchsorted(starts, at, side="right") - 1)
        return row, (f", position {at - starts[row]}: id {flat_ids[at]} is outside the vocabulary of "
                     f"{vocab_size:,} tokens")
    wrong = np.flatnonzero((flat_labels != IGNORE_INDEX) & (flat_labels != flat_ids))
    if wrong.size:
        at = int(wrong[0])
        row = int(np.searchsorted(starts, at, side="right") - 1)
        return row, (f", position {at - starts[row]}: label {flat_labels[at]} is neither {IGNORE_INDEX} nor its "
                     f"token id {flat_ids[at]}")
    return None
