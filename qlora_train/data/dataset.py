"""Sources -> processed, filtered, mixed train/eval datasets and a report where every row is accounted for:
``build_datasets(cfg.data, tokenizer)`` returns (train, eval or None, report), and in the report
``rows_in == rows_kept + sum(dropped.values())``.

Order: each source is loaded and processed with its own format options
(``DataConfig.for_source``) -> exact duplicates dropped (``dedup``) -> counted
-> refused rows filtered -> eval split (``eval_fraction``; or ``eval_datasets``)
-> rows exploded into their examples (``reasoning_history: expand``) -> long
plain texts cut into ``max_length`` blocks -> sources mixed (``mix_sources``:
interleaved by weight, or concatenated) -> ``shuffle`` -> ``max_samples``.
Every step is a ``datasets`` map/filter, cached on a fingerprint of its input
and arguments (a source's processing options and the tokenizer with its
template), so an unchanged run reuses the cache and a changed option recomputes.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from qlora_train.config import DataConfig, DatasetSource
from qlora_train.data import rule_check
from qlora_train.data.batches import merge_back, parse_readable
from qlora_train.data.drops import DropReason, stop_at_first_bad_row
from qlora_train.data.formats import split_into_blocks
from qlora_train.data.handlers import import_handler_modules
from qlora_train.data.identity import map_fingerprint
from qlora_train.data.parse import ParseReport, RowImages
from qlora_train.data.pipeline import objective, process_rows
from qlora_train.data.processed import (
    SFT_ROW,
    arrow_lists,
)
from qlora_train.data.rows import storable
from qlora_train.data.sources import SourceError, load_labelled_source, source_label
from qlora_train.errors import DataError, InternalError

log = logging.getLogger(__name__)
class EmptyDatasetError(DataError):
    """Every row was dropped: nothing to train on."""


class WrongRowsError(EmptyDatasetError):
    """Every row was dropped for a reason that says the data is of another kind than the method trains on (chat
    rows whose last turn is the assistant's, given to GRPO): a usage error, exit 2."""

    exit_code = 2


# a reason that, when it drops every row, means the rows are of another kind (-> WrongRowsError), and what to do
WRONG_KIND = {DropReason.PROMPT_ENDS_WITH_ASSISTANT: (
    "every prompt ends with an assistant turn: these are SFT conversations, and train.method: grpo samples that "
    "turn itself; give it prompts (conversations ending with the user's turn, or a prompt column) or train these "
    "rows with train.method: sft"), DropReason.TOOLS_BESIDE_RL_TOOLS: (
    "every prompt row gives tools of its own, but with rl.tools every prompt is rendered with rl.tools' schemas (the "
    "tools its rollouts can run): drop the rows' tools column (data.tools_columns), or train without rl.tools")}


@dataclass
class DatasetReport:
    objective: str = "sft"  # data.objective; with preference a row is a pair and its tokens are both sides'
    desirable_rows: int = 0  # objective unpaired (KTO): kept rows labelled desirable; the others undesirable
    rows_in: int = 0
    rows_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    first_dropped: dict[str, str] = field(default_factory=dict)  # reason -> location and detail of the first
    train_rows: int = 0
    eval_rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    rows_turns_dropped: int = 0
    rows_reasoning_trimmed: int = 0
    rows_token_fallback: dict[str, int] = field(default_factory=dict)
    straddling_tokens: int = 0
    parse: dict = field(default_factory=dict)
    packing: dict = field(default_factory=dict)  # train.packing: examples, sequences, tokens, capacity, efficiency
    duplicates: int = 0
    text_blocks_added: int = 0
    mixing_weights: dict[str, float] = field(default_factory=dict)  # normalised; empty when concatenated
    rows_per_source_before_mixing: dict[str, int] = field(default_factory=dict)  # kept training rows
    rows_per_source_after_mixing: dict[str, int] = field(default_factory=dict)
    domains: dict[str, dict[str, int]] = field(default_factory=dict)  # domain -> rows, tokens, trained_tokens
    eval_dropped: dict[str, int] = field(default_factory=dict)  # from eval_datasets
    # kept rows (before the eval split): what the chat template did with their reasoning and messages (ParseReport
    # fields of the same names, summed over kept rows only; ``parse`` sums them over every row that parsed)
    reasoning_dropped_rows: int = 0  # rows with a trained turn trained without its reasoning
    reasoning_dropped_turns: int = 0
    reasoning_dropped_tokens: int = 0
    reasoning_expanded_turns: int = 0
    expanded_examples: int = 0  # extra examples (reasoning_history: expand); train/eval rows count them
    expanded_tokens: int = 0
    expanded_trained_tokens: int = 0
    unrendered_messages: dict[str, int] = field(default_factory=dict)  # role -> untrained messages not rendered
    verified_by_prefix_renders: int = 0  # kept rows the layout could not verify: the rule's prefix renders did
    prefix_renders: int = 0  # the chat-template renders those rows cost
    # data.rule_check, over every row processed (kept or not): rows also masked by the rule (data/rule_check.py)
    rule_checked_rows: int = 0  # the same ids and labels by the rule
    rule_unchecked_rows: int = 0  # the rule cannot decide (not prefix-stable): kept unchecked
    rule_disagreements: int = 0  # masked differently: refused as mask_disagrees

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def lines(self) -> list[str]:
        kept = f"kept {self.rows_kept}"
        if self.expanded_examples:
            kept += f" -> {self.rows_kept + self.expanded_examples} examples"
        out = [f"rows in {self.rows_in}, {kept} (train {self.train_rows}, eval {self.eval_rows})"]
        for reason, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]):
            out.append(f"  dropped {n:>6} {reason}  e.g. {self.first_dropped[reason]}")
        share = self.trained_tokens / self.tokens if self.tokens else 0.0
        sides = " (both sides of each pair)" if self.objective == "preference" else ""
        if self.objective == "prompt":
            out.append(f"prompt tokens {self.tokens} (none trained: training samples each prompt's completions)")
        else:
            out.append(f"tokens {self.tokens}, trained {self.trained_tokens} ({share:.1%}){sides}")
        if self.mixing_weights:
            out.append("mixing: " + ", ".join(
                f"{src} w={self.mixing_weights[src]:.3f} {self.rows_per_source_before_mixing.get(src, 0)}"
                f"->{self.rows_per_source_after_mixing.get(src, 0)} rows" for src in self.mixing_weights))
        if self.text_blocks_added:
            out.append(f"long texts cut into blocks: {self.text_blocks_added} extra blocks")
        if self.objective == "unpaired":
            out.append(labels_line(self.desirable_rows, self.rows_kept - self.desirable_rows))
            if self.rows_turns_dropped or self.rows_token_fallback:
                out.append(f"truncation: middle prompt exchanges dropped in {self.rows_turns_dropped} rows, "
                           f"completions cut (data.max_response_length) in {sum(self.rows_token_fallback.values())}")
        elif self.objective == "prompt":
            if self.rows_turns_dropped:
                out.append(f"truncation: middle exchanges dropped in {self.rows_turns_dropped} prompts "
                           "(data.max_prompt_length)")
        elif self.objective == "preference":
            if self.rows_turns_dropped or self.rows_reasoning_trimmed or self.rows_token_fallback:
                out.append(f"truncation: middle prompt exchanges dropped in {self.rows_turns_dropped} pairs, "
                           f"reasoning trimmed in {self.rows_reasoning_trimmed}, responses cut "
                           f"(data.max_response_length) in {sum(self.rows_token_fallback.values())}")
        elif self.rows_turns_dropped or self.rows_reasoning_trimmed or self.rows_token_fallback:
            out.append(f"truncation: turns dropped in {self.rows_turns_dropped} rows, reasoning trimmed in "
                       f"{self.rows_reasoning_trimmed}, token-level cut in {sum(self.rows_token_fallback.values())}")
        if self.expanded_examples:
            out.append(f"reasoning_history expand: {self.expanded_examples} extra examples ({self.expanded_tokens} "
                       f"tokens, {self.expanded_trained_tokens} trained)")
        if self.reasoning_dropped_turns:
            out.append(f"reasoning not rendered by the chat template: {self.reasoning_dropped_turns} turns "
                       f"({self.reasoning_dropped_tokens} tokens) in {self.reasoning_dropped_rows} rows trained "
                       "without it")
        if self.verified_by_prefix_renders:
            out.append(f"verified by per-turn prefix renders (the layout could not verify them): "
                       f"{self.verified_by_prefix_renders} rows, {self.prefix_renders} extra renders")
        if self.rule_checked_rows or self.rule_unchecked_rows or self.rule_disagreements:
            out.append(f"checked against the rule (data.rule_check): {self.rule_checked_rows} rows agree, "
                       f"{self.rule_disagreements} disagree (refused: mask_disagrees), {self.rule_unchecked_rows} not "
                       "checked (the template is not prefix-stable on them)")
        if self.parse.get("fast_encoder_mismatches"):
            out.append(f"fast byte-level encoder: differed from tokenizers on {self.parse['fast_encoder_mismatches']} "
                       "checked rows; those rows and the rest of the run were tokenized by tokenizers")
        if self.parse.get("image_rows"):
            forms = self.parse.get("images", {})
            out.append(f"images: {sum(forms.values())} in {self.parse['image_rows']} rows read: " + ", ".join(
                f"{n} {RowImages.FORMS.get(form, form)}" for form, n in sorted(forms.items())))
        if self.parse.get("system_column_conflicts"):
            out.append(system_conflict_line(self.parse["system_column_conflicts"]))
        if self.unrendered_messages:
            out.append("messages the chat template does not render (the model never sees them): " + ", ".join(
                f"{role} {n}" for role, n in sorted(self.unrendered_messages.items(), key=lambda kv: -kv[1])))
        return out


