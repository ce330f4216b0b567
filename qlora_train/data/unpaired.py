"""Unpaired preference rows (KTO): a raw row -> a prompt, one completion and its label -> one sequence.

    >>> row = canonicalize_unpaired({"prompt": "2+2?", "completion": "5", "label": False})
    >>> row.prompt, row.completion, row.desirable
    ([{'role': 'user', 'content': '2+2?'}], [{'role': 'assistant', 'content': '5'}], False)
    >>> ex = build_unpaired_example(row.prompt, row.completion, tok)  # Qwen3's template
    >>> tok.decode(ex["input_ids"][:ex["prompt_length"]])
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
    >>> tok.decode([t for t in ex["labels"] if t != -100])
    '<think>\\n\\n</think>\\n\\n5<|im_end|>'

The row shape is TRL's unpaired preference form (``KTOTrainer``): ``prompt`` (or ``question``, or ``instruction``
+ ``input``) a string or a message list, ``completion`` a string (one assistant answer) or a message list (assistant
turns and tool results), ``label`` true for a desirable completion, false for an undesirable one.

The sequence is exactly one side of a preference pair (``pairs.build_preference_example``): SFT's render, verified
walk, tokenization and labels for ``prompt + completion`` with only the completion's assistant turns trained
(``masking.mask_response``); ``prompt_length`` is the count of tokens wholly before the boundary
where the completion's first turn starts its generated part (the render is cut there before it is tokenized, so the
prompt's ids are the prompt tokenized alone, as at inference). The KL estimate pairs this prompt with another row's
completion (``train.collator.UnpairedCollator``): the prompt's ids are ``input_ids[:prompt_length]`` and the
completion's ``input_ids[prompt_length:]`` with their labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qlora_train.config import DataConfig
from qlora_train.data.drops import DropReason
from qlora_train.data.pairs import (
    PROMPT_KEYS,
    _check_messages,
    _messages,
    check_prompt,
    check_response,
    images_open_prompt,
    side_limit,
)
from qlora_train.data.parse import (
    ParseReport,
    RowImages,
    instruction_prompt,
    map_fields,
    row_tools,
    with_row_system,
)
from qlora_train.data.processed import UNPAIRED_ROW
from qlora_train.data.rows import Batch, check_length, content_chars, content_hash, guarded, report_json
from qlora_train.data.truncate import middle_exchanges
from qlora_train.masking import (
    DEFAULT_POLICY,
    IGNORE_INDEX,
    LossPolicy,
    Message,
    RowRejected,
    image_rule,
    mask_response,
    message_images,
)

UNPAIRED_FORMATS = ("prompt_completion", "instruction")  # CanonicalUnpaired.format


@dataclass
class CanonicalUnpaired:
    """An unpaired preference row in canonical messages (not yet marked: ``build_unpaired_example`` marks them)."""

    prompt: list[Message]
    completion: list[Message]
    desirable: bool  # the row's label
    tools: list[dict] | None
    format: str  # one of UNPAIRED_FORMATS
    report: ParseReport = field(default_factory=ParseReport)


def canonicalize_unpaired(row: dict, cfg: DataConfig | None = None, *, tokenizer=None) -> CanonicalUnpaired:
    """A raw unpaired row -> ``CanonicalUnpaired``, or ``RowRejected`` with a reason.

    After ``cfg.field_mappings``: ``prompt`` (or ``question``) a string or a message list, or ``instruction``
    (+ ``input``, joined as for Alpaca rows); ``completion`` a string or a message list; ``label`` a bool (or the
    integers 0 and 1). Messages are normalised as a pair's (``parse.canonical_messages``), the row's images (a
    vision-language model's) are the prompt's as a pair's are (``pairs.images_open_prompt``: RLAIF-V's layout, the
    image opening the question where the prompt does not place it); the row's ``system`` column opens the prompt
    as every schema's does (``parse.with_row_system``). A paired row (``chosen`` / ``rejected``) is
    refused as ``unknown_schema`` naming ``train.method: dpo`` or ``orpo``.
    """
    cfg = cfg or DataConfig()
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"row is a {type(row).__name__}, not a mapping")
    row = map_fields(row, cfg.field_mappings)
    report = ParseReport(schema="unpaired", schemas={"unpaired": 1}, rows=1)
    if "completion" not in row or "label" not in row:
        paired = "chosen" in row and "rejected" in row
        hint = (": a pair (chosen, rejected) trains with train.method: dpo or orpo" if paired else
                "; data.field_mappings names other columns, e.g. {completion: response, label: is_good}")
        raise RowRejected(DropReason.UNKNOWN_SCHEMA, f"an unpaired preference row (train.method: kto) needs "
                          f"'completion' and 'label'; it has keys {sorted(row)[:8]}{hint}")
    desirable = _label(row["label"])
    prompt_key = next((k for k in PROMPT_KEYS if k in row), None)
    if prompt_key is None and "instruction" not in row:
        raise RowRejected(DropReason.PAIR_BAD_PROMPT, f"no prompt: an unpaired row needs 'prompt' (or 'question', "
                          f"or 'instruction') beside its completion (keys {sorted(row)[:8]})")
    prompt_value = row[prompt_key] if prompt_key is not None else instruction_prompt(row, cfg)
    images = RowImages(row, cfg, report, tokenizer)  # the prompt's: a model does not write images
    prompt_value = images_open_prompt(prompt_value, len(images.pending), cfg)
    prompt = _messages(prompt_value, prompt_key or "instruction", "user", cfg, report, tokenizer, images)
    completion = _messages(row["completion"], "completion", "assistant", cfg, report, tokenizer)
    prompt = with_row_system(prompt, row, cfg, report)
    check_unpaired(prompt, completion)
    return CanonicalUnpaired(prompt, completion, desirable, row_tools(row, cfg, report),
                             "prompt_completion" if prompt_key is not None else "instruction", report=report)


def _label(value) -> bool:
    """A row's ``label`` -> desirable or not: a bool, or the integer 0 or 1; anything else is ``bad_row``.

    >>> _label(True), _label(0)
    (True, False)
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise RowRejected(DropReason.BAD_ROW, f"label: expected true (desirable) or false (undesirable), got {value!r}")


