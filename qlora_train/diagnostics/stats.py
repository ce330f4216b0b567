"""``--stats-only``: length and masking statistics of the processed dataset, per source and overall.

``compute_stats(processed_columns, max_length=2048)`` returns overall and per-source statistics in which every row
is accounted for: ``rows_in == rows_kept + sum(dropped.values())``.

Everything is computed from the columns ``process_rows`` writes (the same
rows training would see); nothing here loads model weights. Percentiles are
nearest-rank: ``p50`` is a length some row really has, the smallest with at
least half the rows at or below it.
"""

from __future__ import annotations

import copy
import io
import json
import math
import re
from collections import Counter

import numpy as np

from qlora_train.config import DataConfig
from qlora_train.data.dataset import DatasetReport, labels_line, summarize_columns, system_conflict_line
from qlora_train.data.drops import DropReason
from qlora_train.data.parse import canonicalize_row
from qlora_train.files import write_atomic
from qlora_train.masking import SIDES, render_text
from qlora_train.tokenizer import NO_NEW_TOKENS, NewTokens, template_markers, token_count

PERCENTILES = (25, 50, 75, 90, 95, 99)

# advice thresholds (docs/diagnostics.md explains each)
AT_MAX_SHARE = 0.30
UNDER_QUARTER_SHARE = 0.50
TOOL_SCHEMA_SHARE = 0.20
IMAGE_SHARE = 0.50  # image tokens of a row with images, as a share of max_length (its median)


def percentiles(values) -> dict[str, int | None]:
    """Nearest-rank percentiles and max: ``[1, 2, 3, 4]`` -> ``{"p25": 1, "p50": 2, "p75": 3, …, "max": 4}``."""
    arr = np.sort(np.asarray(values, dtype=np.int64))
    out: dict[str, int | None] = {}
    for p in PERCENTILES:
        out[f"p{p}"] = int(arr[max(math.ceil(p / 100 * len(arr)), 1) - 1]) if len(arr) else None
    out["max"] = int(arr[-1]) if len(arr) else None
    return out