def labels_line(desirable: int, undesirable: int) -> str:
    """Kept unpaired rows (KTO) by label, as the run's summary and ``--stats-only`` print them."""
    return f"labels (kept): {desirable} desirable, {undesirable} undesirable"


def system_conflict_line(rows: int) -> str:
    """Rows whose own system message was kept over a ``system`` column that says something else
    (``ParseReport.system_column_conflicts``), as the run's summary and ``--stats-only`` print them."""
    have = "1 row has" if rows == 1 else f"{rows} rows have"
    return (f"system column: {have} a system message of their own and a 'system' column that differs: their own is "
            "used, the column is not")


def _domain(row, key: str | None) -> str:
    value = row.get(key) if key and isinstance(row, dict) else None
    return "" if value is None else storable(str(value))


@functools.cache
def pipeline_code_hash() -> str:
    """A hash of the mask engine's and the data package's source: ``datasets`` fingerprints a module-level map
    function by name, not by code, so without it a cache made by older masking code would be reused for the same
    rows and config."""
    h = hashlib.blake2b(digest_size=16)
    package = Path(__file__).parent.parent
    files = [*(package / "masking").rglob("*.py"), *(package / "data").rglob("*.py"), package / "chat_templates.py",
             *(package / "templates").glob("*.jinja")]
    for path in sorted(files):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


