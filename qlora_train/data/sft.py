"""The SFT pipeline (``data.objective: sft``): a batch of raw rows -> ``processed.SFT_ROW`` columns, one row each.

A chat row: parse (``parse.canonicalize_row``: messages marked by the ``LossPolicy``) -> the filters (``min_chars``
/ ``max_chars``, the dedup hash) -> its rendered example (``masking.render_example``: with ``reasoning_history:
expand``, its extra examples) -> ``data.rule_check`` on a sample -> the batch's one tokenizer call
(``masking.finish_examples``) -> fit to ``max_length`` (``truncate.structured_truncate_messages``) -> labels
(``MaskedConversation.example``). ``segments`` and ``text`` rows skip the template (``formats``) and join at the
tokenizer call (``masking.text_example``); ``pretokenized`` rows have their tokens (``masking.token_example``).
Plain ``text`` rows keep all their tokens here (``formats.split_into_blocks`` cuts them later).

No exception from a row escapes: a row refused, or failing unexpectedly, gets its ``drop_reason`` and
``drop_detail`` (``rows.Batch.refuse``).
"""

from __future__ import annotations

import numpy as np

from qlora_train.config import DataConfig
from qlora_train.data import rule_check
from qlora_train.data.drops import DropReason
from qlora_train.data.formats import plain_text_and_mask, pretokenized_ids_and_mask, segments_text_and_mask
from qlora_train.data.parse import CHAT_SCHEMAS, ParseReport, canonicalize_row, map_fields, resolve_schema
from qlora_train.data.processed import SFT_ROW
from qlora_train.data.rows import Batch, check_length, content_chars, content_hash, guarded, report_json, too_long
from qlora_train.data.truncate import structured_truncate_messages
from qlora_train.masking import (
    DISAGREE,
    IGNORE_INDEX,
    MaskedConversation,
    RenderedExample,
    RowRejected,
    count_tokens,
    finish_examples,
    image_rule,
    message_images,
    render_example,
    text_example,
    token_example,
    tool_block,
)


def process_sft_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None,
                     positions: list[int] | None = None, texts: list[str] | None = None) -> dict[str, list]:
    """A batch of raw rows -> ``SFT_ROW``'s pipeline columns (``rows.Batch.of`` says what the keywords name)."""
    b = Batch.of(batch, SFT_ROW, tokenizer, cfg, locations=locations, positions=positions, texts=texts)
    waiting: list[tuple[int, RenderedExample, int | None]] = []  # (row, its example, the max_length it fits)
    reports: dict[int, ParseReport] = {}  # chat rows: written after the batch (tokens add to them)
    dropped_reasoning: list[tuple[int, str]] = []  # (row, reasoning trained without being rendered)

    def render(i: int, row) -> None:
        schema = guarded(resolve_schema, row, cfg) if isinstance(row, (dict, list)) else "unknown"
        if schema in CHAT_SCHEMAS or schema == "unknown":
            example = _chat_example(b, i, row, tokenizer, reports)
            dropped_reasoning.extend((i, example.messages[j]["reasoning_content"]) for j in example.reasoning_dropped)
            waiting.append((i, example, cfg.max_length))
            return
        b.outs[i]["parse_report"] = report_json(ParseReport(schema, {schema: 1}, rows=1))
        text, mask = guarded(_template_free, row, schema, tokenizer, cfg)
        if cfg.dedup:
            b.outs[i]["content_hash"] = guarded(content_hash, [schema, text, mask.tolist()])
        if schema == "pretokenized":
            guarded(_fill, b.outs[i], guarded(token_example, text, mask), cfg, max_length=cfg.max_length)
        else:  # text rows keep every token: they are cut into blocks, not truncated
            waiting.append((i, text_example(text, mask), None if schema == "text" else cfg.max_length))

    b.each(render)
    finished = finish_examples([example for _, example, _ in waiting], tokenizer)
    for (i, example, max_length), masked in zip(waiting, finished):
        try:
            with b.spending[i]:  # truncation renders again
                if isinstance(masked, RowRejected):
                    raise masked
                if i in reports:
                    _chat_row(b, i, masked, reports[i], tokenizer, counted=example.extra_left_out)
                else:
                    guarded(_fill, b.outs[i], masked, cfg, max_length=max_length)
        except RowRejected as rej:
            b.refuse(i, rej)
    for (i, _), n in zip(dropped_reasoning, count_tokens([r for _, r in dropped_reasoning], tokenizer)):
        reports[i].reasoning_dropped_tokens += n
    for i, report in reports.items():
        b.outs[i]["parse_report"] = report_json(report)
    return b.columns()


