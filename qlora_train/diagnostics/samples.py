"""``--debug-samples N``: processed examples shown with trained text distinct from masked text.

A sample as ``format_sample(load_samples(raw, processed, tok, [0])[0], color=False)`` prints it::

    --- data.jsonl:1  (source 0:data.jsonl)
    tokens 21 before truncation, 21 after; trained 6; truncation: none
    <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n⟦Hello!<|im_end|>⟧\\n

An image's run of image tokens shows as one marker, ``[image 448x448 → 256 tokens]`` (``diagnostics.images``):
its size read from the file's header, the count from the ids; outside ``⟦ ⟧``, as no image token is trained.

What is shown is decoded from the processed ``input_ids`` and ``labels``, the
exact tensors training would get: a token is trained when its label is not
``IGNORE_INDEX``. Each token's text comes from a streaming decode, so the pieces
join to the decoded example and a character split over several byte tokens is
shown with the token that completes it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from qlora_train.config import DataConfig
from qlora_train.data.batches import read_json
from qlora_train.data.drops import DropReason
from qlora_train.diagnostics.images import ImageRun, image_runs, image_sources
from qlora_train.masking import IGNORE_INDEX, SIDES, RowRejected
from qlora_train.terminal import visible

OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦ trained ⟧ in the plain (no colour) form
GREEN, GREY, RESET = "\x1b[32m", "\x1b[90m", "\x1b[0m"
RAW_PREVIEW_CHARS = 2000


@dataclass(frozen=True)
class Sample:
    index: int  # row index in the processed dataset
    location: str
    source: str
    input_ids: list[int]
    labels: list[int]
    pieces: list[str]  # text of each token; "".join(pieces) is the decoded example
    num_tokens_before: int
    truncation: str
    drop_reason: str = ""
    drop_detail: str = ""
    raw: str = ""  # refused rows: the raw row as JSON text
    extra: int = 0  # 0: the row's own example; k: its k-th extra example (reasoning_history: expand)
    extras: int = 0  # how many extra examples the row has
    side: str = ""  # a preference pair's side ("chosen", "rejected"): each is a sample of its own
    prompt_length: int = 0  # a side's tokens shared with the other side
    mask_by: str = ""  # a row refused as mask_disagrees: whose mask this is ("by the layout", "chosen by the rule")
    label: str = ""  # an unpaired preference row (KTO): "desirable" or "undesirable"; prompt_length its prompt's
    images: tuple[ImageRun, ...] = ()  # its images' runs of tokens, in order (a vision-language model's rows)
    generation_prompt: int = 0  # a prompt row (GRPO): its last tokens, what the generation prompt writes

    @property
    def name(self) -> str:
        """The row's location, as every message names a row (``file:line`` in a JSON lines file, ``file[i]`` the
        row's index from 0 elsewhere), and which of its samples: ``d.jsonl:4``, ``d.jsonl:4 extra 1/2`` for the
        row's first of two extra examples, ``d.jsonl:4 chosen``, ``d.jsonl:4 by the rule``."""
        return self.location + (f" extra {self.extra}/{self.extras}" if self.extra else "") + (
            f" {self.side}" if self.side else "") + (f" {self.mask_by}" if self.mask_by else "")

    @property
    def anchor(self) -> str:
        """The sample's id in the HTML page: ``row-3``, ``row-3-extra-1``, ``row-3-chosen``, ``row-3-by-the-rule``."""
        return f"row-{self.index}" + (f"-extra-{self.extra}" if self.extra else "") + (
            f"-{self.side}" if self.side else "") + (f"-{self.mask_by.replace(' ', '-')}" if self.mask_by else "")

    @property
    def trained(self) -> list[bool]:
        return [label != IGNORE_INDEX for label in self.labels]

    @property
    def num_trained(self) -> int:
        return sum(self.trained)

    @property
    def trained_image_tokens(self) -> int:
        """Tokens of its images' runs that are trained (0 for every row the engine makes)."""
        trained = self.trained
        return sum(sum(trained[run.start:run.end]) for run in self.images)