PART_CHARS = 32 << 20  # a map batch's rows processed together hold at most about this many characters of rows


def _process_raw_batch(batch: dict, indices: list[int], tokenizer, cfg: DataConfig, code: str = "") -> pa.Table:
    """datasets.map function: ``_process_part`` over the batch cut into parts of at most ``PART_CHARS`` characters
    of rows (at least a row each): a part's rows, renders and token lists are alive together until its Arrow table
    is made, so a batch of huge rows (``data.batch_size`` rows of a megabyte each) costs the memory of one part,
    not of the batch. Rows of ordinary size are one part: one tokenizer call per batch.

    ``code`` (``pipeline_code_hash``) only feeds the cache fingerprint."""
    bounds, size = [0], 0
    for i, row in enumerate(batch["row"]):
        size += len(row or "")
        if size > PART_CHARS and i > bounds[-1]:
            bounds.append(i)
            size = len(row or "")
    bounds.append(len(batch["row"]))
    if len(bounds) == 2:
        return _process_part(batch, indices, tokenizer, cfg)
    return pa.concat_tables([_process_part({k: v[a:b] for k, v in batch.items()}, indices[a:b], tokenizer, cfg)
                             for a, b in zip(bounds, bounds[1:])])


def _process_part(batch: dict, indices: list[int], tokenizer, cfg: DataConfig) -> pa.Table:
    """JSON-text rows (+ load errors, source) at ``indices`` of their source -> the objective's row type
    (``pipeline.objective(cfg).row_type``: the pipeline's columns + source, location, domain), as an Arrow table of
    its schema (written as it is; the int lists made by ``arrow_lists``)."""
    n = len(batch["load_error"])
    row_type = objective(cfg).row_type
    ok, rows, errors = parse_readable(batch)
    good = process_rows(rows, tokenizer, cfg, locations=[batch["location"][i] for i in ok],
                        positions=[indices[i] for i in ok], texts=[batch["row"][i] for i in ok])

    def unreadable(i: int) -> dict:  # dropped with its location
        return {**row_type.empty(), "drop_reason": DropReason.UNPARSEABLE_JSON,
                "drop_detail": f"{batch['location'][i]}: {errors[i]}"}

    if len(ok) == n:  # every row read: the columns as they are
        out = dict(good)
    else:
        columns = row_type.output_columns
        merged = merge_back(n, ok, [{col: good[col][j] for col in columns} for j in range(len(ok))], unreadable)
        out = {col: [row[col] for row in merged] for col in columns}
    out["source"] = list(batch["source"])
    out["location"] = list(batch["location"])
    out["domain"] = merge_back(n, ok, [_domain(r, cfg.domain_key) for r in rows], lambda i: "")
    if cfg.on_bad_row == "error":
        stop_at_first_bad_row(out["drop_reason"], out["drop_detail"])
    for name, dtype in row_type.int_list_columns:
        out[name] = arrow_lists(out[name], dtype)
    return pa.Table.from_pydict(out, schema=row_type.schema)


