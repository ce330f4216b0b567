"""All stages composed: raw rows -> training examples, or a drop reason per row.

``process_rows(rows, tokenizer, data_config)`` returns the columns of ``processed.PROCESSED_ROW`` written by
the pipeline, one entry per input row.

Works on a batch (a dict of columns as ``datasets.map(batched=True)`` hands it,
or a list of row dicts) so the tokenizer is called once per batch. Every row
comes out: kept rows have tokens, dropped rows have ``drop_reason`` set and
empty token lists, to be counted and then filtered.

Chat schemas go parse (1) -> render (2) -> tokenize (3: the render cut where each trained turn's generated part
begins, ``masking.encode_rendered``) -> truncate (4) -> ``make_labels``;
``segments`` and ``text`` rows skip the template (``formats``) and join at
tokenize; ``pretokenized`` rows join at ``make_labels``. Plain ``text`` rows
keep all their tokens here (``formats.split_into_blocks`` cuts them later).
With ``data.objective: preference`` every row is a pair (``_pair_row``): the
``chosen_*`` / ``rejected_*`` columns are written instead of the SFT ones. With
``data.objective: unpaired`` (KTO) every row is a prompt, one completion and its
label (``_unpaired_row``): the SFT columns hold its sequence, with ``prompt_length``
and ``desirable``.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from qlora_train.config import DataConfig
from qlora_train.data import rule_check
from qlora_train.data.drops import DropReason
from qlora_train.data.expand import expand_dropped_reasoning
from qlora_train.data.formats import (
    plain_text_and_mask,
    pretokenized_ids_and_mask,
    segments_text_and_mask,
    token_offsets,
)
from qlora_train.data.pairs import SIDES, canonicalize_pair, check_score_margin, fit_pair, side_lengths, trained_tokens
from qlora_train.data.parse import CHAT_SCHEMAS, ParseReport, canonicalize_row, map_fields, resolve_schema
from qlora_train.data.processed import OUTPUT_COLUMNS, empty_output
from qlora_train.data.truncate import Measured, structured_truncate_messages
from qlora_train.data.unpaired import canonicalize_unpaired, fit_unpaired
from qlora_train.masking import (
    DISAGREE,
    IGNORE_INDEX,
    LossPolicy,
    RenderedConversation,
    RowBudget,
    RowRejected,
    RowSpending,
    check_unicode,
    count_tokens,
    encode_rendered,
    make_labels,
    project_char_mask,
    render_conversation,
    template_layout,
    tool_block,
)


def _rows(batch: dict[str, list] | list[dict]) -> list[dict]:
    if isinstance(batch, list):
        return batch
    keys = list(batch)
    n = len(batch[keys[0]]) if keys else 0
    return [{k: batch[k][i] for k in keys} for i in range(n)]


_REPORT_DEFAULTS = vars(ParseReport())


def _report_json(report: ParseReport) -> str:
    """A row's ParseReport as JSON, only the fields that differ from the defaults (``ParseReport.from_dict``
    restores the rest): most rows touch two or three fields, so this is a fraction of ``to_dict()``."""
    return json.dumps({k: v for k, v in vars(report).items() if v != _REPORT_DEFAULTS[k]})


def describe_exception(exc: BaseException, limit: int = 200) -> str:
    """An unexpected exception -> one short line naming its type (rows can hold huge strings)."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg[:limit] + '…' if len(msg) > limit else msg}"


def guarded(stage, *args, **kwargs):
    """Run one stage for one row: any exception becomes a ``RowRejected`` (``bad_row``), never a crash, with the
    exception's traceback (``RowRejected.traceback``, the row's ``error_traceback``): counted like a bad row, but
    a bug in our code, so ``dataset.check_unexpected_errors`` shows the first one and stops a run where they
    exceed 1% of the rows.

    >>> guarded(int, "x")
    Traceback (most recent call last):
    ...
    qlora_train.masking.messages.RowRejected: bad_row: unexpected ValueError: invalid literal for int() with base ...
    """
    try:
        return stage(*args, **kwargs)
    except RowRejected:
        raise
    except Exception as exc:  # a bug or an input nobody foresaw: counted with its location and traceback
        raise RowRejected(DropReason.BAD_ROW, f"unexpected {describe_exception(exc)}",
                          traceback="".join(traceback.format_exception(exc))) from exc