def _share(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0


def reasoning_stats(cols: dict[str, list], report: DatasetReport) -> dict:
    """What the chat template did with the reasoning of kept rows, and the extra examples ``expand`` made.

    Counts are over kept rows: turns trained without their reasoning (the template does not render it) and its
    tokens, turns trained with it in an extra example, and the extra examples (rows with any, their tokens and
    trained tokens, examples per row = 1 + extra ones).
    """
    per_row = [json.loads(p).get("expanded_examples", 0)
               for p, n, reason in zip(cols["parse_report"], cols.get("expanded_tokens", ()), cols["drop_reason"])
               if n and not reason]
    rows = report.rows_kept
    return {
        "reasoning_dropped_rows": report.reasoning_dropped_rows,
        "reasoning_dropped_turns": report.reasoning_dropped_turns,
        "reasoning_dropped_tokens": report.reasoning_dropped_tokens,
        "reasoning_expanded_turns": report.reasoning_expanded_turns,
        "expanded_rows": len(per_row),
        "expanded_examples": report.expanded_examples,
        "expanded_tokens": report.expanded_tokens,
        "expanded_trained_tokens": report.expanded_trained_tokens,
        "examples_per_row": {"mean": _share(rows + report.expanded_examples, rows),
                             "max": (1 + max(per_row, default=0)) if rows else None},
    }


def pair_stats(cols: dict[str, list]) -> dict:
    """Preference pairs (``data.objective: preference``): the shared prompt's tokens, each side's response tokens
    (its tokens after the shared prompt), the longer side, truncation, and refused pairs by reason.

    A pair is over its limits when a side is over ``max_length`` (or its response over ``max_response_length``,
    its prompt over ``max_prompt_length``): ``share_over_max_length`` is of the pairs that got as far as being
    measured (kept, or refused as ``too_long``); ``truncated_pairs`` are the kept ones truncated in any way."""
    kept = [i for i, r in enumerate(cols["drop_reason"]) if not r]
    prompt = [cols["prompt_length"][i] for i in kept]
    sides = {side: [cols[f"{side}_tokens"][i] for i in kept] for side in SIDES}
    truncated = sum(1 for i in kept if cols["dropped_turns"][i] or cols["reasoning_trimmed_tokens"][i]
                    or cols["cut_sides"][i])
    cut = Counter(side for i in kept for side in cols["cut_sides"][i].split(",") if side)
    refused = Counter(r for r in cols["drop_reason"] if r)
    measured = len(kept) + refused.get(DropReason.TOO_LONG, 0)
    return {
        "pairs_kept": len(kept),
        "prompt_tokens": percentiles(prompt),
        **{f"{side}_response_tokens": percentiles([n - p for n, p in zip(lengths, prompt)])
           for side, lengths in sides.items()},
        "longer_side_tokens": percentiles([max(c, r) for c, r in zip(*sides.values())]),
        "truncated_pairs": truncated,
        "prompt_exchanges_dropped": int(sum(cols["dropped_turns"][i] for i in kept)),
        "reasoning_trimmed_pairs": sum(1 for i in kept if cols["reasoning_trimmed_tokens"][i]),
        "reasoning_tokens_trimmed": int(sum(cols["reasoning_trimmed_tokens"][i] for i in kept)),
        "responses_cut": {side: cut.get(side, 0) for side in SIDES},
        "too_long": refused.get(DropReason.TOO_LONG, 0),
        "share_over_max_length": _share(truncated + refused.get(DropReason.TOO_LONG, 0), measured),
        "refused": dict(sorted(refused.items(), key=lambda kv: -kv[1])),
    }


def prompt_stats(cols: dict[str, list], *, limit: int, max_length: int) -> dict:
    """Prompt rows (``data.objective: prompt``, GRPO): the prompts' tokens against their limit
    (``data.max_prompt_length``: ``max_length - rl.max_completion_length`` under ``train.method: grpo``), what the
    generation prompt adds to each,
    the prompts truncated (middle exchanges dropped) or refused as ``too_long``.

    >>> s = prompt_stats({"drop_reason": ["", "", "too_long"], "num_tokens": [10, 30, 0], "num_tokens_before":
    ...                   [10, 40, 80], "dropped_turns": [0, 1, 0], "generation_prompt_tokens": [3, 3, 0]},
    ...                  limit=32, max_length=64)
    >>> s["prompt_tokens"]["max"], s["truncated_prompts"], s["too_long"], round(s["share_over_limit"], 3)
    (30, 1, 1, 0.667)
    """
    kept = [i for i, r in enumerate(cols["drop_reason"]) if not r]
    too_long = sum(1 for r in cols["drop_reason"] if r == DropReason.TOO_LONG)
    truncated = sum(1 for i in kept if cols["dropped_turns"][i])
    measured = len(kept) + too_long
    return {
        "prompts_kept": len(kept),
        "limit": limit,
        "completion_room": max_length - limit,
        "prompt_tokens": percentiles([cols["num_tokens"][i] for i in kept]),
        "prompt_tokens_before_truncation": percentiles([n for n in cols["num_tokens_before"] if n > 0]),
        "generation_prompt_tokens": percentiles([cols["generation_prompt_tokens"][i] for i in kept]),
        "truncated_prompts": truncated,
        "exchanges_dropped": int(sum(cols["dropped_turns"][i] for i in kept)),
        "too_long": too_long,
        "share_over_limit": _share(truncated + too_long, measured),
    }


def share_percentiles(values) -> dict[str, float | None]:
    """Nearest-rank percentiles, max and mean of shares (floats): ``[0.5, 0.25]`` -> ``{"p25": 0.25, "p50":
    0.25, …, "max": 0.5, "mean": 0.375}``."""
    arr = np.sort(np.asarray(values, dtype=np.float64))
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        out[f"p{p}"] = float(arr[max(math.ceil(p / 100 * len(arr)), 1) - 1]) if len(arr) else None
    out["max"] = float(arr[-1]) if len(arr) else None
    out["mean"] = float(arr.mean()) if len(arr) else None
    return out


def image_stats(cols: dict[str, list], *, max_length: int) -> dict | None:
    """A vision-language run's images (``num_images`` / ``num_image_tokens``), over the kept rows that have any:
    images and image tokens per row, the image tokens' share of ``max_length`` and of the row's tokens, and the
    rows refused as ``bad_image``. ``None`` when no row has an image or was refused for one (a text run).

    >>> s = image_stats({"drop_reason": ["", "", "", "bad_image"], "num_images": [1, 3, 0, 0],
    ...                  "num_image_tokens": [64, 128, 0, 0], "num_tokens": [100, 200, 10, 0]}, max_length=256)
    >>> s["rows_with_images"], s["images_per_row"]["max"], s["image_tokens_per_row"]["p50"], s["bad_image"]
    (2, 3, 64, 1)
    >>> s["share_of_max_length"]["mean"], s["share_of_row_tokens"]["p50"]
    (0.375, 0.64)
    """
    if "num_images" not in cols:
        return None
    kept = [i for i, (r, n) in enumerate(zip(cols["drop_reason"], cols["num_images"])) if not r and n]
    bad = sum(1 for r in cols["drop_reason"] if r == DropReason.BAD_IMAGE)
    if not kept and not bad:
        return None
    images = [cols["num_images"][i] for i in kept]
    tokens = [cols["num_image_tokens"][i] for i in kept]
    return {
        "rows_with_images": len(kept),
        "images": int(sum(images)),
        "image_tokens": int(sum(tokens)),
        "images_per_row": percentiles(images),
        "image_tokens_per_row": percentiles(tokens),
        "share_of_max_length": share_percentiles([n / max_length for n in tokens]),
        "share_of_row_tokens": share_percentiles([n / cols["num_tokens"][i] for n, i in zip(tokens, kept)]),
        "bad_image": bad,
    }


def group_stats(cols: dict[str, list], *, max_length: int, tool_tokens: dict[int, int] | None = None,
                pairs: bool = False, prompt_limit: int | None = None) -> dict:
    """Statistics of one group of processed rows (its row type's ``stats_columns``); with ``pairs`` (preference
    rows) also ``pairs`` (``pair_stats``), whose over-``max_length`` share the length advice reads; prompt rows (GRPO)
    also ``prompts`` (``prompt_stats`` against ``prompt_limit``, default ``max_length``)."""
    report = summarize_columns(cols)
    kept = np.array([not r for r in cols["drop_reason"]], dtype=bool)
    before = np.asarray(cols["num_tokens_before"], dtype=np.int64)
    tokenized = before[before > 0]  # rows that got as far as tokenization (kept or dropped later)
    after = np.asarray(cols["num_tokens"], dtype=np.int64)[kept]
    trained = np.asarray(cols["num_trained_tokens"], dtype=np.int64)[kept]
    fallback = Counter(s for s in cols.get("token_fallback", ()) if s)
    tools = list((tool_tokens or {}).values())
    extra = {"pairs": pair_stats(cols)} if pairs else {}
    if "generation_prompt_tokens" in cols:  # prompt rows (GRPO): lengths against the prompt's limit
        extra["prompts"] = prompt_stats(cols, limit=prompt_limit or max_length, max_length=max_length)
    if "desirable" in cols:  # unpaired rows (KTO): the kept rows by label
        extra["labels"] = {"desirable": report.desirable_rows, "undesirable": report.rows_kept - report.desirable_rows}
    images = image_stats(cols, max_length=max_length)
    if images:  # a text run's statistics stay as they were
        extra["images"] = images
    return {
        **extra,
        "rows_in": report.rows_in,
        "rows_kept": report.rows_kept,
        "dropped": dict(sorted(report.dropped.items())),
        "first_dropped": report.first_dropped,
        "tokens_before_truncation": {"rows": int(len(tokenized)), **percentiles(tokenized)},
        "tokens_after_truncation": {"rows": int(len(after)), **percentiles(after)},
        "share_at_max_length": _share(int(np.count_nonzero(tokenized >= max_length)), len(tokenized)),
        "share_under_25pct_max_length": _share(int(np.count_nonzero(after < 0.25 * max_length)), len(after)),
        "share_under_50pct_max_length": _share(int(np.count_nonzero(after < 0.50 * max_length)), len(after)),
        "truncation": {
            "rows_turns_dropped": report.rows_turns_dropped,
            "turns_dropped": int(sum(cols["dropped_turns"])),
            "rows_reasoning_trimmed": report.rows_reasoning_trimmed,
            "reasoning_tokens_trimmed": int(sum(cols["reasoning_trimmed_tokens"])),
            "rows_token_fallback_left": fallback.get("left", 0),
            "rows_token_fallback_right": fallback.get("right", 0),
        },
        "trained_tokens": {
            "total": int(trained.sum()),
            "share_of_tokens": _share(int(trained.sum()), int(after.sum())),
            "per_row": percentiles(trained),
        },
        "tool_schema_tokens": {
            "rows_with_tools": len(tools),
            "mean_per_row": float(np.mean(tools)) if tools else 0.0,
            "share_of_their_tokens": _share(sum(tools), int(sum(before[i] for i in (tool_tokens or {})))),
        },
        "straddling_tokens": report.straddling_tokens,
        # data.rule_check: rows also masked by the rule (per-turn prefix renders), over every row processed
        "rule_checked_rows": report.rule_checked_rows,
        "rule_unchecked_rows": report.rule_unchecked_rows,
        "rule_disagreements": report.rule_disagreements,
        "reasoning": reasoning_stats(cols, report),
        "unrendered_messages": dict(sorted(report.unrendered_messages.items())),
        "parse": report.parse,
    }


def tool_schema_tokens(rows: dict[int, dict], tokenizer, cfg: DataConfig) -> dict[int, int]:
    """Row index -> tokens its tool schemas add to the render (render with tools minus without).

    The fallback for rows whose template's tool block the probe could not place (``layout.tool_block``):
    costs one extra render per row, so only those rows take it.
    """
    with_tools, without = [], []
    index = []
    for i, row in rows.items():
        try:
            canon = canonicalize_row(row, cfg, tokenizer=tokenizer)
            if not canon.tools:
                continue
            with_tools.append(render_text(canon.messages, tokenizer, tools=canon.tools))
            without.append(render_text(canon.messages, tokenizer))
        except Exception:  # a row that cannot render is counted (with its reason) elsewhere
            continue
        index.append(i)
    if not index:
        return {}
    a = tokenizer(with_tools, add_special_tokens=False)["input_ids"]
    b = tokenizer(without, add_special_tokens=False)["input_ids"]
    return {i: len(x) - len(y) for i, x, y in zip(index, a, b)}


_ROLE_IN_DETAIL = re.compile(r"role '([^']*)'")


def reasoning_advice(reasoning: dict, data: DataConfig) -> str | None:
    """Turns trained without their reasoning -> what to change (``None`` when there are none)."""
    turns = reasoning["reasoning_dropped_turns"]
    if not turns:
        return None
    head = (f"{turns} trained turns in {reasoning['reasoning_dropped_rows']} rows are trained without their "
            f"reasoning ({reasoning['reasoning_dropped_tokens']} tokens the chat template does not render)")
    on_purpose = "or data.think_mode: drop to train without reasoning on purpose"
    if data.reasoning_history == "drop":
        return (f"{head}: set data.reasoning_history: expand to train each such turn with its reasoning in an extra "
                f"example (the conversation up to that turn), {on_purpose}")
    cap = data.reasoning_history_max_examples
    most = (reasoning["examples_per_row"]["max"] or 1) - 1
    template = ("the template does not render this reasoning even in the last turn: pass "
                "model.chat_template_kwargs (e.g. {skip_think: false}) or use another template, " + on_purpose)
    if most >= cap:
        return (f"{head} under reasoning_history: expand: rows reach data.reasoning_history_max_examples={cap} "
                f"(at most {most} extra examples per row): raise it to train their later turns with reasoning; "
                f"if turns remain, {template}")
    return f"{head} under reasoning_history: expand: {template}"


def unrendered_role_advice(overall: dict) -> str | None:
    """Rows dropped as ``unrendered_role`` -> the role and the ``data.roles`` mapping that fixes them."""
    n = overall["dropped"].get(DropReason.UNRENDERED_ROLE, 0)
    if not n:
        return None
    first = overall["first_dropped"][DropReason.UNRENDERED_ROLE]
    found = _ROLE_IN_DETAIL.search(first)
    unknown = overall["parse"].get("unknown_roles", {})
    role = found.group(1) if found else (max(unknown, key=unknown.get) if unknown else "ROLE")
    others = {r: c for r, c in unknown.items() if r != role}
    also = f" (other unknown roles in the data: {_counts(others)})" if others else ""
    return (f"{n} rows are dropped as unrendered_role: the chat template does not render role '{role}'{also}: "
            f"map it to a role it renders with data.roles: {{system: [{role}]}} or {{user: [{role}]}}")


def unrendered_messages_advice(unrendered: dict[str, int]) -> str | None:
    """Untrained messages the template leaves out -> which roles, and that the model never sees them."""
    if not unrendered:
        return None
    return (f"the chat template does not render {sum(unrendered.values())} untrained messages ({_counts(unrendered)}):"
            " the model never sees their content; map the role to one the template renders (data.roles, e.g. "
            f"{{user: [{max(unrendered, key=unrendered.get)}]}}) or use a template that renders it")


def layout_advice(overall: dict) -> list[str]:
    """Rows the probed layout could not verify -> how many took prefix renders, how many neither path verified,
    and the fixes: declare the layout (``model.template_layout``), or add plain-text markers as tokens."""
    out = []
    slow = overall["parse"].get("verified_by_prefix_renders", 0)
    if slow:
        out.append(f"{slow} rows were verified by per-turn prefix renders ({overall['parse'].get('prefix_renders', 0)}"
                   " renders) because the probed layout did not verify them: correct or complete the layout printed "
                   "above in model.template_layout to verify them with one render")
    disagree = overall.get("rule_disagreements", 0)
    if disagree:
        out.append(f"{disagree} rows are refused as mask_disagrees: the layout masks them differently from the rule "
                   f"(per-turn prefix renders) (e.g. {overall['first_dropped'].get(DropReason.MASK_DISAGREES, '')}); "
                   "correct the part of the layout printed above that the difference shows and declare it in "
                   "model.template_layout; --debug-samples N --debug-refused shows both masks")
    n = overall["dropped"].get(DropReason.MASK_UNVERIFIED, 0)
    if n:
        out.append(f"{n} rows are refused as mask_unverified: neither the probed layout nor per-turn prefix renders "
                   f"verified them (e.g. {overall['first_dropped'][DropReason.MASK_UNVERIFIED]}); if the template "
                   "writes those turns, declare where a turn opens and ends in model.template_layout (paste the "
                   "layout printed above and correct it); if its markers are plain text, model.new_tokens: auto "
                   "adds them as tokens")
    return out


def marker_stats(tokenizer, new_tokens: NewTokens = NO_NEW_TOKENS, option: list[str] | str | None = None) -> dict:
    """The chat template's markers (``tokenizer.template_markers``) in this vocabulary: ``plain_text``, marker ->
    the tokens it costs each time a turn writes it, for those that are not single tokens; ``added``, token ->
    its id and the tokens it cost before, for what ``model.new_tokens`` (``option``) added."""
    plain = {m: n for m in template_markers(tokenizer) if (n := token_count(tokenizer, m)) > 1}
    added = {token: {"id": i, "was_tokens": len(pieces)}
             for token, i, pieces in zip(new_tokens.tokens, new_tokens.ids, new_tokens.pieces)}
    return {"plain_text": plain, "added": added, "already_tokens": list(new_tokens.already), "new_tokens": option}


def marker_advice(markers: dict) -> str | None:
    """Markers that are plain text -> what they cost and the option that makes them tokens (None when none)."""
    plain = markers.get("plain_text") or {}
    if not plain:
        return None
    listed = isinstance(markers.get("new_tokens"), list)
    fix = ("add them to model.new_tokens (or set it to auto)" if listed else
           "set model.new_tokens: auto to add them as tokens (only their embedding rows train)")
    return (f"the chat template's markers are plain text in this vocabulary, several tokens each time a turn writes "
            f"one ({', '.join(f'{m} {n}' for m, n in plain.items())}): the model must learn to write its end "
            f"marker piece by piece and a server stops at it only as a string; {fix}")


def marker_lines(markers: dict) -> list[str]:
    """The ``markers`` section: what ``model.new_tokens`` added, and the markers still plain text."""
    lines = []
    if markers.get("added"):
        lines.append("new tokens (model.new_tokens): " + ", ".join(
            f"{t} id {a['id']} (was {a['was_tokens']} tokens)" for t, a in markers["added"].items()))
    if markers.get("already_tokens"):
        lines.append(f"new tokens already single tokens, not added: {', '.join(markers['already_tokens'])}")
    plain = markers.get("plain_text") or {}
    lines.append("template markers as plain text (tokens each time a turn writes one): " + (
        ", ".join(f"{m} {n}" for m, n in plain.items()) if plain else "none, every marker is a single token"))
    return lines


_OVER_A_LIMIT = re.compile(r"(?:chosen|rejected|prompt): \d+ (?:response )?tokens > max_\w+=\d+")


def _pair_lengths_seen(pairs: dict, first_dropped: dict) -> str:
    """What the length advice can say of pair lengths: the longer side of kept pairs, or, with none kept, how long
    the first pair refused as ``too_long`` was (its detail).

    >>> _pair_lengths_seen({"longer_side_tokens": {"p95": None}}, {"too_long": "f:1: chosen: 497 tokens > "
    ...                    "max_length=256 (fit_pair drops prompt exchanges first)"})
    'no pair was kept; the first refused: chosen: 497 tokens > max_length=256'
    """
    p95 = pairs["longer_side_tokens"]["p95"]
    if p95 is not None:
        return f"the longer side of kept pairs: p95 {p95}"
    first = first_dropped.get(DropReason.TOO_LONG, "")
    found = _OVER_A_LIMIT.search(first)
    return f"no pair was kept; the first refused: {found.group() if found else first or 'none'}"


def advice(overall: dict, *, max_length: int, data: DataConfig | None = None, markers: dict | None = None) -> list[str]:
    """Plain advice lines from the overall statistics (empty when nothing stands out).

    ``data`` (default ``DataConfig()``) supplies the options the reasoning advice names.
    """
    data = data or DataConfig()
    out = []
    at_max = overall["share_at_max_length"]
    pairs = overall.get("pairs")
    if pairs:  # a pair's length is its longer side; its tokens_* percentiles count both sides
        over = pairs["share_over_max_length"]
        if over > AT_MAX_SHARE:
            limits = ", ".join(f"{k}={v}" for k, v in (("max_length", max_length),
                                                          ("max_prompt_length", data.max_prompt_length),
                                                          ("max_response_length", data.max_response_length)) if v)
            out.append(f"{over:.0%} of pairs are over a limit ({limits}; more than {AT_MAX_SHARE:.0%}: "
                       f"{pairs['truncated_pairs']} truncated, {pairs['too_long']} refused as too_long): raise "
                       f"data.max_length ({_pair_lengths_seen(pairs, overall['first_dropped'])}) "
                       "or the per-side limits, or pre-filter long pairs")
    prompts = overall.get("prompts")
    if prompts:  # a prompt's limit is not max_length: its completion is sampled into the rest
        if prompts["share_over_limit"] > AT_MAX_SHARE:
            out.append(f"{prompts['share_over_limit']:.0%} of prompts are over their limit of {prompts['limit']} "
                       f"tokens (more than {AT_MAX_SHARE:.0%}: {prompts['truncated_prompts']} truncated, "
                       f"{prompts['too_long']} refused as too_long; p95 before truncation "
                       f"{prompts['prompt_tokens_before_truncation']['p95']}): raise data.max_length or lower "
                       "rl.max_completion_length")
    elif at_max > AT_MAX_SHARE:
        out.append(f"{at_max:.0%} of rows reach max_length={max_length} (more than {AT_MAX_SHARE:.0%}): raise "
                   f"data.max_length (p95 before truncation is {overall['tokens_before_truncation']['p95']}) "
                   "or pre-filter long rows")
    under = overall["share_under_25pct_max_length"]
    if under > UNDER_QUARTER_SHARE and not pairs and not prompts:
        p99 = overall["tokens_before_truncation"]["p99"] or 0
        suggestion = max(64, math.ceil(p99 / 64) * 64)
        out.append(f"{under:.0%} of rows use under 25% of max_length={max_length}: lower data.max_length "
                   f"(e.g. to {suggestion}, p99 rounded up to 64) to save memory")
    tools = overall["tool_schema_tokens"]
    if tools["rows_with_tools"] and tools["share_of_their_tokens"] > TOOL_SCHEMA_SHARE:
        out.append(f"tool schemas add {tools['mean_per_row']:.0f} tokens per row on average "
                   f"({tools['share_of_their_tokens']:.0%} of the {tools['rows_with_tools']} rows with tools): "
                   "drop unused tools or shorten their descriptions")
    images = overall.get("images")
    if images and (images["share_of_max_length"]["p50"] or 0) > IMAGE_SHARE:
        out.append(f"image tokens take {images['share_of_max_length']['p50']:.0%} of max_length={max_length} in the "
                   f"median row with images (more than {IMAGE_SHARE:.0%}; p95 "
                   f"{images['image_tokens_per_row']['p95']} tokens): lower the image processor's max_pixels, or "
                   "raise data.max_length, to leave room for the text")
    for line in (reasoning_advice(overall["reasoning"], data), unrendered_messages_advice(
            overall["unrendered_messages"]), unrendered_role_advice(overall), marker_advice(markers or {}),
            *layout_advice(overall)):
        if line:
            out.append(line)
    conflicts = overall["parse"].get("system_column_conflicts", 0)
    if conflicts:
        out.append(f"{system_conflict_line(conflicts)}: make them agree, or leave one out "
                   "(docs/datasets.md#the-system-column)")
    dropped = sum(overall["dropped"].values())
    if dropped:
        out.append(f"{dropped} of {overall['rows_in']} rows are dropped (reasons above); "
                   "docs/troubleshooting.md says what each reason means")
    return out


def compute_stats(cols: dict[str, list], *, max_length: int, tool_tokens: dict[int, int] | None = None,
                  data: DataConfig | None = None, markers: dict | None = None) -> dict:
    """All processed rows (their row type's ``stats_columns``: a pair's have ``chosen_tokens``) -> ``{"max_length",
    "overall", "sources", "markers", "advice"}``.

    ``data`` (the run's ``DataConfig``) names the options in the advice; ``markers`` is ``marker_stats``.
    """
    tool_tokens = tool_tokens or {}
    pairs = "chosen_tokens" in cols
    limit = data.max_prompt_length if data is not None and data.max_prompt_length else max_length
    sources: dict[str, dict] = {}
    labels = cols["source"]
    overall = group_stats(cols, max_length=max_length, tool_tokens=tool_tokens, pairs=pairs, prompt_limit=limit)
    distinct = list(dict.fromkeys(labels))  # first-seen order
    for label in distinct:
        if len(distinct) == 1:  # one source: its rows are all rows, its statistics the overall ones
            sources[label] = copy.deepcopy(overall)
            break
        idx = [i for i, s in enumerate(labels) if s == label]
        sub = {k: [v[i] for i in idx] for k, v in cols.items()}
        sub_tools = {j: tool_tokens[i] for j, i in enumerate(idx) if i in tool_tokens}
        sources[label] = group_stats(sub, max_length=max_length, tool_tokens=sub_tools, pairs=pairs,
                                     prompt_limit=limit)
    return {"max_length": max_length, "overall": overall, "sources": sources, "markers": markers or {},
            "advice": advice(overall, max_length=max_length, data=data, markers=markers)}


def _pct(d: dict) -> str:
    values = {k: v for k, v in d.items() if k != "rows"}
    if all(v is None for v in values.values()):
        return "none (no rows)"
    return "  ".join(f"{k} {v}" for k, v in values.items())


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "none"


def rule_check_line(s: dict) -> str:
    """The rule check's counts (``data.rule_check``) as one readable line."""
    return (f"checked against the rule (data.rule_check): rule_checked_rows {s['rule_checked_rows']}, "
            f"rule_disagreements {s['rule_disagreements']} (refused: mask_disagrees), rule_unchecked_rows "
            f"{s['rule_unchecked_rows']} (the template is not prefix-stable on them)")


def _shares(d: dict) -> str:
    if d["max"] is None:
        return "none (no rows)"
    return "  ".join(f"{k} {v:.1%}" for k, v in d.items())


def image_lines(s: dict, max_length: int) -> list[str]:
    """The ``images`` section (``image_stats``) as readable lines."""
    rows = [("images", _pct(s["images_per_row"])), ("image tokens", _pct(s["image_tokens_per_row"])),
            (f"share of max_length={max_length}", _shares(s["share_of_max_length"])),
            ("share of its tokens", _shares(s["share_of_row_tokens"]))]
    width = max(len(name) for name, _ in rows)
    return [f"images: {s['images']} in {s['rows_with_images']} kept rows ({s['image_tokens']} image tokens, never "
            f"trained); refused as bad_image {s['bad_image']}; per row with images:",
            *(f"  {name:<{width}}  {values}" for name, values in rows)]


def parse_lines(p: dict) -> list[str]:
    """``ParseReport`` totals as two readable lines."""
    return [
        f"parse: schemas {_counts(p.get('schemas', {}))}; unknown roles {_counts(p.get('unknown_roles', {}))}; "
        f"system column first in {p.get('system_from_column', 0)} rows, not used in "
        f"{p.get('system_column_conflicts', 0)} (a system message of their own that differs)",
        f"reasoning: think blocks extracted {p.get('extracted_think_from_content', 0)} (unbalanced tags "
        f"{p.get('unbalanced_think_tags', 0)}), keys moved {_counts(p.get('moved_reasoning_keys', {}))}, dropped "
        f"{p.get('dropped_think_messages', 0)}, capped {p.get('think_capped_messages', 0)}; tools present "
        f"{p.get('tools_present', 0)} (parsed from a string {p.get('tools_parsed_from_string', 0)})",
    ]


def reasoning_lines(r: dict, unrendered: dict[str, int]) -> list[str]:
    """The ``reasoning`` section and ``unrendered_messages`` as two readable lines."""
    per_row = r["examples_per_row"]
    return [
        f"reasoning history: {r['reasoning_dropped_turns']} trained turns in {r['reasoning_dropped_rows']} rows "
        f"without their reasoning ({r['reasoning_dropped_tokens']} tokens not rendered); expand: "
        f"{r['expanded_examples']} extra examples from {r['expanded_rows']} rows ({r['expanded_tokens']} tokens, "
        f"{r['expanded_trained_tokens']} trained); examples per row mean {per_row['mean']:.2f}, max {per_row['max']}",
        f"messages the template does not render: {_counts(unrendered)}",
    ]


def pair_lines(p: dict, max_length: int) -> list[str]:
    """The ``pairs`` section (``pair_stats``) as readable lines."""
    return [
        f"pairs kept {p['pairs_kept']}; tokens per pair (kept):",
        f"  prompt (shared)    {_pct(p['prompt_tokens'])}",
        f"  chosen response    {_pct(p['chosen_response_tokens'])}",
        f"  rejected response  {_pct(p['rejected_response_tokens'])}",
        f"  longer side        {_pct(p['longer_side_tokens'])}",
        f"pairs over a limit (max_length={max_length}, max_prompt_length, max_response_length): "
        f"{p['share_over_max_length']:.1%}; truncated {p['truncated_pairs']} pairs: middle prompt exchanges dropped "
        f"{p['prompt_exchanges_dropped']}, reasoning trimmed in {p['reasoning_trimmed_pairs']} pairs "
        f"({p['reasoning_tokens_trimmed']} tokens), responses cut: chosen {p['responses_cut']['chosen']}, rejected "
        f"{p['responses_cut']['rejected']}; refused as too_long {p['too_long']}",
        f"refused pairs by reason: {_counts(p['refused'])}",
    ]


def prompt_lines(p: dict, max_length: int) -> list[str]:
    """The ``prompts`` section (``prompt_stats``) as readable lines."""
    return [
        f"prompts kept {p['prompts_kept']}; their limit {p['limit']} tokens (data.max_prompt_length; under "
        f"train.method: grpo max_length={max_length} less rl.max_completion_length), {p['completion_room']} left for "
        "the completion:",
        f"  prompt tokens (kept)     {_pct(p['prompt_tokens'])}",
        f"  before truncation        {_pct(p['prompt_tokens_before_truncation'])}",
        f"  of it generation prompt  {_pct(p['generation_prompt_tokens'])}",
        f"prompts over the limit: {p['share_over_limit']:.1%}; truncated {p['truncated_prompts']} prompts (middle "
        f"exchanges dropped: {p['exchanges_dropped']}); refused as too_long {p['too_long']}",
        "trained tokens: none from the data (each prompt's completions are sampled in training)",
    ]


def stats_lines(stats: dict) -> list[str]:
    """Human-readable report of ``compute_stats`` output."""
    lines = []
    groups = [("overall", stats["overall"])]
    if len(stats["sources"]) > 1:
        groups += [(f"source {label}", s) for label, s in stats["sources"].items()]
    for name, s in groups:
        t = s["truncation"]
        lines += [
            f"== {name}",
            f"rows in {s['rows_in']}, kept {s['rows_kept']}, dropped {s['rows_in'] - s['rows_kept']}",
            *[f"  dropped {n:>7}  {reason}  (first: {s['first_dropped'][reason]})"
              for reason, n in s["dropped"].items()],
            *([labels_line(s["labels"]["desirable"], s["labels"]["undesirable"])] if "labels" in s else ()),
        ]
        if "prompts" in s:  # a prompt's limit is its own, and nothing of it is trained
            lines += [*prompt_lines(s["prompts"], stats["max_length"]), *parse_lines(s["parse"])]
            continue
        if "pairs" in s:  # the SFT length lines would count both sides of a pair as one row's length
            lines += [*pair_lines(s["pairs"], stats["max_length"]),
                      f"trained tokens (both sides): {s['trained_tokens']['total']} "
                      f"({s['trained_tokens']['share_of_tokens']:.1%} of tokens); per pair "
                      f"{_pct(s['trained_tokens']['per_row'])}",
                      rule_check_line(s), *reasoning_lines(s["reasoning"], s["unrendered_messages"]),
                      *parse_lines(s["parse"])]
            continue
        lines += [
            f"tokens before truncation ({s['tokens_before_truncation']['rows']} rows): "
            f"{_pct(s['tokens_before_truncation'])}",
            f"tokens after truncation  ({s['tokens_after_truncation']['rows']} rows): "
            f"{_pct(s['tokens_after_truncation'])}",
            f"rows at max_length={stats['max_length']}: {s['share_at_max_length']:.1%}; under 25%: "
            f"{s['share_under_25pct_max_length']:.1%}; under 50%: {s['share_under_50pct_max_length']:.1%}",
            f"truncation: turns dropped in {t['rows_turns_dropped']} rows ({t['turns_dropped']} turns), reasoning "
            f"trimmed in {t['rows_reasoning_trimmed']} rows ({t['reasoning_tokens_trimmed']} tokens), token-level "
            f"cut in {t['rows_token_fallback_left']} rows (left) / {t['rows_token_fallback_right']} (right)",
            f"trained tokens: {s['trained_tokens']['total']} ({s['trained_tokens']['share_of_tokens']:.1%} of "
            f"tokens); per row {_pct(s['trained_tokens']['per_row'])}",
            f"tool schemas: {s['tool_schema_tokens']['rows_with_tools']} rows, "
            f"{s['tool_schema_tokens']['mean_per_row']:.0f} tokens per row on average",
            *(image_lines(s["images"], stats["max_length"]) if "images" in s else ()),
            rule_check_line(s),
            *reasoning_lines(s["reasoning"], s["unrendered_messages"]),
            *parse_lines(s["parse"]),
        ]
    if stats.get("markers"):
        lines += ["== chat template markers", *marker_lines(stats["markers"])]
    lines.append("== advice")
    lines += [f"- {line}" for line in stats["advice"]] or ["- nothing stands out"]
    return lines


def write_histogram(cols: dict[str, list], *, max_length: int, path, pairs: bool = False) -> None:
    """PNG histogram of token lengths before and after truncation, with the max_length line; with ``pairs``, the
    longer side of each kept pair (what ``max_length`` bounds)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # not pyplot: no GUI backend, no global figure state, a faster import

    before = [n for n in cols["num_tokens_before"] if n > 0] if not pairs else []
    after = [n for n, r in zip(cols["num_tokens"], cols["drop_reason"]) if not r] if not pairs else [
        max(c, j) for c, j, r in zip(cols["chosen_tokens"], cols["rejected_tokens"], cols["drop_reason"]) if not r]
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    top = max([max_length, *before]) if before else max_length
    bins = np.linspace(0, top, 51)
    ax.hist(before, bins=bins, histtype="step", linewidth=1.5, color="black",
            label=f"before truncation ({len(before)} rows)")
    what = "longer side of kept pairs" if pairs else "after truncation, kept"
    ax.hist(after, bins=bins, alpha=0.6, label=f"{what} ({len(after)} rows)")
    ax.axvline(max_length, color="red", linestyle="--", label=f"max_length = {max_length}")
    ax.set_xlabel("tokens per row")
    ax.set_ylabel("rows")
    ax.set_title("Token lengths")
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(path, png.getvalue())  # never written through a link planted at its name