# the counts a row's ParseReport and the dataset report share (the fields of both): the report sums them over kept
# rows alone (what training gets); ``parse`` sums every ParseReport field over every row that parsed
# (the rule check's counts excepted: they count every row checked, the refused ones first of all)
KEPT_PARSE_COUNTS = tuple(sorted(({f.name for f in fields(ParseReport)} & {f.name for f in fields(DatasetReport)})
                                 - set(rule_check.COUNTS)))


def summarize_columns(cols: dict[str, list]) -> DatasetReport:
    """Counts over processed rows given as columns (at least their row type's ``report_columns``)."""
    report = DatasetReport(rows_in=len(cols["drop_reason"]))
    dropped: Counter = Counter()
    for reason, detail in zip(cols["drop_reason"], cols["drop_detail"]):
        if reason:
            dropped[reason] += 1
            report.first_dropped.setdefault(reason, detail)
    report.dropped = dict(dropped)
    report.rows_kept = report.rows_in - sum(dropped.values())
    report.tokens = sum(cols["num_tokens"])
    report.trained_tokens = sum(cols["num_trained_tokens"])
    report.rows_turns_dropped = sum(1 for n in cols["dropped_turns"] if n)
    report.rows_reasoning_trimmed = sum(1 for n in cols["reasoning_trimmed_tokens"] if n)
    cut = cols.get("token_fallback", cols.get("cut_sides", ()))  # a pair's: its sides cut; a prompt is never cut
    report.rows_token_fallback = dict(Counter(s for s in cut if s))
    report.straddling_tokens = sum(cols.get("straddling_tokens", ()))
    kept_counts = {name: Counter() for name in KEPT_PARSE_COUNTS}  # a count, or role -> count (unrendered_messages)

    def row_reports():  # every row's report, for ``parse``; kept rows' counts summed on the way
        for p, reason in zip(cols["parse_report"], cols["drop_reason"]):
            if p == "{}":
                continue
            d = json.loads(p)
            if not reason:
                for name in KEPT_PARSE_COUNTS:
                    if name in d:
                        kept_counts[name].update(d[name] if isinstance(d[name], dict) else {"": d[name]})
            yield d

    report.parse = ParseReport.total_of_dicts(row_reports()).to_dict()
    for name in rule_check.COUNTS:
        setattr(report, name, report.parse[name])
    report = replace(report, **{name: c[""] if isinstance(getattr(report, name), int) else dict(c)
                                for name, c in kept_counts.items()})
    kept = [not r for r in cols["drop_reason"]]
    report.expanded_tokens = sum(n for n, k in zip(cols.get("expanded_tokens", ()), kept) if k)
    report.expanded_trained_tokens = sum(n for n, k in zip(cols.get("expanded_trained_tokens", ()), kept) if k)
    report.desirable_rows = sum(n for n, k in zip(cols.get("desirable", ()), kept) if k)
    return report