def _encode_each(renders: list, tokenizer) -> list[tuple[list[int], np.ndarray] | RowRejected]:
    """``encode_rendered`` (renders, or template-free texts), falling back to one at a time so one bad text cannot
    fail the batch."""
    try:
        return encode_rendered(renders, tokenizer)
    except Exception:
        out = []
        for render in renders:
            try:
                out.append(guarded(encode_rendered, [render], tokenizer)[0])
            except RowRejected as rej:
                out.append(rej)
        return out


def _too_long(n: int, cfg: DataConfig) -> RowRejected:
    return RowRejected(DropReason.TOO_LONG, f"{n} tokens > max_length={cfg.max_length} (data.on_too_long: drop)")


class _Staged(NamedTuple):
    """A rendered chat example waiting for the batch's one tokenizer call."""

    row: int  # index of its row in the batch
    messages: list
    tools: list | None
    rendered: RenderedConversation
    extra: bool = False  # an extra example of reasoning_history: expand (rides in its row's expanded_* columns)


def _example(messages, tools, rendered, ids, offsets, *, tokenizer, cfg: DataConfig, policy: LossPolicy,
             out: dict) -> None:
    """One rendered + tokenized chat example -> ``out`` filled with it (truncated as configured)."""
    out["num_tokens_before"] = len(ids)
    if tools:
        with_system = bool(messages) and messages[0]["role"] == "system"
        out["tool_schema_tokens"] = tool_schema_tokens(rendered.text, offsets, tokenizer, with_system)
    char_mask = rendered.char_mask
    if len(ids) > cfg.max_length:
        if cfg.on_too_long == "drop":
            raise _too_long(len(ids), cfg)
        tr = structured_truncate_messages(
            messages, tokenizer, max_length=cfg.max_length, tools=tools,
            measured=Measured(rendered, ids, offsets), policy=policy,
        )
        ids, offsets, char_mask = tr.final.input_ids, tr.final.offsets, tr.final.rendered.char_mask
        out["dropped_turns"] = tr.dropped_turns
        out["reasoning_trimmed_tokens"] = tr.reasoning_trimmed_tokens
        if tr.needs_token_fallback:
            out["token_fallback"] = cfg.truncate_side
    _labels(out, ids, offsets, char_mask, cfg, max_length=cfg.max_length)


def tool_schema_tokens(text: str, offsets, tokenizer, with_system: bool) -> int:
    """Tokens of a render's tool block (``layout.ToolBlock``: the schemas and the template's text around them),
    read off the render's own token offsets; -1 when the block is not where the probe says it is."""
    block = tool_block(tokenizer, with_system)
    span = block.span(text) if block is not None else None
    if span is None:
        return -1
    return offsets.count_starting_in(*span, len(text))


def _template_free_example(out: dict, ids, offsets, *, mask, cfg: DataConfig, max_length: int | None) -> None:
    """A segments / text / pretokenized row's ids -> ``out`` filled (token-level cut only: no messages)."""
    out["num_tokens_before"] = len(ids)
    if max_length is not None and len(ids) > max_length:
        if cfg.on_too_long == "drop":
            raise _too_long(len(ids), cfg)
        out["token_fallback"] = cfg.truncate_side
    _labels(out, ids, offsets, mask, cfg, max_length=max_length)


def _labels(out: dict, ids, offsets, char_mask, cfg: DataConfig, *, max_length: int | None) -> None:
    token_mask = project_char_mask(offsets, char_mask)
    example = make_labels(ids, token_mask, max_length=max_length, truncate_side=cfg.truncate_side)
    n_trained = len(example["labels"]) - example["labels"].count(IGNORE_INDEX)
    out["straddling_tokens"] = token_mask.straddling
    if n_trained == 0:
        raise RowRejected(DropReason.NO_TRAINED_TOKEN, f"no trained token left within max_length={max_length}")
    out.update(example, num_tokens=len(example["input_ids"]), num_trained_tokens=n_trained)