def check_unpaired(prompt: list[Message], completion: list[Message]) -> None:
    """A prompt that ends with a user turn or a tool result, and a completion of a pair side's shape
    (``pairs.check_response``)."""
    check_prompt(prompt)
    check_response("completion", completion)


def build_unpaired_example(prompt: list[Message], completion: list[Message], tokenizer, *,
                           tools: list[dict] | None = None, policy: LossPolicy = DEFAULT_POLICY,
                           max_length: int | None = None, max_response_length: int | None = None) -> dict:
    """A prompt and a completion (canonical messages) -> the row's sequence, or ``RowRejected``.

    Returns ``input_ids``, ``attention_mask``, ``labels`` (what SFT makes for ``prompt + completion`` with only the
    completion's assistant turns trained, as a pair's side), ``prompt_length`` (the tokens wholly before the
    completion), ``boundary_merges`` (1 where a token straddles that boundary: a tokenizer that is not cut merged
    the prompt's end with the completion's start; it starts in the prompt, so it is untrained),
    ``reasoning_dropped_turns`` and ``cut`` (the completion lost trained tokens to ``max_response_length``).

    Refused: a row of the wrong shape (``check_unpaired``), what the template or the mask check refuses, and with
    ``max_length`` a sequence longer than it (``too_long``), unless ``max_response_length`` is set: then the
    completion is cut on the right at ``side_limit`` tokens, and ``too_long`` only when nothing of it is left.
    """
    for where, messages in (("prompt", prompt), ("completion", completion)):
        _check_messages(messages, where)
    check_unpaired(prompt, completion)
    masked = mask_response(prompt, completion, tokenizer, tools=tools, policy=policy)
    sequence, prompt_length = masked.sequence, masked.prompt_length
    limit = side_limit(prompt_length, max_length, max_response_length)
    cut = False
    if sequence.num_tokens > limit:
        if max_response_length is None:
            raise RowRejected(DropReason.TOO_LONG, f"{sequence.num_tokens} tokens > max_length={max_length} "
                              "(fit_unpaired drops prompt exchanges first; data.max_response_length would cut the "
                              "completion)")
        cut = sequence.trains_past(limit)
    example = sequence.example(max_length=limit, truncate_side="right")
    if example["labels"].count(IGNORE_INDEX) == len(example["labels"]):
        raise RowRejected(DropReason.TOO_LONG if cut else DropReason.NO_TRAINED_TOKEN,
                          f"nothing of the completion is trained within {limit} tokens (the prompt has "
                          f"{prompt_length}; max_length={max_length}, max_response_length={max_response_length})")
    out = {**example, "prompt_length": prompt_length, "boundary_merges": masked.boundary_merges,
           "reasoning_dropped_turns": masked.reasoning_dropped_turns, "cut": cut,
           "images": [im["ref"] for im in message_images(prompt)]}
    if out["images"]:
        out["num_image_tokens"] = _check_unpaired_images(out, image_rule(tokenizer).image_token_id)
    return out