def summarize(processed: datasets.Dataset, cfg: DataConfig) -> DatasetReport:
    """Counts over the processed (not yet filtered) dataset."""
    report = summarize_columns(processed.select_columns(list(objective(cfg).row_type.report_columns)).to_dict())
    report.objective = cfg.objective
    return report


def process_dataset(raw: datasets.Dataset, tokenizer, cfg: DataConfig) -> datasets.Dataset:
    """Raw rows -> every row processed (kept rows have tokens, dropped rows a reason).

    What is alive before the rows (the modules imported, the tokenizer) is kept out of the garbage collector's
    reach while they are processed (``gc.freeze``, undone after): each full collection the rows' allocations set off
    would otherwise walk it all again, about a fifth of a short row's CPU. Nothing is collected differently: what
    was frozen is collectable again afterwards.

    The map's cache key is ``identity.map_fingerprint`` (what ``datasets`` would hash, the tokenizer's pipeline by a
    digest worked out once per tokenizer instead of pickled on every run)."""
    with gc_frozen():
        return raw.map(
            _process_raw_batch, batched=True, with_indices=True, batch_size=cfg.batch_size, num_proc=cfg.num_proc,
            fn_kwargs={"tokenizer": tokenizer, "cfg": cfg, "code": pipeline_code_hash()},
            remove_columns=raw.column_names, features=objective(cfg).row_type.features(), desc="preprocessing",
            new_fingerprint=map_fingerprint(raw._fingerprint, tokenizer, cfg, pipeline_code_hash()),
        )


_FROZEN = [0]  # how many ``gc_frozen`` blocks are open


@contextlib.contextmanager
def gc_frozen():
    """What is alive now kept out of the garbage collector's reach until the block ends (``gc.freeze``; what a
    nested block's start finds alive too): its full collections then walk what the block allocates, not every
    module imported, the tokenizer and the rows read before. The outermost block's end makes it all collectable
    again (``gc.unfreeze``); nothing is collected differently, only less often looked at."""
    gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if not _FROZEN[0]:
            gc.unfreeze()


def load_and_process_sources(sources: list[DatasetSource], cfg: DataConfig, tokenizer,
                             ) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Sources -> (raw rows, processed rows), aligned row for row; each source with its own format options."""
    if not sources:
        raise SourceError("data.datasets is empty: name at least one data source")
    import_handler_modules(cfg.handler_modules)
    raws, processed = [], []
    for i, src in enumerate(sources):
        raw = load_labelled_source(i, src, cache_dir=cfg.cache_dir)
        raws.append(raw)
        processed.append(process_dataset(raw, tokenizer, cfg.for_source(src)))
    raw, processed = (raws[0], processed[0]) if len(raws) == 1 else (
        datasets.concatenate_datasets(raws), datasets.concatenate_datasets(processed))
    check_unexpected_errors(processed)
    check_rule_disagreements(processed, tokenizer)
    return raw, processed


UNEXPECTED_ROWS_STOP = 0.01  # the share of rows failing with unexpected exceptions that stops a run


def check_unexpected_errors(processed: datasets.Dataset) -> None:
    """Rows refused by an unexpected exception (``rows.guarded``: a bug in our code, not bad data): the
    first one's location and traceback logged; more than ``UNEXPECTED_ROWS_STOP`` of the rows stop the run
    with it (``InternalError``, exit 70)."""
    failed = pc.not_equal(processed.data.column("error_traceback"), "")
    n = pc.sum(failed).as_py() or 0
    if not n:
        return
    first = pc.index(failed, True).as_py()
    row = processed.select_columns(["drop_detail", "error_traceback"])[first]
    what = (f"{n} of {len(processed)} rows ({n / len(processed):.1%}) failed with an unexpected exception; the "
            f"first, {row['drop_detail']}:\n{row['error_traceback'].rstrip()}")
    if n > UNEXPECTED_ROWS_STOP * len(processed):
        raise InternalError(f"{what}\nstopped: more than {UNEXPECTED_ROWS_STOP:.0%} of the rows is a bug in "
                            "qlora-train, not bad data")
    log.warning("%s\n(counted as bad_row; at most %.0f%% of the rows before a run stops)", what,
                100 * UNEXPECTED_ROWS_STOP)


def check_rule_disagreements(processed: datasets.Dataset, tokenizer) -> None:
    """``data.rule_check``'s outcome over every processed row: rows refused as ``mask_disagrees`` against the rows
    checked -> the first logged, too many stop the run (``rule_check.stop_on_disagreements``)."""
    table = processed.data
    disagree = pc.equal(table.column("drop_reason"), DropReason.MASK_DISAGREES)
    n = pc.sum(disagree).as_py() or 0
    if not n:
        return
    # a row's report holds "rule_checked_rows": 1 only where its rows agreed (defaults are left out of the JSON)
    checked = pc.sum(pc.match_substring(table.column("parse_report"), '"rule_checked_rows"')).as_py() or 0
    first = processed.select_columns(["drop_detail"])[pc.index(disagree, True).as_py()]["drop_detail"]
    rule_check.stop_on_disagreements(checked, n, first, tokenizer)


def load_and_process(cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Config -> (raw rows, processed rows) of ``data.datasets``, aligned row for row (maps keep order).

    Every drop is decided here (duplicates too, with ``data.dedup``), so training and
    the diagnostics see the same rows.
    """
    if cfg.prompt_tools:  # imported before any row is read: a tool that does not import is named once (ToolError)
        from qlora_train.data.prompts import tool_schemas

        tool_schemas(tuple(cfg.prompt_tools))
    raw, processed = load_and_process_sources(cfg.datasets, cfg, tokenizer)
    if cfg.dedup:
        processed, _ = mark_duplicates(processed)
    return raw, processed