def _hash(obj: Any) -> str:
    """Stable hash of a row's canonical content (``content_hash``, computed only with ``dedup``). A lone surrogate
    (an undecodable byte in a field the template does not write) is hashed as it is, not refused here."""
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def content_chars(messages: list[dict]) -> int:
    """Characters of content and reasoning over all messages (what ``min_chars``/``max_chars`` measure)."""
    return sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in messages)


def _check_length(n_chars: int, cfg: DataConfig) -> None:
    if n_chars < cfg.min_chars or (cfg.max_chars is not None and n_chars > cfg.max_chars):
        raise RowRejected(DropReason.FILTERED_BY_LENGTH,
                          f"{n_chars} characters, outside [{cfg.min_chars}, {cfg.max_chars or 'inf'}]")


def _template_free(row: Any, schema: str, tokenizer, cfg: DataConfig) -> tuple[str | list[int], np.ndarray]:
    """A segments/text row -> (text, char mask); a pretokenized row -> (ids, token mask)."""
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"schema {schema} needs a mapping, got {type(row).__name__}")
    row = map_fields(row, cfg.field_mappings)
    if schema == "pretokenized":
        return pretokenized_ids_and_mask(row, vocab_size=len(tokenizer))
    text, mask = segments_text_and_mask(row) if schema == "segments" else plain_text_and_mask(
        row, eos_token=tokenizer.eos_token)
    _check_length(len(text) - (len(tokenizer.eos_token) if schema == "text" else 0), cfg)
    return text, mask