def shown_tokens(sample: Sample) -> list[tuple[str, bool, ImageRun | None]]:
    """The sample's tokens as shown: ``(text, trained, None)`` per token, each image's run as one
    ``(marker, any of it trained, run)``."""
    runs = {run.start: run for run in sample.images}
    trained = sample.trained
    out = []
    p = 0
    while p < len(sample.pieces):
        run = runs.get(p)
        if run is not None:
            out.append((run.marker, any(trained[run.start:run.end]), run))
            p = run.end
            continue
        out.append((sample.pieces[p], trained[p], None))
        p += 1
    return out


def token_pieces(ids: list[int], tokenizer) -> list[str]:
    """Token ids -> the text each token adds (a token that ends mid-character adds ``""``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: per-token decode (multi-byte characters may show as �)
        return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]
    stream = DecodeStream(skip_special_tokens=False)
    return [stream.step(backend, int(i)) or "" for i in ids]


def spans(sample: Sample) -> list[tuple[str, bool]]:
    """Consecutive tokens of equal trained-ness merged: ``[(text, trained), …]``."""
    out: list[tuple[str, bool]] = []
    for piece, trained, _ in shown_tokens(sample):
        if out and out[-1][1] == trained:
            out[-1] = (out[-1][0] + piece, trained)
        else:
            out.append((piece, trained))
    return out


def trained_text(sample: Sample) -> list[str]:
    """The trained spans' text, in order."""
    return [text for text, trained in spans(sample) if trained]


def truncation_summary(dropped_turns: int, reasoning_trimmed: int, token_fallback: str) -> str:
    """``(2, 0, "left")`` -> ``"dropped 2 middle turns; token-level cut (left)"``."""
    parts = []
    if dropped_turns:
        parts.append(f"dropped {dropped_turns} middle turns")
    if reasoning_trimmed:
        parts.append(f"trimmed {reasoning_trimmed} reasoning tokens")
    if token_fallback:
        parts.append(f"token-level cut ({token_fallback})")
    return "; ".join(parts) or "none"


def select_indices(drop_reasons: list[str], n: int, *, seed: int | None = None, refused: bool = False) -> list[int]:
    """Indices of ``n`` kept rows (refused rows with ``refused=True``): the first ``n``, or a seeded random draw."""
    pool = [i for i, reason in enumerate(drop_reasons) if bool(reason) == refused]
    if seed is None:
        return pool[:n]
    return sorted(random.Random(seed).sample(pool, min(n, len(pool))))