def _mark(batch: dict, indices: list[int], duplicates: dict[int, str]) -> dict:
    reasons, details = list(batch["drop_reason"]), list(batch["drop_detail"])
    for j, i in enumerate(indices):
        if i in duplicates:
            reasons[j] = DropReason.DUPLICATE
            details[j] = f"{batch['location'][j]}: same content as {duplicates[i]}"
    return {"drop_reason": reasons, "drop_detail": details}


def mark_duplicates(processed: datasets.Dataset) -> tuple[datasets.Dataset, int]:
    """Kept rows whose ``content_hash`` was seen on an earlier kept row -> dropped as ``duplicate``."""
    cols = processed.select_columns(["drop_reason", "content_hash", "location"]).to_dict()
    first: dict[str, str] = {}
    duplicates: dict[int, str] = {}
    for i, (reason, h, loc) in enumerate(zip(cols["drop_reason"], cols["content_hash"], cols["location"])):
        if reason or not h:
            continue
        if h in first:
            duplicates[i] = first[h]
        else:
            first[h] = loc
    if not duplicates:
        return processed, 0
    marked = processed.map(_mark, batched=True, with_indices=True, fn_kwargs={"duplicates": duplicates},
                           desc="marking duplicates")
    return marked, len(duplicates)


def _blocks(batch: dict, max_length: int) -> dict:
    out = {k: [] for k in batch}
    for j in range(len(batch["input_ids"])):
        model = {k: batch[k][j] for k in SFT_ROW.model_columns}
        for block in split_into_blocks(model, max_length):
            for k in batch:
                out[k].append(block[k] if k in block else batch[k][j])
    return out


def split_long_texts(kept: datasets.Dataset, max_length: int) -> tuple[datasets.Dataset, int]:
    """Rows longer than ``max_length`` (plain texts; chat rows are already truncated) -> blocks."""
    long_rows = sum(1 for n in kept["num_tokens"][:] if n > max_length)  # [:]: one read, not a row at a time
    if not long_rows:
        return kept, 0
    n_before = len(kept)
    out = kept.map(_blocks, batched=True, fn_kwargs={"max_length": max_length}, desc="cutting texts into blocks")
    return out, len(out) - n_before