def process_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None,
                 positions: list[int] | None = None, texts: list[str] | None = None) -> dict[str, list]:
    """A batch of raw rows -> columns ``OUTPUT_COLUMNS`` (one entry per input row).

    No exception from a row escapes: a stage that refuses a row, or fails on it
    unexpectedly, sets that row's ``drop_reason`` (a ``DropReason``) and
    ``drop_detail`` (its location and why); each row's work is bounded by ``data.row_budget``
    (``masking.RowSpending``: renders, characters, template steps, seconds; over it: ``over_budget``).
    ``locations`` name the rows in drop details (default: ``row <index in batch>``). ``data.rule_check`` picks rows by
    ``positions``, their indices in their source (default: in the batch), and
    ``texts``, the rows as read (default: their canonical JSON, ``rule_check.row_text``).
    """
    rows = _rows(batch)
    where = locations or [f"row {i}" for i in range(len(rows))]
    positions = positions or range(len(rows))
    outs = [empty_output() for _ in rows]
    policy = LossPolicy.of(cfg)
    budget = RowBudget(**cfg.row_budget.model_dump())
    spendings = [RowSpending(budget) for _ in rows]  # each row's, entered for each part of its work
    layout = template_layout(tokenizer)  # probed once, before the rows (facts it cannot find stay unknown)
    first = rule_check.first_rows(layout)  # data.rule_check: sample checks the first rows of a source

    def checked(i: int, row) -> bool:
        text = texts[i] if texts is not None else partial(rule_check.row_text, row)
        return rule_check.selected(cfg.rule_check, positions[i], text, first)

    def refuse(i: int, rej: RowRejected) -> None:
        if rej.reason == DropReason.OVER_BUDGET:  # also after an example of the row was filled
            outs[i].update(empty_output())
        outs[i].update(drop_reason=rej.reason, drop_detail=f"{where[i]}: {rej.detail}", error_traceback=rej.traceback)

    if cfg.objective in ("preference", "unpaired"):
        one_row = _pair_row if cfg.objective == "preference" else _unpaired_row
        for i, row in enumerate(rows):
            try:
                with spendings[i]:
                    one_row(row, tokenizer=tokenizer, cfg=cfg, policy=policy, out=outs[i], layout=layout,
                            checked=checked(i, row))
            except RowRejected as rej:
                refuse(i, rej)
        return {col: [o[col] for o in outs] for col in OUTPUT_COLUMNS}
    # (a render or a template-free text, its row, what fills the row once it is tokenized), for one call
    waiting: list[tuple[RenderedConversation | str, int, Callable]] = []
    dropped_reasoning: list[tuple[int, str]] = []  # (row index, reasoning trained without being rendered)
    reports: dict[int, ParseReport] = {}  # chat rows

    def fill(i: int, stage: Callable) -> Callable:
        """An encoding (or the RowRejected it raised) -> row ``i`` filled by ``stage(ids, offsets)``, or refused."""
        def finish(enc) -> None:
            try:
                if isinstance(enc, RowRejected):
                    raise enc
                guarded(stage, *enc)
            except RowRejected as rej:
                refuse(i, rej)
        return finish

    for i, row in enumerate(rows):
        try:
            with spendings[i]:
                schema = guarded(resolve_schema, row, cfg) if isinstance(row, (dict, list)) else "unknown"
                if schema in CHAT_SCHEMAS or schema == "unknown":
                    canon = guarded(canonicalize_row, row, cfg, tokenizer=tokenizer, policy=policy)
                    reports[i] = canon.report  # written once, after the batch (the render and tokens add to it)
                    _check_length(content_chars(canon.messages), cfg)
                    if cfg.dedup:
                        outs[i]["content_hash"] = guarded(_hash, [canon.messages, canon.tools])
                    rendered = guarded(render_conversation, canon.messages, tokenizer, tools=canon.tools,
                                       policy=policy, layout=layout)
                    check_unicode(rendered.text, rendered.message_ends)
                    staged = _stage_chat_row(i, canon, rendered, tokenizer, policy, dropped_reasoning)
                    if checked(i, row):
                        examples = [(st.messages, st.tools, st.rendered) for st in staged]
                        check = guarded(rule_check.check_examples, examples, tokenizer, policy=policy, layout=layout)
                        rule_check.count(canon.report, check)
                        if check.outcome == DISAGREE:
                            raise rule_check.refusal(check)
                    for st in staged:
                        if st.extra:  # refused alone, without refusing its row
                            finish = partial(_extra_example, st, tokenizer=tokenizer, cfg=cfg, policy=policy,
                                             out=outs[i], report=canon.report)
                        else:
                            finish = fill(i, partial(_example, st.messages, st.tools, st.rendered,
                                                     tokenizer=tokenizer, cfg=cfg, policy=policy, out=outs[i]))
                        waiting.append((st.rendered, i, finish))
                    continue
                outs[i]["parse_report"] = _report_json(ParseReport(schema, {schema: 1}, rows=1))
                text, mask = guarded(_template_free, row, schema, tokenizer, cfg)
                if cfg.dedup:
                    outs[i]["content_hash"] = guarded(_hash, [schema, text, mask.tolist()])
                if schema == "pretokenized":
                    guarded(_template_free_example, outs[i], text, token_offsets(len(text)), mask=mask, cfg=cfg,
                            max_length=cfg.max_length)
                else:  # text rows keep every token: they are cut into blocks, not truncated
                    check_unicode(text)
                    limit = None if schema == "text" else cfg.max_length
                    waiting.append((text, i, fill(i, partial(_template_free_example, outs[i], mask=mask, cfg=cfg,
                                                             max_length=limit))))
        except RowRejected as rej:
            refuse(i, rej)
    for (_, i, finish), enc in zip(waiting, _encode_each([render for render, _, _ in waiting], tokenizer)):
        if outs[i]["drop_reason"] == DropReason.OVER_BUDGET:
            continue  # an earlier example of the row went over its budget
        try:
            with spendings[i]:  # truncation renders again
                finish(enc)
        except RowRejected as rej:
            refuse(i, rej)
    for (i, _), n in zip(dropped_reasoning, count_tokens([r for _, r in dropped_reasoning], tokenizer)):
        reports[i].reasoning_dropped_tokens += n
    for i, report in reports.items():
        outs[i]["parse_report"] = _report_json(report)
    return {col: [o[col] for o in outs] for col in OUTPUT_COLUMNS}