def _chat_example(b: Batch, i: int, row, tokenizer, reports: dict[int, ParseReport]) -> RenderedExample:
    """A chat row -> its rendered example (checked against the rule where selected); its report in ``reports``,
    also for a row refused after its parse."""
    cfg = b.cfg
    canon = guarded(canonicalize_row, row, cfg, tokenizer=tokenizer, policy=b.policy, spending=b.spending[i])
    reports[i] = canon.report
    check_length(content_chars(canon.messages), cfg)
    if cfg.dedup:
        b.outs[i]["content_hash"] = guarded(content_hash, [canon.messages, canon.tools])
    example = guarded(render_example, canon.messages, tokenizer, tools=canon.tools, policy=b.policy, layout=b.layout,
                      expand=b.policy.reasoning_history == "expand")
    _count_render(canon.report, example)
    if b.checked(i):
        examples = [(ex.messages, ex.tools, ex.rendered) for ex in (example, *example.extra)]
        rule_check.check_encoder(canon.report, [rendered for _, _, rendered in examples], tokenizer)
        check = guarded(rule_check.check_examples, examples, tokenizer, policy=b.policy, layout=b.layout)
        rule_check.count(canon.report, check)
        if check.outcome == DISAGREE:
            raise rule_check.refusal(check)
    return example


def _count_render(report: ParseReport, example: RenderedExample) -> None:
    """What the template did with the row into its report: messages it does not write, the rule's prefix renders,
    reasoning moved to extra examples (``reasoning_history: expand``) or trained without being rendered."""
    rendered = example.rendered
    for role in rendered.unrendered:
        report.unrendered_messages[role] = report.unrendered_messages.get(role, 0) + 1
    if rendered.verified_by == "prefix_renders":
        report.verified_by_prefix_renders = 1
        report.prefix_renders = rendered.renders
    if example.reasoning_moved:
        report.reasoning_expanded_turns = len(example.reasoning_moved)
        report.expanded_examples = len(example.extra)
    if example.reasoning_dropped or example.extra_left_out:
        report.reasoning_dropped_rows = 1
        report.reasoning_dropped_turns = len(example.reasoning_dropped) + example.extra_left_out


def _chat_row(b: Batch, i: int, masked: MaskedConversation, report: ParseReport, tokenizer, *, counted: int
              ) -> None:
    """A chat row's finished example -> its columns, with its extra examples (one refused is left out: its turns,
    untrained in the full conversation, are then trained nowhere, and counted under ``reasoning_dropped_turns``;
    ``counted``: the turns left out before, already in the report)."""
    out = b.outs[i]
    guarded(_fit_chat, out, masked, b, tokenizer)
    left_out = masked.extra_left_out - counted
    for extra in masked.extra:
        ex = b.row_type.empty()
        try:
            guarded(_fit_chat, ex, extra, b, tokenizer)
        except RowRejected:
            left_out += len(extra.rendered.turns)
            continue
        out["expanded_input_ids"].append(ex["input_ids"])
        out["expanded_labels"].append(ex["labels"])
        out["expanded_tokens"] += ex["num_tokens"]
        out["expanded_trained_tokens"] += ex["num_trained_tokens"]
    if left_out:
        report.reasoning_dropped_rows = 1
        report.reasoning_dropped_turns += left_out