def _explode(batch: dict) -> dict:
    """datasets.map function: each SFT row -> its primary example, then its extra examples (``SFT_ROW``'s
    ``expanded_columns``), each with ``num_tokens`` its own length and the row's other columns."""
    model, expanded = SFT_ROW.model_columns, SFT_ROW.expanded_columns
    # the row's images are its primary example's: an extra example never holds one (an extra example with images is
    # left out by the engine, masking.render_example, and counted), so its images are []
    carried = [k for k in batch
               if k not in ("input_ids", "labels", "attention_mask", *expanded, "num_tokens", "images")]
    out: dict[str, list] = {k: [] for k in (*model, "num_tokens", *carried)}
    for j, (ids, labels) in enumerate(zip(batch["input_ids"], batch["labels"])):
        examples = [(ids, labels), *zip(batch["expanded_input_ids"][j], batch["expanded_labels"][j])]
        for n, (ids, labels) in enumerate(examples):
            assert len(ids) == len(labels), "an expanded example's ids and labels differ in length"
            out["images"].append(batch["images"][j] if n == 0 else [])
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["attention_mask"].append([1] * len(ids))
            out["num_tokens"].append(len(ids))
            for k in carried:
                out[k].append(batch[k][j])
    return out


def expanded_count(ds: datasets.Dataset) -> int:
    """Extra examples held in ``ds`` (the lengths of its ``expanded_labels`` lists, read in Arrow)."""
    column = ds.select_columns(["expanded_labels"]).with_format("arrow")[:]["expanded_labels"]
    return int(pc.sum(pc.list_value_length(column)).as_py() or 0)


def explode_examples(kept: datasets.Dataset) -> tuple[datasets.Dataset, int]:
    """Kept rows -> one row per example: a row with k extra examples (``reasoning_history: expand``) becomes
    1 + k rows, its primary example first, with its other columns copied; the ``expanded_*`` columns go.

    Returns the dataset and the number of rows added. Runs after the eval split, so that one conversation's
    examples never land on both sides.
    """
    expanded = list(SFT_ROW.expanded_columns)
    if expanded_count(kept) == 0:
        return kept.remove_columns(expanded), 0
    features = datasets.Features({k: v for k, v in kept.features.items() if k not in expanded})
    out = kept.map(_explode, batched=True, remove_columns=expanded, features=features,
                   desc="one row per example (reasoning_history: expand)")
    return out, len(out) - len(kept)


def _normalised_weights(sources: list[DatasetSource]) -> dict[str, float]:
    total = sum(s.weight for s in sources)
    return {source_label(i, s): s.weight / total for i, s in enumerate(sources)}


def mix_sources(train: datasets.Dataset, cfg: DataConfig, report: DatasetReport) -> datasets.Dataset:
    """Weighted sources -> interleaved by probability (``data.mixing``); unweighted -> as concatenated."""
    report.rows_per_source_before_mixing = dict(Counter(train["source"][:]))
    weighted = len(cfg.datasets) > 1 and all(s.weight is not None for s in cfg.datasets)
    if weighted:
        weights = _normalised_weights(cfg.datasets)
        empty = [label for label in weights if not report.rows_per_source_before_mixing.get(label)]
        for label in empty:
            log.warning("mixing: source %s has no training rows left; its weight is left out", label)
        weights = {k: w / sum(w for k2, w in weights.items() if k2 not in empty)
                   for k, w in weights.items() if k not in empty}
        report.mixing_weights = weights
        log.info("mixing weights normalised to sum 1: %s (stopping strategy %s, seed %d)",
                 ", ".join(f"{k}={w:.3f}" for k, w in weights.items()), cfg.mixing.stopping_strategy, cfg.mixing.seed)
        parts = [train.filter(lambda s, label=label: [x == label for x in s], input_columns=["source"],
                              batched=True, desc=f"selecting {label}") for label in weights]
        if len(parts) > 1:
            train = datasets.interleave_datasets(parts, probabilities=list(weights.values()), seed=cfg.mixing.seed,
                                                 stopping_strategy=cfg.mixing.stopping_strategy)
    report.rows_per_source_after_mixing = dict(Counter(train["source"][:]))
    return train


def _domain_stats(kept: datasets.Dataset) -> dict[str, dict[str, int]]:
    cols = kept.select_columns(["domain", "num_tokens", "num_trained_tokens"]).to_dict()
    out: dict[str, dict[str, int]] = {}
    for d, n, t in zip(cols["domain"], cols["num_tokens"], cols["num_trained_tokens"]):
        stats = out.setdefault(d, {"rows": 0, "tokens": 0, "trained_tokens": 0})
        stats["rows"] += 1
        stats["tokens"] += n
        stats["trained_tokens"] += t
    return out