def load_samples(raw, processed, tokenizer, indices: list[int], data: DataConfig | None = None) -> list[Sample]:
    """Rows ``indices`` of the aligned raw and processed datasets -> ``Sample``s: each row's example, then its
    extra examples (``reasoning_history: expand``), each a sample of its own. A row refused as ``mask_disagrees``
    is followed by its two masks, by the layout and by the rule, made again (``rule_check.both_masks``) with
    ``data`` (the run's data config)."""
    out = []
    for i in indices:
        p, r = processed[i], raw[i]
        if p.get("chosen_input_ids"):  # a kept preference pair: each side shown as SFT's rows are
            out += [Sample(
                index=i, location=r["location"], source=r["source"], input_ids=p[f"{side}_input_ids"],
                labels=p[f"{side}_labels"], pieces=token_pieces(p[f"{side}_input_ids"], tokenizer),
                num_tokens_before=p["num_tokens_before"], side=side, prompt_length=p["prompt_length"],
                truncation=truncation_summary(p["dropped_turns"], p["reasoning_trimmed_tokens"], (
                    p["cut_sides"].replace(",", " and ") + " response") if p["cut_sides"] else ""),
            ) for side in SIDES]
            continue
        if "generation_prompt_tokens" in p and not p["drop_reason"]:  # a kept prompt (GRPO): nothing trained
            ids = p["input_ids"]
            out.append(Sample(index=i, location=r["location"], source=r["source"], input_ids=ids,
                              labels=[IGNORE_INDEX] * len(ids), pieces=token_pieces(ids, tokenizer),
                              num_tokens_before=p["num_tokens_before"],
                              truncation=truncation_summary(p["dropped_turns"], 0, ""),
                              generation_prompt=p["generation_prompt_tokens"]))
            continue
        extras = list(zip(p.get("expanded_input_ids") or [], p.get("expanded_labels") or []))
        refs = p.get("images") or []
        sources = image_sources(r["row"] or "", refs, _source_config(r, data or DataConfig())) if refs else []
        out.append(Sample(
            index=i, location=r["location"], source=r["source"], input_ids=p.get("input_ids", []),  # not a pair's
            labels=p.get("labels", []), pieces=token_pieces(p.get("input_ids", []), tokenizer),
            num_tokens_before=p["num_tokens_before"],
            truncation=truncation_summary(p["dropped_turns"], p["reasoning_trimmed_tokens"],
                                          p.get("token_fallback", "")),
            drop_reason=p["drop_reason"], drop_detail=p["drop_detail"], raw=r["row"] or "", extras=len(extras),
            images=image_runs(p.get("input_ids", []), refs, tokenizer, sources), **_unpaired_fields(p),
        ))
        if p["drop_reason"] == DropReason.MASK_DISAGREES and data is not None:
            out += [Sample(index=i, location=r["location"], source=r["source"], input_ids=m.input_ids,
                           labels=m.labels, pieces=token_pieces(m.input_ids, tokenizer),
                           num_tokens_before=len(m.input_ids), truncation="none", mask_by=by,
                           images=image_runs(m.input_ids, refs, tokenizer, sources))
                    for by, m in _both_masks(r, tokenizer, data)]
        for k, (ids, labels) in enumerate(extras, start=1):
            out.append(Sample(index=i, location=r["location"], source=r["source"], input_ids=ids, labels=labels,
                              pieces=token_pieces(ids, tokenizer), num_tokens_before=len(ids), truncation="none",
                              extra=k, extras=len(extras), images=image_runs(ids, refs, tokenizer, sources)))
    return out


def _unpaired_fields(p: dict) -> dict:
    """A kept unpaired row's (``processed.UNPAIRED_ROW``) label and prompt length, for its summary line."""
    if "desirable" not in p or p["drop_reason"]:
        return {}
    return {"label": "desirable" if p["desirable"] else "undesirable", "prompt_length": p["prompt_length"]}


def _source_config(raw_row: dict, data: DataConfig) -> DataConfig:
    """The data options a raw row was processed with: its source's (``DataConfig.for_source``)."""
    from qlora_train.data.sources import source_label

    return next((data.for_source(s) for k, s in enumerate(data.datasets) if source_label(k, s) == raw_row["source"]),
                data)


def _both_masks(raw_row: dict, tokenizer, data: DataConfig) -> list:
    """``rule_check.both_masks`` of a raw row's conversations (``pipeline.Objective.conversations``), with its
    source's options (``DataConfig.for_source``)."""
    from qlora_train.data.pipeline import objective
    from qlora_train.data.rule_check import both_masks

    cfg = _source_config(raw_row, data)
    try:
        return both_masks(objective(cfg).conversations(read_json(raw_row["row"]), tokenizer, cfg), tokenizer)
    except (RowRejected, ValueError):  # no longer refused this way (the config or data changed)
        return []