def _pair_row(row, *, tokenizer, cfg: DataConfig, policy: LossPolicy, out: dict, layout, checked: bool = False
              ) -> None:
    """A raw preference row (``data.objective: preference``) -> ``out`` filled with its pair, or ``RowRejected``.

    ``pairs.canonicalize_pair`` -> ``data.min_score_margin`` (``check_score_margin``) -> ``min_chars`` /
    ``max_chars`` over prompt and both responses -> ``pairs.fit_pair`` (both sides within ``max_length`` and the
    per-side limits: prompt exchanges dropped, reasoning trimmed, responses cut with ``max_response_length``).
    ``num_tokens_before`` / ``num_tokens`` / ``num_trained_tokens`` / ``reasoning_trimmed_tokens`` count both
    sides; ``dropped_turns`` the prompt exchanges dropped; ``token_fallback`` names the sides whose response was
    cut (``"chosen"``, ``"rejected"``, ``"chosen,rejected"``). A pair is built with its own tokenizer call.
    ``checked`` (``data.rule_check`` selected it): both sides are checked against the rule first."""
    pair = guarded(canonicalize_pair, row, cfg, tokenizer=tokenizer)
    out["parse_report"] = _report_json(pair.report)  # a pair refused from here on is counted as parsed
    check_score_margin(pair, cfg.min_score_margin)
    _check_length(content_chars(pair.prompt + pair.chosen + pair.rejected), cfg)
    check = guarded(rule_check.check_pair, pair, tokenizer, policy=policy, layout=layout) if checked else None
    if check is not None:
        rule_check.count(pair.report, check)
        out["parse_report"] = _report_json(pair.report)
        if check.outcome == DISAGREE:
            raise rule_check.refusal(check)
    if cfg.dedup:
        out["content_hash"] = guarded(_hash, ["preference", pair.prompt, pair.chosen, pair.rejected, pair.tools])
    fitted = guarded(fit_pair, pair, tokenizer, max_length=cfg.max_length, policy=policy,
                     on_too_long=cfg.on_too_long, max_prompt_length=cfg.max_prompt_length,
                     max_response_length=cfg.max_response_length)
    ex = fitted.example
    if ex["reasoning_dropped_turns"]:
        pair.report.reasoning_dropped_rows = 1
        pair.report.reasoning_dropped_turns = ex["reasoning_dropped_turns"]
    lengths = side_lengths(ex)
    out.update({f"{side}_{key}": ex[f"{side}_{key}"] for side in SIDES for key in ("input_ids", "labels")})
    out.update(prompt_length=ex["prompt_length"], chosen_tokens=lengths["chosen"],
               rejected_tokens=lengths["rejected"], num_tokens_before=fitted.tokens_before,
               num_tokens=sum(lengths.values()), num_trained_tokens=trained_tokens(ex),
               dropped_turns=fitted.dropped_turns, reasoning_trimmed_tokens=fitted.reasoning_trimmed_tokens,
               token_fallback=",".join(fitted.cut_sides), parse_report=_report_json(pair.report))


def _unpaired_row(row, *, tokenizer, cfg: DataConfig, policy: LossPolicy, out: dict, layout, checked: bool = False
                  ) -> None:
    """A raw unpaired row (``data.objective: unpaired``, KTO) -> ``out`` filled with its sequence, or
    ``RowRejected``.

    ``unpaired.canonicalize_unpaired`` -> ``min_chars`` / ``max_chars`` over prompt and completion ->
    ``unpaired.fit_unpaired`` (within ``max_length``, ``max_prompt_length``, ``max_response_length``). The SFT
    columns hold the sequence (the completion trained); ``prompt_length`` its prompt's tokens, ``desirable`` its
    label; ``dropped_turns`` the prompt exchanges dropped; ``token_fallback`` is ``"right"`` where the completion
    was cut. ``checked`` (``data.rule_check`` selected it): the sequence is checked against the rule first."""
    unpaired = guarded(canonicalize_unpaired, row, cfg, tokenizer=tokenizer)
    out["parse_report"] = _report_json(unpaired.report)  # a row refused from here on is counted as parsed
    _check_length(content_chars(unpaired.prompt + unpaired.completion), cfg)
    check = guarded(rule_check.check_unpaired, unpaired, tokenizer, policy=policy, layout=layout) if checked else None
    if check is not None:
        rule_check.count(unpaired.report, check)
        out["parse_report"] = _report_json(unpaired.report)
        if check.outcome == DISAGREE:
            raise rule_check.refusal(check)
    if cfg.dedup:
        out["content_hash"] = guarded(_hash, ["unpaired", unpaired.prompt, unpaired.completion, unpaired.desirable,
                                              unpaired.tools])
    fitted = guarded(fit_unpaired, unpaired, tokenizer, max_length=cfg.max_length, policy=policy,
                     on_too_long=cfg.on_too_long, max_prompt_length=cfg.max_prompt_length,
                     max_response_length=cfg.max_response_length)
    ex = fitted.example
    if ex["reasoning_dropped_turns"]:
        unpaired.report.reasoning_dropped_rows = 1
        unpaired.report.reasoning_dropped_turns = ex["reasoning_dropped_turns"]
    out.update({key: ex[key] for key in ("input_ids", "attention_mask", "labels", "prompt_length")})
    out.update(desirable=int(unpaired.desirable), num_tokens_before=fitted.tokens_before,
               num_tokens=len(ex["input_ids"]), num_trained_tokens=len(ex["labels"]) - ex["labels"].count(IGNORE_INDEX),
               dropped_turns=fitted.dropped_turns, token_fallback="right" if ex["cut"] else "",
               parse_report=_report_json(unpaired.report))