def _fit_chat(out: dict, masked: MaskedConversation, b: Batch, tokenizer) -> None:
    """A chat example -> ``out`` filled with it, truncated as configured (``data.on_too_long``)."""
    cfg = b.cfg
    out["num_tokens_before"] = masked.num_tokens
    if masked.tools:
        with_system = bool(masked.messages) and masked.messages[0]["role"] == "system"
        out["tool_schema_tokens"] = tool_schema_tokens(masked, tokenizer, with_system)
    if masked.num_tokens > cfg.max_length:
        if cfg.on_too_long == "drop":
            raise too_long(masked.num_tokens, cfg)
        tr = structured_truncate_messages(masked.messages, tokenizer, max_length=cfg.max_length, tools=masked.tools,
                                          measured=masked, policy=b.policy)
        masked = tr.final
        out["dropped_turns"] = tr.dropped_turns
        out["reasoning_trimmed_tokens"] = tr.reasoning_trimmed_tokens
    images = message_images(masked.messages)
    if images:  # an image's tokens are never cut: a row whose kept turns do not fit is refused
        if masked.num_tokens > cfg.max_length:
            raise RowRejected(DropReason.TOO_LONG, f"{masked.num_tokens} tokens > max_length={cfg.max_length} with "
                              f"{len(images)} image(s) in the turns kept: images are never cut")
        rule = image_rule(tokenizer)
        out["images"] = [im["ref"] for im in images]
        out["num_images"] = len(images)
        out["num_image_tokens"] = masked.input_ids.count(rule.image_token_id)
    _labels(out, masked, cfg, max_length=cfg.max_length)
    if images and rule.image_token_id in out["labels"]:  # cannot happen (expand_images): checked, not trusted
        raise RowRejected(DropReason.MASK_UNVERIFIED, "an image token is trained")


def tool_schema_tokens(masked: MaskedConversation, tokenizer, with_system: bool) -> int:
    """Tokens of a render's tool block (``layout.ToolBlock``: the schemas and the template's text around them),
    read off the render's own token offsets; -1 when the block is not where the probe says it is."""
    block = tool_block(tokenizer, with_system)
    span = block.span(masked.text) if block is not None else None
    if span is None:
        return -1
    return masked.offsets.count_starting_in(*span, len(masked.text))


def _fill(out: dict, masked: MaskedConversation, cfg: DataConfig, *, max_length: int | None) -> None:
    """A segments / text / pretokenized row's tokens -> ``out`` filled (a token-level cut only: no messages)."""
    out["num_tokens_before"] = masked.num_tokens
    if max_length is not None and masked.num_tokens > max_length and cfg.on_too_long == "drop":
        raise too_long(masked.num_tokens, cfg)
    _labels(out, masked, cfg, max_length=max_length)


def _labels(out: dict, masked: MaskedConversation, cfg: DataConfig, *, max_length: int | None) -> None:
    if max_length is not None and masked.num_tokens > max_length:
        out["token_fallback"] = cfg.truncate_side
    example = masked.example(max_length=max_length, truncate_side=cfg.truncate_side)
    n_trained = len(example["labels"]) - example["labels"].count(IGNORE_INDEX)
    out["straddling_tokens"] = masked.token_mask.straddling
    if n_trained == 0:
        raise RowRejected(DropReason.NO_TRAINED_TOKEN, f"no trained token left within max_length={max_length}")
    out.update(example, num_tokens=len(example["input_ids"]), num_trained_tokens=n_trained)


def _template_free(row, schema: str, tokenizer, cfg: DataConfig) -> tuple[str | list[int], np.ndarray]:
    """A segments/text row -> (text, char mask); a pretokenized row -> (ids, token mask)."""
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"schema {schema} needs a mapping, got {type(row).__name__}")
    row = map_fields(row, cfg.field_mappings)
    if schema == "pretokenized":
        return pretokenized_ids_and_mask(row, vocab_size=len(tokenizer))
    text, mask = segments_text_and_mask(row) if schema == "segments" else plain_text_and_mask(
        row, eos_token=tokenizer.eos_token)
    check_length(len(text) - (len(tokenizer.eos_token) if schema == "text" else 0), cfg)
    return text, mask