def sample_summary(sample: Sample) -> str:
    """The line under a kept sample's heading: its tokens, trained tokens, truncation, extra examples."""
    if sample.mask_by:
        return (f"the mask {sample.mask_by}: tokens {len(sample.input_ids)}, trained {sample.num_trained} (the row is "
                "refused as mask_disagrees: the two masks differ; the rule's, where it cannot mask the whole row, is "
                "of the render through the turn that differs)")
    if sample.generation_prompt:
        written = "".join(sample.pieces[len(sample.pieces) - sample.generation_prompt:])
        truncation = sample.truncation.replace("middle turns", "middle exchanges")
        return (f"prompt: tokens {sample.num_tokens_before} before truncation, {len(sample.input_ids)} after, none "
                f"trained (its completions are sampled in training, after it); the last {sample.generation_prompt} "
                f"are the generation prompt's {written!r}, prompt too; truncation: {truncation}")
    if sample.side:
        return (f"{sample.side}: tokens {len(sample.input_ids)}, the first {sample.prompt_length} shared with the "
                f"other side (the prompt, never trained); trained {sample.num_trained}; truncation of the pair: "
                f"{sample.truncation.replace('middle turns', 'middle prompt exchanges')}")
    if sample.extra:
        return (f"tokens {len(sample.input_ids)}; trained {sample.num_trained}; extra example "
                f"{sample.extra} of {sample.extras} (reasoning_history: expand): the conversation up to a turn whose "
                "reasoning the full conversation's render drops")
    if sample.label:
        truncation = sample.truncation.replace("middle turns", "middle prompt exchanges")
        return (f"{sample.label} completion: tokens {sample.num_tokens_before} before truncation, "
                f"{len(sample.input_ids)} after, the first {sample.prompt_length} the prompt (never trained); trained "
                f"{sample.num_trained}; truncation: {truncation}")
    line = (f"tokens {sample.num_tokens_before} before truncation, {len(sample.input_ids)} after; "
            f"trained {sample.num_trained}; truncation: {sample.truncation}")
    return line + image_summary(sample) + (
        f"; {sample.extras} extra examples follow (reasoning_history: expand)" if sample.extras else "")


def image_summary(sample: Sample) -> str:
    """``"; images 2 (320 image tokens, 0 trained)"`` for a sample with images, else ``""``."""
    if not sample.images:
        return ""
    return (f"; images {len(sample.images)} ({sum(run.tokens for run in sample.images)} image tokens, "
            f"{sample.trained_image_tokens} trained)")


def raw_preview(raw: str) -> str:
    """A refused row's JSON text, indented (as it is when it does not parse), cut at ``RAW_PREVIEW_CHARS``."""
    try:
        text = json.dumps(read_json(raw), indent=2, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):  # RecursionError: dumps, near read_json's depth limit
        text = raw
    if len(text) > RAW_PREVIEW_CHARS:
        text = text[:RAW_PREVIEW_CHARS] + f"\n… ({len(text) - RAW_PREVIEW_CHARS} more characters)"
    return text


def format_sample(sample: Sample, *, color: bool, show_tokens: bool = False) -> str:
    """One sample as terminal text: trained spans green (``color``) or inside ``⟦ ⟧`` (plain). The row's text is
    shown through ``terminal.visible`` (its control characters escaped); the colours and marks are ours."""
    head = visible(f"--- {sample.name}  (source {sample.source})")
    if sample.drop_reason:
        return "\n".join([head, visible(f"refused: {sample.drop_reason}: {sample.drop_detail}"),
                          visible(raw_preview(sample.raw))])
    lines = [head, sample_summary(sample)]
    if color:
        body = "".join(f"{GREEN if t else GREY}{visible(text)}{RESET}" for text, t in spans(sample))
    else:
        body = "".join(f"{OPEN}{visible(text)}{CLOSE}" if t else visible(text) for text, t in spans(sample))
    lines.append(body)
    if show_tokens:
        lines.append(f"{'pos':>6} {'label':>7} {'id':>7}  token")
        runs = {run.start: run for run in sample.images}
        pos = 0
        while pos < len(sample.input_ids):  # an image's run is one line: its positions, its marker
            if (run := runs.get(pos)) is not None:
                labels = ",".join(map(str, sorted(set(sample.labels[run.start:run.end]))))
                lines.append(f"{f'{run.start}-{run.end - 1}':>6} {labels:>7} {'image':>7}  {run.marker}")
                pos = run.end
                continue
            lines.append(f"{pos:>6} {sample.labels[pos]:>7} {sample.input_ids[pos]:>7}  {sample.pieces[pos]!r}")
            pos += 1
    return "\n".join(lines)


def legend(*, color: bool) -> str:
    if color:
        return f"legend: {GREEN}trained{RESET} {GREY}masked{RESET}"
    return f"legend: {OPEN}trained{CLOSE}, everything else masked"