def _stage_chat_row(i: int, canon, rendered, tokenizer, policy: LossPolicy,
                    dropped_reasoning: list[tuple[int, str]]) -> list[_Staged]:
    """A rendered chat row -> its examples to tokenize (with ``reasoning_history: expand``, also the extra
    ones), and the row's ParseReport told what the template dropped."""
    report, messages = canon.report, canon.messages
    for role in rendered.unrendered:
        report.unrendered_messages[role] = report.unrendered_messages.get(role, 0) + 1
    if rendered.verified_by == "prefix_renders":
        report.verified_by_prefix_renders = 1
        report.prefix_renders = rendered.renders
    staged = [_Staged(i, messages, canon.tools, rendered)]
    if any(t.reasoning_dropped for t in rendered.turns):
        left_out = 0  # turns of extra examples left out before they are tokenized
        if policy.reasoning_history == "expand" and policy.reasoning_history_max_examples:
            ex = guarded(expand_dropped_reasoning, messages, rendered, tokenizer, tools=canon.tools, policy=policy)
            staged = [_Staged(i, ex.messages, canon.tools, ex.primary)]
            for m, r in ex.extra:
                try:  # reasoning only an extra example writes, with a lone surrogate: left out like a refused one
                    check_unicode(r.text, r.message_ends)
                except RowRejected:
                    left_out += len(r.turns)
                    continue
                staged.append(_Staged(i, m, canon.tools, r, extra=True))
            report.reasoning_expanded_turns = len(ex.moved)
            report.expanded_examples = len(ex.extra)
            still = ex.still_dropped
        else:
            still = tuple(t.index for t in rendered.turns if t.reasoning_dropped)
        if still or left_out:
            report.reasoning_dropped_rows = 1
            report.reasoning_dropped_turns = len(still) + left_out
            dropped_reasoning += [(i, messages[j]["reasoning_content"]) for j in still]
    return staged


def _extra_example(st: _Staged, enc, *, tokenizer, cfg: DataConfig, policy: LossPolicy, out: dict,
                   report: ParseReport) -> None:
    """An extra example (``reasoning_history: expand``) -> appended to its row's ``expanded_*`` columns.

    One that is refused itself (it is verified like any example) is left out: its turns, untrained in the full
    conversation, are then trained nowhere, and are counted under ``reasoning_dropped_turns``."""
    ex = empty_output()
    try:
        if isinstance(enc, RowRejected):
            raise enc
        guarded(_example, st.messages, st.tools, st.rendered, *enc, tokenizer=tokenizer, cfg=cfg, policy=policy,
                out=ex)
    except RowRejected:
        report.reasoning_dropped_rows = 1
        report.reasoning_dropped_turns += len(st.rendered.turns)
        return
    out["expanded_input_ids"].append(ex["input_ids"])
    out["expanded_labels"].append(ex["labels"])
    out["expanded_tokens"] += ex["num_tokens"]
    out["expanded_trained_tokens"] += ex["num_trained_tokens"]