def _check_unpaired_images(example: dict, image_token_id: int) -> int:
    """A row with images: its image tokens, all in its prompt (``prompt_length``: the KL estimate's mismatched
    row keeps that prompt, and with it these images), none trained (checked, not trusted) -> how many."""
    ids, labels = example["input_ids"], example["labels"]
    if image_token_id in labels:
        raise RowRejected(DropReason.MASK_UNVERIFIED, "an image token is trained")
    if ids[example["prompt_length"]:].count(image_token_id):
        raise RowRejected(DropReason.BAD_IMAGE, "image tokens after the prompt")
    return ids.count(image_token_id)


@dataclass(frozen=True)
class FittedUnpaired:
    """An unpaired row's example within its limits (``fit_unpaired``) and what fitting it took."""

    example: dict  # build_unpaired_example's columns
    tokens_before: int  # before truncation
    dropped_turns: int = 0  # middle prompt exchanges dropped


def fit_unpaired(row: CanonicalUnpaired, tokenizer, *, max_length: int, policy: LossPolicy = DEFAULT_POLICY,
                 on_too_long: str = "truncate", max_prompt_length: int | None = None,
                 max_response_length: int | None = None) -> FittedUnpaired:
    """A canonical unpaired row -> its example within ``max_length`` (and ``max_prompt_length``,
    ``max_response_length``), or ``RowRejected``.

    As a pair's prompt (``pairs.fit_pair``): the leading system message(s) and the prompt's last exchange are
    kept, whole middle exchanges dropped, oldest first, one at a time; then, with ``max_response_length``, the
    completion is cut on the right (``build_unpaired_example``); without it, a row still over ``max_length`` is
    ``too_long``. The prompt's reasoning is not trimmed here (a pair's is). ``on_too_long: drop`` refuses any row
    over a limit as ``too_long``.
    """
    def build(prompt: list[Message], cut: bool = False) -> dict:
        return build_unpaired_example(prompt, row.completion, tokenizer, tools=row.tools, policy=policy,
                                      max_length=max_length if cut else None,
                                      max_response_length=max_response_length if cut else None)

    def over(example: dict) -> str:
        if max_prompt_length and example["prompt_length"] > max_prompt_length:
            return f"prompt: {example['prompt_length']} tokens > max_prompt_length={max_prompt_length}"
        n = len(example["input_ids"])
        if n > max_length:
            return f"{n} tokens > max_length={max_length}"
        if n > side_limit(example["prompt_length"], max_length, max_response_length):
            return (f"completion: {n - example['prompt_length']} tokens > max_response_length="
                    f"{max_response_length}")
        return ""

    example = build(row.prompt)
    before = len(example["input_ids"])
    if not over(example):
        return FittedUnpaired(example, before)
    if on_too_long == "drop":
        raise RowRejected(DropReason.TOO_LONG, f"{over(example)} (data.on_too_long: drop)")
    groups = middle_exchanges(row.prompt)
    prompt, dropped = row.prompt, 0
    while over(example) and dropped < len(groups):
        dropped += 1
        drop = {i for group in groups[:dropped] for i in group}
        prompt = [m for i, m in enumerate(row.prompt) if i not in drop]
        example = build(prompt)
    if max_prompt_length and example["prompt_length"] > max_prompt_length:
        raise RowRejected(DropReason.TOO_LONG, f"prompt: {example['prompt_length']} tokens > max_prompt_length="
                          f"{max_prompt_length} with {dropped} of {len(groups)} middle prompt exchanges dropped")
    try:
        example = build(prompt, cut=True)
    except RowRejected as rej:
        if rej.reason != DropReason.TOO_LONG:
            raise
        raise RowRejected(DropReason.TOO_LONG, f"{rej.detail}; with {dropped} of {len(groups)} middle prompt "
                          "exchanges dropped") from None
    return FittedUnpaired(example, before, dropped)