def no_eval_line(cfg: DataConfig, kept: int) -> str:
    """The one line a run whose eval split came out empty says: it trains without evaluation (docs/training.md)."""
    if cfg.eval_datasets:
        why = "no row of data.eval_datasets was kept (their drops: eval_dropped in dataset_report.json)"
    else:
        why = (f"data.eval_fraction {cfg.eval_fraction} of {kept} kept row{'s' if kept != 1 else ''} leaves no row "
               "for one side of the split")
    return f"no eval split: {why}; training without evaluation"


def _kept_rows(processed: datasets.Dataset) -> datasets.Dataset:
    return processed.filter(lambda r: [not x for x in r], input_columns=["drop_reason"], batched=True,
                            desc="dropping refused rows")


def build_datasets(cfg: DataConfig, tokenizer) -> tuple[datasets.Dataset, datasets.Dataset | None, DatasetReport]:
    """Config -> (train, eval or None, report). Raises ``EmptyDatasetError`` if no row survives."""
    _, processed = load_and_process(cfg, tokenizer)
    return datasets_from_processed(processed, cfg, tokenizer)


def datasets_from_processed(processed: datasets.Dataset, cfg: DataConfig, tokenizer,
                            ) -> tuple[datasets.Dataset, datasets.Dataset | None, DatasetReport]:
    """``load_and_process``'s processed rows -> (train, eval or None, report): the rest of ``build_datasets``."""
    row_type = objective(cfg).row_type
    report = summarize(processed, cfg)
    report.duplicates = report.dropped.get(DropReason.DUPLICATE, 0)
    if report.rows_kept == 0:
        if len(report.dropped) == 1 and next(iter(report.dropped)) in WRONG_KIND:
            reason = next(iter(report.dropped))
            raise WrongRowsError(f"all {report.rows_in} rows were dropped ({reason}): {WRONG_KIND[reason]}; first: "
                                 f"{report.first_dropped[reason]}")
        reasons = ", ".join(f"{r}: {n}" for r, n in report.dropped.items())
        raise EmptyDatasetError(f"all {report.rows_in} rows were dropped ({reasons}); first: "
                                + "; ".join(report.first_dropped.values()))
    carry = list(row_type.kept_columns)
    kept = _kept_rows(processed).select_columns(carry)
    if cfg.domain_key:
        report.domains = _domain_stats(_kept_rows(processed))
    eval_ds = None
    if cfg.eval_datasets:
        _, eval_processed = load_and_process_sources(cfg.eval_datasets, cfg, tokenizer)
        report.eval_dropped = summarize(eval_processed, cfg).dropped
        eval_ds = _kept_rows(eval_processed).select_columns(carry)
    elif cfg.eval_fraction > 0 and math.ceil(cfg.eval_fraction * len(kept)) < len(kept):  # a row on each side
        split = kept.train_test_split(test_size=cfg.eval_fraction, seed=cfg.shuffle_seed)
        kept, eval_ds = split["train"], split["test"]
    if (cfg.eval_datasets or cfg.eval_fraction > 0) and not (eval_ds is not None and len(eval_ds)):
        log.warning(no_eval_line(cfg, len(kept)))
        eval_ds = None
    # examples and blocks after the split, so that one conversation or long text never lands on both sides
    # (only SFT rows have them: a pair's num_tokens count both sides, each within max_length already)
    if row_type.expanded_columns:
        kept, _ = explode_examples(kept)
        kept, report.text_blocks_added = split_long_texts(kept, cfg.max_length)
        if eval_ds is not None:
            eval_ds, _ = split_long_texts(explode_examples(eval_ds)[0], cfg.max_length)
    train = mix_sources(kept, cfg, report)
    if cfg.shuffle:
        train = train.shuffle(seed=cfg.shuffle_seed)
    if cfg.max_samples is not None and len(train) > cfg.max_samples:
        train = train.select(range(cfg.max_samples))
    fed = list(row_type.model_columns)
    train = train.select_columns(fed)
    eval_ds = eval_ds.select_columns(fed) if eval_ds is not None else None
    report.train_rows, report.eval_rows = len(train), len(eval_ds) if eval_ds is not None else 0
    for reason, n in report.dropped.items():
        log.warning("dropped %d rows: %s (first: %s)", n, reason, report.first_dropped[reason])
    return train, eval_ds, report