def process_unpaired_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None,
                          positions: list[int] | None = None, texts: list[str] | None = None) -> dict[str, list]:
    """A batch of raw unpaired rows (``data.objective: unpaired``, KTO) -> ``processed.UNPAIRED_ROW``'s pipeline
    columns (``rows.Batch.of`` says what the keywords name), a sequence or a refusal per row.

    Each row: ``canonicalize_unpaired`` -> ``min_chars`` / ``max_chars`` over prompt and completion ->
    ``data.rule_check`` on a sample -> the dedup hash -> ``fit_unpaired`` (within ``max_length``,
    ``max_prompt_length``, ``max_response_length``). ``prompt_length`` is its prompt's tokens, ``desirable`` its
    label; ``dropped_turns`` the prompt exchanges dropped; ``token_fallback`` is ``"right"`` where the completion
    was cut."""
    b = Batch.of(batch, UNPAIRED_ROW, tokenizer, cfg, locations=locations, positions=positions, texts=texts)

    def unpaired_row(i: int, row) -> None:
        out = b.outs[i]
        unpaired = guarded(canonicalize_unpaired, row, cfg, tokenizer=tokenizer)
        out["parse_report"] = report_json(unpaired.report)  # a row refused from here on is counted as parsed
        check_length(content_chars(unpaired.prompt + unpaired.completion), cfg)
        b.check_responses(i, unpaired.report, unpaired.prompt, {"completion": unpaired.completion}, unpaired.tools,
                          tokenizer)
        if cfg.dedup:
            out["content_hash"] = guarded(content_hash, ["unpaired", unpaired.prompt, unpaired.completion,
                                                         unpaired.desirable, unpaired.tools])
        fitted = guarded(fit_unpaired, unpaired, tokenizer, max_length=cfg.max_length, policy=b.policy,
                         on_too_long=cfg.on_too_long, max_prompt_length=cfg.max_prompt_length,
                         max_response_length=cfg.max_response_length)
        ex = fitted.example
        if ex["reasoning_dropped_turns"]:
            unpaired.report.reasoning_dropped_rows = 1
            unpaired.report.reasoning_dropped_turns = ex["reasoning_dropped_turns"]
        out.update({key: ex[key] for key in ("input_ids", "attention_mask", "labels", "prompt_length")})
        if ex["images"]:
            out.update(images=ex["images"], num_images=len(ex["images"]), num_image_tokens=ex["num_image_tokens"])
        out.update(desirable=int(unpaired.desirable), num_tokens_before=fitted.tokens_before,
                   num_tokens=len(ex["input_ids"]),
                   num_trained_tokens=len(ex["labels"]) - ex["labels"].count(IGNORE_INDEX),
                   dropped_turns=fitted.dropped_turns, token_fallback="right" if ex["cut"] else "",
                   parse_report=report_json(unpaired.report))

    b.each(unpaired_row)
    return b.columns()
