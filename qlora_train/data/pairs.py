"""Preference pairs (DPO, ORPO): a raw row -> a prompt and two responses -> two sequences sharing the prompt.

    >>> pair = canonicalize_pair({"prompt": "2+2?", "chosen": "4", "rejected": "5"})
    >>> pair.prompt, pair.chosen
    ([{'role': 'user', 'content': '2+2?'}], [{'role': 'assistant', 'content': '4'}])
    >>> ex = build_preference_example(pair.prompt, pair.chosen, pair.rejected, tok)  # Qwen3's template
    >>> tok.decode(ex["chosen_input_ids"][:ex["prompt_length"]])
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
    >>> tok.decode([t for t in ex["rejected_labels"] if t != -100])
    '<think>\\n\\n</think>\\n\\n5<|im_end|>'

The pair's two sides and their shared prompt are the engine's (``masking.mask_pair``: each side exactly what SFT
trains for ``prompt + response`` with only the response's assistant turns trained, the prompt checked shared on
both sides). Here: the row's formats (``canonicalize_pair``), its filters (``check_score_margin``), the pair cut to
its limits (``build_preference_example``, ``fit_pair``), and the pipeline (``process_pair_rows``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from qlora_train.config import DataConfig
from qlora_train.data.drops import DropReason
from qlora_train.data.parse import (
    ParseReport,
    RowImages,
    canonical_messages,
    check_user_turns,
    content_text,
    instruction_prompt,
    is_text_parts,
    map_fields,
    refuse_row_images,
    row_tools,
    with_row_system,
)
from qlora_train.data.processed import PAIR_ROW
from qlora_train.data.rows import Batch, check_length, content_chars, content_hash, guarded, report_json
from qlora_train.data.truncate import exchanges_to_fit, measure, middle_exchanges, trim_reasoning
from qlora_train.masking import (
    DEFAULT_POLICY,
    IGNORE_INDEX,
    SIDES,
    LossPolicy,
    Message,
    RowRejected,
    image_rule,
    mark_side,
    mask_pair,
    message_images,
    pair_policy,
)

# the layouts of a preference row canonicalize_pair reads (CanonicalPair.format)
PAIR_FORMATS = ("prompt_chosen_rejected", "instruction", "implicit_prompt", "hh_rlhf")
PROMPT_KEYS = ("prompt", "question")  # an explicit prompt: a string or a message list
RESPONSE_ROLES = ("assistant", "tool")  # what a response may hold: the model's turns and the tool results they get


@dataclass
class CanonicalPair:
    """A preference row in canonical messages (not yet marked: ``build_preference_example`` marks them)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]
    tools: list[dict] | None
    format: str  # one of PAIR_FORMATS
    score_chosen: float | None = None  # for data.min_score_margin (check_score_margin)
    score_rejected: float | None = None
    report: ParseReport = field(default_factory=ParseReport)


# ----------------------------------------------------------------------------------------------- the row's format


def canonicalize_pair(row: dict, cfg: DataConfig | None = None, *, tokenizer=None) -> CanonicalPair:
    """A raw preference row -> ``CanonicalPair``, or ``RowRejected`` with a reason.

    Formats (after ``cfg.field_mappings``), in this order:

    - ``prompt_chosen_rejected``: ``prompt`` (or ``question``) a string or a message list; ``chosen`` and
      ``rejected`` each a string (one assistant answer; an inline ``<think>`` block is its reasoning) or a
      message list (the response: assistant turns and tool results) — TRL's standard and conversational forms;
    - ``instruction``: ``instruction`` (+ ``input``, joined as for Alpaca rows: ``data.format``) with ``chosen``
      and ``rejected``;
    - ``implicit_prompt``: ``chosen`` and ``rejected`` whole conversations (message lists) that share their
      beginning: the prompt is the longest shared message prefix that both sides follow with an assistant
      message; with a prompt column too (UltraFeedback-binarized), both conversations must open with it
      (``split_repeated_prompt``);
    - ``hh_rlhf``: ``chosen`` and ``rejected`` Anthropic HH transcripts (``\\n\\nHuman: …\\n\\nAssistant: …``),
      split into messages (each stripped), then as ``implicit_prompt``.

    Messages go through the chat rows' normalisation (``parse.canonical_messages``: role and key mappings,
    reasoning keys, inline think blocks, tool calls, ``think_mode``); tools through ``parse.row_tools``. The
    row's ``system`` column opens the prompt as every schema's does (``parse.with_row_system``). A string side (or
    prompt) is one message whose content is made text as every content is (``parse.content_text``: ``42`` is ``"42"``);
    a null side is a missing one (``pair_missing_side``). A VLFeedback row (``completions`` rated by aspect, no
    ``chosen`` / ``rejected``) is made a pair first (``vlfeedback_row``: the highest rated against the lowest).
    ``score_chosen`` / ``score_rejected`` (numbers) are kept. A row with ``completion`` and ``label`` and no pair
    (KTO's unpaired form, ``unpaired.canonicalize_unpaired``) is refused as ``unpaired_preference``.
    """
    cfg = cfg or DataConfig()
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"row is a {type(row).__name__}, not a mapping")
    row = map_fields(row, cfg.field_mappings)
    if "completions" in row and "chosen" not in row and "rejected" not in row:
        row = vlfeedback_row(row)  # VLFeedback's rated completions -> the highest against the lowest
    report = ParseReport(schema="preference", schemas={"preference": 1}, rows=1)
    present = [side for side in SIDES if row.get(side) is not None]
    if len(present) < 2:
        if "completion" in row and "label" in row:
            raise RowRejected(DropReason.UNPAIRED_PREFERENCE, "an unpaired preference row (prompt, completion, "
                              "label): train.method: kto trains it (data.objective: unpaired); dpo and orpo need a "
                              "chosen and a rejected response to the same prompt")
        raise RowRejected(DropReason.PAIR_MISSING_SIDE, missing_side_detail(row, present))

    def messages(value, where: str, role: str = "assistant", images: RowImages | None = None) -> list[Message]:
        return _messages(value, where, role, cfg, report, tokenizer, images)

    prompt_key = next((k for k in PROMPT_KEYS if k in row), None)
    if prompt_key is not None or "instruction" in row:
        fmt = "prompt_chosen_rejected" if prompt_key is not None else "instruction"
        prompt_value = row[prompt_key] if prompt_key is not None else instruction_prompt(row, cfg)
        images = RowImages(row, cfg, report, tokenizer)  # the prompt's: a model does not write images
        prompt_value = images_open_prompt(prompt_value, len(images.pending), cfg)
        prompt = messages(prompt_value, prompt_key or "instruction", "user", images)
        chosen, rejected = messages(row["chosen"], "chosen"), messages(row["rejected"], "rejected")
        if all(response and response[0]["role"] not in RESPONSE_ROLES for response in (chosen, rejected)):
            fmt = "implicit_prompt"  # UltraFeedback-binarized: the prompt column repeated in whole conversations
            one_text = not isinstance(prompt_value, list) or (prompt_value and is_text_parts(prompt_value))
            prompt, chosen, rejected = split_repeated_prompt(prompt, chosen, rejected, text=one_text)
    else:
        refuse_row_images(row, cfg)  # whole conversations or transcripts: images are read in a prompt column only
        if all(isinstance(row[side], list) for side in SIDES):
            fmt = "implicit_prompt"
            prompt, chosen, rejected = split_shared_prompt(messages(row["chosen"], "chosen"),
                                                           messages(row["rejected"], "rejected"))
        elif all(isinstance(row[side], str) and _is_hh(row[side]) for side in SIDES):
            fmt = "hh_rlhf"
            prompt, chosen, rejected = split_shared_prompt(messages(hh_messages(row["chosen"]), "chosen"),
                                                           messages(hh_messages(row["rejected"]), "rejected"))
        else:
            raise RowRejected(DropReason.UNKNOWN_SCHEMA, "'chosen' and 'rejected' without a prompt must be whole "
                              "conversations (message lists) or HH-RLHF transcripts ('\\n\\nHuman: …\\n\\n"
                              f"Assistant: …'); got {type(row['chosen']).__name__} and "
                              f"{type(row['rejected']).__name__} (keys {sorted(row)[:8]})")
    prompt = with_row_system(prompt, row, cfg, report)
    scores = [_score(row, f"score_{side}") for side in SIDES]
    check_pair(prompt, chosen, rejected)
    return CanonicalPair(prompt, chosen, rejected, row_tools(row, cfg, report), fmt, *scores, report=report)


def vlfeedback_row(row: dict) -> dict:
    """A VLFeedback row as downloaded (``prompt``, ``image``, ``models``, ``completions``: one
    ``{"model", "response", "annotations"}`` a model, each annotation ``{"Rating": "1".."5", "Rationale": ...}``
    by aspect: Helpfulness, Visual Faithfulness, Ethical Considerations) -> a pair row (``prompt``, ``image``,
    ``chosen``, ``rejected``, ``score_chosen``, ``score_rejected``): a completion's score is the mean of its
    numeric ratings (a rating that is not a number, e.g. "N/A", is left out; a completion without one is unrated);
    chosen is the highest-scored completion, rejected the lowest (the first in the row's order among equals).
    Fewer than two rated completions, or all rated the same, is refused as ``pair_no_preference``.

    >>> def c(response, *ratings):
    ...     return {"model": response, "response": response,
    ...             "annotations": {f"aspect{k}": {"Rating": r} for k, r in enumerate(ratings)}}
    >>> pair = vlfeedback_row({"prompt": "q", "image": "a.png", "completions": [c("mid", "3", "4"), c("top", "5", "5"),
    ...                        c("low", "1", "N/A"), c("none", "N/A")]})
    >>> pair["chosen"], pair["rejected"], pair["score_chosen"], pair["score_rejected"]
    ('top', 'low', 5.0, 1.0)
    """
    completions = row["completions"]
    if not isinstance(completions, list):
        raise RowRejected(DropReason.BAD_ROW, f"completions: expected a list of rated completions, got "
                          f"{type(completions).__name__}")
    rated = []
    for k, done in enumerate(completions):
        if not isinstance(done, dict) or not isinstance(done.get("response"), str):
            raise RowRejected(DropReason.BAD_ROW, f"completions[{k}]: expected {{model, response, annotations}}, got "
                              f"{str(done)[:80]!r}")
        notes = done.get("annotations") or {}
        ratings = []
        for note in (notes.values() if isinstance(notes, dict) else ()):
            rating = note.get("Rating") if isinstance(note, dict) else None
            try:
                value = float(rating)
            except (TypeError, ValueError):
                continue  # "N/A" or missing: not a rating
            if math.isfinite(value):
                ratings.append(value)
        if ratings:
            rated.append((sum(ratings) / len(ratings), k, done["response"]))
    if len(rated) < 2:
        raise RowRejected(DropReason.PAIR_NO_PREFERENCE, f"{len(rated)} of {len(completions)} completions rated: "
                          "a pair needs two rated completions")
    best = max(rated, key=lambda r: (r[0], -r[1]))
    worst = min(rated, key=lambda r: (r[0], r[1]))
    if best[0] == worst[0]:
        raise RowRejected(DropReason.PAIR_NO_PREFERENCE, f"all {len(rated)} rated completions score {best[0]:g}: "
                          "no preference between them")
    out = {k: v for k, v in row.items() if k not in ("completions", "models")}
    return out | {"chosen": best[2], "rejected": worst[2], "score_chosen": best[0], "score_rejected": worst[0]}


def missing_side_detail(row: dict, present: list[str]) -> str:
    """What a row without both sides has, said for a ``pair_missing_side`` refusal, with the mapping that fixes
    columns named otherwise.

    >>> missing_side_detail({"prompt": "q", "chosen": "a", "rejected": None}, ["chosen"])
    "a preference row needs 'chosen' and 'rejected'; it has chosen, and 'rejected' is null (keys ['chosen', \
'prompt', 'rejected']); columns named otherwise are mapped with data.field_mappings, e.g. {chosen: good, \
rejected: bad} (docs/preference.md#columns-named-otherwise-datafield_mappings)"
    """
    null = [f"'{side}'" for side in SIDES if side in row and row[side] is None]
    has = " and ".join(present) or "neither"
    if null:
        has += f", and {' and '.join(null)} {'is' if len(null) == 1 else 'are'} null"
    return (f"a preference row needs 'chosen' and 'rejected'; it has {has} (keys {sorted(row)[:8]}); columns named "
            "otherwise are mapped with data.field_mappings, e.g. {chosen: good, rejected: bad} "
            "(docs/preference.md#columns-named-otherwise-datafield_mappings)")


def images_open_prompt(prompt, n_images: int, cfg: DataConfig):
    """A pair's prompt text that places none of its row's ``n_images`` column images (no
    ``data.image_placeholder``): the images open it, one placeholder each, as RLAIF-V's rows (``image``,
    ``question``, ``chosen``, ``rejected``) are read by the models trained on them. A prompt that places them
    (placeholders, image content parts) is kept as it is.

    >>> images_open_prompt("What is this?", 1, DataConfig())
    '<image>What is this?'
    """
    if n_images and isinstance(prompt, str) and cfg.image_placeholder not in prompt:
        return cfg.image_placeholder * n_images + prompt
    return prompt


def _messages(value, where: str, role: str, cfg: DataConfig, report: ParseReport, tokenizer,
              images: RowImages | None = None) -> list[Message]:
    """A message list -> canonical messages; any other value is one message of ``role`` whose content is that
    value, made text as every content is (``parse.content_text``: a string, a number, text parts; null is an
    empty content). With ``images`` (the prompt's), its image parts and placeholders take the row's images
    (``parse.RowImages``); without (a response), an image part is ``bad_image``. Errors name ``where``."""
    parts = isinstance(value, list) and bool(value) and all(isinstance(p, dict) and "type" in p for p in value)
    one_text = not isinstance(value, list) or (value and is_text_parts(value)) or (images is not None and parts)
    raw = [{"role": role, "content": value}] if one_text else value
    first = raw[0] if raw and isinstance(raw[0], dict) else {}
    schema = "sharegpt" if "from" in first and "value" in first else "messages"
    try:
        return canonical_messages(raw, cfg, report, schema=schema, tokenizer=tokenizer, images=images)
    except RowRejected as rej:
        raise RowRejected(rej.reason, f"{where}: {rej.detail}") from None


_HH_SPEAKER = re.compile(r"\n\n(Human|Assistant):")


def _is_hh(text: str) -> bool:
    return text.lstrip().startswith("Human:")


def hh_messages(text: str) -> list[dict]:
    """An Anthropic HH transcript -> messages, each content stripped.

    >>> hh_messages("\\n\\nHuman: Hi?\\n\\nAssistant: Hello.")
    [{'role': 'user', 'content': 'Hi?'}, {'role': 'assistant', 'content': 'Hello.'}]
    """
    parts = _HH_SPEAKER.split("\n\n" + text.lstrip())
    return [{"role": "user" if speaker == "Human" else "assistant", "content": body.strip()}
            for speaker, body in zip(parts[1::2], parts[2::2])]


def split_shared_prompt(chosen: list[Message], rejected: list[Message]
                        ) -> tuple[list[Message], list[Message], list[Message]]:
    """Two whole conversations -> ``(prompt, chosen response, rejected response)``: the prompt is their longest
    shared message prefix that both continue with an assistant message.

    >>> u, a, b = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, \\
    ...     {"role": "assistant", "content": "b"}
    >>> split_shared_prompt([u, a], [u, b])
    ([{'role': 'user', 'content': 'q'}], [{'role': 'assistant', 'content': 'a'}], [{'role': 'assistant', \
'content': 'b'}])
    """
    if chosen == rejected:
        raise RowRejected(DropReason.PAIR_IDENTICAL, "chosen and rejected are the same conversation")
    k = 0
    while k < min(len(chosen), len(rejected)) and chosen[k] == rejected[k]:
        k += 1
    while k > 0 and not (k < len(chosen) and k < len(rejected)
                         and chosen[k]["role"] == rejected[k]["role"] == "assistant"):
        k -= 1
    if k == 0:
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, "chosen and rejected share no messages that both continue "
                          "with an assistant turn: there is no common prompt")
    return chosen[:k], chosen[k:], rejected[k:]


def split_repeated_prompt(prompt: list[Message], chosen: list[Message], rejected: list[Message], *, text: bool
                          ) -> tuple[list[Message], list[Message], list[Message]]:
    """A prompt column and two whole conversations that repeat it (UltraFeedback-binarized: ``prompt`` a string,
    ``chosen`` and ``rejected`` each that user turn and an answer) -> ``(prompt, chosen response, rejected
    response)``, split as ``implicit_prompt`` rows are (``split_shared_prompt``).

    Both conversations must open with the prompt: a string prompt (``text``) is the content of their first user
    turn (whitespace at its ends aside), a message list their leading messages. Otherwise the row contradicts
    itself and is refused as ``pair_prompt_differs``.

    >>> u, a, b = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, \\
    ...     {"role": "assistant", "content": "b"}
    >>> split_repeated_prompt([u], [u, a], [u, b], text=True)
    ([{'role': 'user', 'content': 'q'}], [{'role': 'assistant', 'content': 'a'}], [{'role': 'assistant', \
'content': 'b'}])
    """
    for side, conversation in zip(SIDES, (chosen, rejected)):
        if text:
            first_user = next((m["content"] for m in conversation if m["role"] == "user"), None)
            if first_user is None or first_user.strip() != prompt[-1]["content"].strip():
                opens = "it has no user turn" if first_user is None else f"its first user turn is {first_user[:40]!r}"
                raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"{side} is a whole conversation that does not open "
                                  f"with the row's prompt: {opens}, the prompt {prompt[-1]['content'][:40]!r}")
        elif _unmarked(conversation[:len(prompt)]) != _unmarked(prompt):
            raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"{side} is a whole conversation that does not open "
                              f"with the row's prompt: its first {len(prompt)} messages are not the prompt's "
                              f"{len(prompt)} messages")
    return split_shared_prompt(chosen, rejected)


def _score(row: dict, key: str) -> float | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowRejected(DropReason.BAD_ROW, f"{key}: expected a finite number, got {value!r}")
    return float(value)


def check_pair(prompt: list[Message], chosen: list[Message], rejected: list[Message]) -> None:
    """The shape of a pair, before any render: a prompt that ends with a user turn or a tool result
    (``check_prompt``); two responses that differ, each of the shape ``check_response`` checks. Raises
    ``RowRejected`` naming the side and message."""
    check_prompt(prompt)
    for side, response in zip(SIDES, (chosen, rejected)):
        check_response(side, response)
    if _unmarked(chosen) == _unmarked(rejected):
        raise RowRejected(DropReason.PAIR_IDENTICAL, "chosen and rejected are the same response")


def check_prompt(prompt: list[Message]) -> None:
    """A prompt (of a pair, or of an unpaired row) must end with a user turn or a tool result."""
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        last = f"ends with a {prompt[-1]['role']} message" if prompt else "is empty"
        raise RowRejected(DropReason.PAIR_BAD_PROMPT, f"the prompt {last}: it must end with a user turn (or a tool "
                          "result) for a response to answer")
    check_user_turns(prompt, "prompt")


def check_response(side: str, response: list[Message]) -> None:
    """A response (``side``: ``chosen``, ``rejected`` or an unpaired row's ``completion``) opens and ends with an
    assistant turn, holds only assistant turns and tool results, and no empty assistant turn."""
    if not response:
        raise RowRejected(DropReason.PAIR_EMPTY_RESPONSE, f"{side}: no response")
    for j, m in enumerate(response):
        if m["role"] not in RESPONSE_ROLES:
            raise RowRejected(DropReason.PAIR_BAD_RESPONSE, f"{side}[{j}]: a {m['role']!r} message inside the "
                              "response (a response holds assistant turns and tool results only)")
        if m["role"] == "assistant" and not (m["content"].strip() or m.get("tool_calls")
                                             or m.get("reasoning_content")):
            raise RowRejected(DropReason.PAIR_EMPTY_RESPONSE, f"{side}[{j}]: empty assistant turn")
    if response[0]["role"] != "assistant" or response[-1]["role"] != "assistant":
        where, role = (0, response[0]["role"]) if response[0]["role"] != "assistant" else (
            len(response) - 1, response[-1]["role"])
        raise RowRejected(DropReason.PAIR_BAD_RESPONSE, f"{side}[{where}]: the response must open and end with "
                          f"an assistant turn, not a {role!r} message")


def _unmarked(messages: list[Message]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "train"} for m in messages]


# ------------------------------------------------------------------------------------------- the pair's two sides


def _check_messages(messages, where: str) -> None:
    """Messages handed to ``build_preference_example`` directly: a list of mappings with a string role and
    string content."""
    if not isinstance(messages, list):
        raise RowRejected(DropReason.BAD_ROW, f"{where}: expected a list of messages, got {type(messages).__name__}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RowRejected(DropReason.BAD_ROW, f"{where}[{j}]: expected a mapping with a role")
        if not isinstance(m.get("content"), str):
            content_text(m.get("content"), f"{where}[{j}]")  # names what is wrong; text parts are for the parse
            raise RowRejected(DropReason.BAD_CONTENT_TYPE, f"{where}[{j}]: content must be a string (canonical "
                              "messages: canonicalize_pair makes them)")


def build_preference_example(
    prompt: list[Message],
    chosen: list[Message],
    rejected: list[Message],
    tokenizer,
    *,
    tools: list[dict] | None = None,
    policy: LossPolicy = DEFAULT_POLICY,
    max_length: int | None = None,
    max_response_length: int | None = None,
) -> dict:
    """A prompt and two responses (canonical messages) -> the pair's two sequences, or ``RowRejected``.

    Returns ``chosen_input_ids``, ``chosen_attention_mask``, ``chosen_labels`` and the same for ``rejected``
    (each exactly what SFT makes for ``prompt + response`` with only the response's assistant turns trained:
    reasoning per ``policy.think_loss``, content, tool calls, end-of-turn markers per ``pair_policy``);
    ``prompt_length``, the tokens both sides share before the response (``shared_prompt_length``);
    ``boundary_merges``, on how many sides a token straddles the boundary; ``reasoning_dropped_turns``, response
    turns whose reasoning the template does not render (trained without it, as SFT's ``reasoning_history:
    drop``).

    Refused: a pair of the wrong shape (``check_pair``), a side the template or the mask check refuses (its
    reason, the detail naming the side), a prompt rendered or tokenized differently on the two sides
    (``pair_prompt_differs``), two sides with the same ids (``pair_identical``), and, with ``max_length``, a side
    longer than it (``too_long``; ``fit_pair`` drops prompt exchanges and trims reasoning first).

    With ``max_response_length``, a side whose response (its tokens after ``prompt_length``) is longer than it, or
    that is over ``max_length``, is cut instead, at ``side_limit`` tokens (by ``make_labels``, on the right: the
    response loses its end, end-of-turn marker included); ``cut_sides`` names the sides that lost trained tokens.
    A cut that leaves a side nothing trained is ``too_long``, one that leaves the two sides the same ids
    ``pair_identical``.
    """
    for where, messages in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        _check_messages(messages, where)
    check_pair(prompt, chosen, rejected)
    pair = mask_pair(prompt, chosen, rejected, tokenizer, tools=tools, policy=policy)
    prompt_length = pair.prompt_length
    images = message_images(prompt)  # the prompt's, so both sides': its image tokens are in the shared prompt
    out = {"prompt_length": prompt_length, "boundary_merges": pair.boundary_merges,
           "reasoning_dropped_turns": pair.reasoning_dropped_turns, "cut_sides": [],
           "images": [im["ref"] for im in images]}
    limit = side_limit(prompt_length, max_length, max_response_length)
    for side in SIDES:
        masked = pair.side(side)
        if masked.num_tokens > limit:
            if max_response_length is None:
                raise RowRejected(DropReason.TOO_LONG, f"{side}: {masked.num_tokens} tokens > max_length="
                                  f"{max_length} (fit_pair drops prompt exchanges and trims reasoning first; "
                                  "data.max_response_length would cut the response)")
            if masked.trains_past(limit):  # else only the template's untrained tail goes
                out["cut_sides"].append(side)
        example = masked.example(max_length=limit, truncate_side="right")
        if side in out["cut_sides"] and example["labels"].count(IGNORE_INDEX) == len(example["labels"]):
            raise RowRejected(DropReason.TOO_LONG, f"{side}: nothing of the response is trained within {limit} "
                              f"tokens (the shared prompt has {prompt_length}; max_length={max_length}, "
                              f"max_response_length={max_response_length})")
        out.update({f"{side}_{key}": value for key, value in example.items()})
    if out["cut_sides"] and out["chosen_input_ids"] == out["rejected_input_ids"]:
        raise RowRejected(DropReason.PAIR_IDENTICAL, f"chosen and rejected are the same {limit} tokens once cut "
                          f"(max_response_length={max_response_length}, max_length={max_length})")
    if images:
        out["num_image_tokens"] = _check_pair_images(out, image_rule(tokenizer).image_token_id)
    return out


def _check_pair_images(example: dict, image_token_id: int) -> int:
    """A pair with images: its image tokens, all in the shared prompt (``prompt_length``) and the same there on
    both sides (``mask_pair`` checked the prompt's ids), none trained on either side (checked, not trusted) -> how
    many there are on each side."""
    counts = []
    for side in SIDES:
        ids, labels = example[f"{side}_input_ids"], example[f"{side}_labels"]
        if image_token_id in labels:
            raise RowRejected(DropReason.MASK_UNVERIFIED, f"{side}: an image token is trained")
        counts.append(ids.count(image_token_id))
        if ids[example["prompt_length"]:].count(image_token_id):
            raise RowRejected(DropReason.BAD_IMAGE, f"{side}: image tokens after the shared prompt")
    if counts[0] != counts[1]:
        raise RowRejected(DropReason.PAIR_PROMPT_DIFFERS, f"the sides hold {counts[0]} and {counts[1]} image tokens")
    return counts[0]


def side_limit(prompt_length: int, max_length: int | None, max_response_length: int | None) -> int | float:
    """The most tokens a side may keep: ``max_length``, and at most ``max_response_length`` after the shared
    prompt (no limit: ``inf``).

    >>> side_limit(100, 512, 64), side_limit(100, 512, None), side_limit(100, None, None)
    (164, 512, inf)
    """
    limits = [n for n in (max_length, max_response_length and prompt_length + max_response_length) if n]
    return min(limits, default=math.inf)


# ------------------------------------------------------------------------------- filters and truncation of a pair


def check_score_margin(pair: CanonicalPair, min_margin: float | None) -> None:
    """``data.min_score_margin``: a pair whose ``score_chosen - score_rejected`` is below ``min_margin``, or that
    lacks either score, is refused as ``below_score_margin`` (``None``: no filter).

    >>> check_score_margin(CanonicalPair([], [], [], None, "instruction", 7.0, 6.5), 1.0)
    Traceback (most recent call last):
    ...
    qlora_train.masking.messages.RowRejected: below_score_margin: score_chosen - score_rejected = 0.5 < \
data.min_score_margin=1
    """
    if min_margin is None:
        return
    if pair.score_chosen is None or pair.score_rejected is None:
        missing = " and ".join(k for k, v in (("score_chosen", pair.score_chosen),
                                              ("score_rejected", pair.score_rejected)) if v is None)
        raise RowRejected(DropReason.BELOW_SCORE_MARGIN, f"no {missing}: data.min_score_margin={min_margin:g} "
                          "compares the two scores")
    margin = pair.score_chosen - pair.score_rejected
    if margin < min_margin:
        raise RowRejected(DropReason.BELOW_SCORE_MARGIN, f"score_chosen - score_rejected = {margin:g} < "
                          f"data.min_score_margin={min_margin:g}")


@dataclass(frozen=True)
class FittedPair:
    """A pair's example within its limits (``fit_pair``) and what fitting it took."""

    example: dict  # build_preference_example's columns
    tokens_before: int  # both sides' tokens before truncation
    dropped_turns: int = 0  # middle prompt exchanges dropped
    reasoning_trimmed_tokens: int = 0  # rendered reasoning trimmed: the prompt's, then each response's
    cut_sides: tuple[str, ...] = ()  # sides whose response was cut at the token level (data.max_response_length)


def side_lengths(example: dict) -> dict[str, int]:
    """``{"chosen": tokens, "rejected": tokens}`` of a pair's example."""
    return {side: len(example[f"{side}_input_ids"]) for side in SIDES}


def trained_tokens(example: dict) -> int:
    """Trained tokens of both sides together."""
    return sum(len(example[f"{side}_labels"]) - example[f"{side}_labels"].count(IGNORE_INDEX) for side in SIDES)


@dataclass(frozen=True)
class PairLimits:
    """What a pair must fit: ``data.max_length`` per side, and optionally ``data.max_prompt_length`` (the shared
    prompt) and ``data.max_response_length`` (each response, the tokens after the prompt)."""

    max_length: int
    max_prompt_length: int | None = None
    max_response_length: int | None = None

    def prompt_excess(self, example: dict) -> int:
        """Tokens the prompt must lose: for ``max_prompt_length``, and for the longer side over ``max_length``."""
        over_prompt = example["prompt_length"] - (self.max_prompt_length or example["prompt_length"])
        return max(over_prompt, max(side_lengths(example).values()) - self.max_length, 0)

    def side_limit(self, example: dict) -> int | float:
        return side_limit(example["prompt_length"], self.max_length, self.max_response_length)

    def fits(self, example: dict) -> bool:
        return not self.prompt_excess(example) and max(side_lengths(example).values()) <= self.side_limit(example)


def fit_pair(pair: CanonicalPair, tokenizer, *, max_length: int, policy: LossPolicy = DEFAULT_POLICY,
             on_too_long: str = "truncate", max_prompt_length: int | None = None,
             max_response_length: int | None = None) -> FittedPair:
    """A canonical pair -> its example within its limits (``PairLimits``), or ``RowRejected``.

    Each step only if the previous was not enough (the order of SFT's structured truncation):

    1. the prompt, shared by both sides, so shortened once for both: the leading system message(s) and the last
       exchange (the last user message and what follows it in the prompt) are kept, whole middle exchanges are
       dropped, oldest first (as many as the longer side's one render says, ``truncate.exchanges_to_fit``, then
       one more at a time), then the prompt's rendered reasoning is trimmed (``truncate.trim_reasoning``); a
       prompt still over ``max_prompt_length`` is ``too_long``;
    2. each response over its side's limit: its rendered reasoning trimmed, the longest first, from its end;
    3. a side still over its limit is cut at it with ``max_response_length`` (``build_preference_example``:
       the response loses its end, counted in ``cut_sides``), and is ``too_long`` without it.

    A response is never orphaned (its prompt's last exchange is kept) and never cut unless
    ``max_response_length`` is set. ``on_too_long: drop`` refuses any pair over a limit as ``too_long``.
    """
    limits = PairLimits(max_length, max_prompt_length, max_response_length)
    responses = {"chosen": pair.chosen, "rejected": pair.rejected}

    def build(prompt: list[Message], cut: bool = False) -> dict:
        return build_preference_example(prompt, responses["chosen"], responses["rejected"], tokenizer,
                                        tools=pair.tools, policy=policy, max_length=max_length if cut else None,
                                        max_response_length=max_response_length if cut else None)

    def render(prompt: list[Message], side: str, *, prompt_turns: bool = False):
        """The side's render, measured; with ``prompt_turns`` also the prompt's assistant turns marked (the same
        text: a render has the spans of its trained turns only, and the prompt's reasoning is what is trimmed)."""
        messages = mark_side(prompt, responses[side], side_policy)
        if prompt_turns:
            messages = side_policy.mark([{**m, "train": m["role"] == "assistant"} for m in messages])
        return messages, measure(messages, tokenizer, tools=pair.tools, policy=side_policy)

    example = build(pair.prompt)
    before = sum(side_lengths(example).values())
    if limits.fits(example):
        return FittedPair(example, before)
    if on_too_long == "drop":
        raise RowRejected(DropReason.TOO_LONG, f"{_over(example, limits)} (data.on_too_long: drop)")
    side_policy = pair_policy(policy)
    prompt, dropped, trimmed = pair.prompt, 0, 0
    # 1. the prompt: middle exchanges, oldest first, then its rendered reasoning
    groups = middle_exchanges(prompt)
    if limits.prompt_excess(example) and groups:
        longer = max(SIDES, key=side_lengths(example).__getitem__)
        _, measured = render(prompt, longer)
        n = max(1, exchanges_to_fit(measured, groups, measured.num_tokens - limits.prompt_excess(example)))
        while True:
            drop = {i for group in groups[:n] for i in group}
            kept = [m for i, m in enumerate(pair.prompt) if i not in drop]
            example = build(kept)
            if not limits.prompt_excess(example) or n == len(groups):
                prompt, dropped = kept, n
                break
            n += 1
    if limits.prompt_excess(example) and any(m.get("reasoning_content") for m in prompt):
        longer = max(SIDES, key=side_lengths(example).__getitem__)
        try:
            messages, measured = render(prompt, longer, prompt_turns=True)
            messages, _, n_trimmed = trim_reasoning(
                messages, measured, measured.num_tokens - limits.prompt_excess(example), tokenizer,
                tools=pair.tools, policy=side_policy, turns=range(len(prompt)))
        except RowRejected:  # the prompt's turns cannot be verified as trained ones: their reasoning stays
            n_trimmed = 0
        if n_trimmed:
            prompt, trimmed = _reasoning_of(messages, prompt), trimmed + n_trimmed
            example = build(prompt)
    if limits.max_prompt_length and example["prompt_length"] > limits.max_prompt_length:
        raise RowRejected(DropReason.TOO_LONG, f"prompt: {example['prompt_length']} tokens > max_prompt_length="
                          f"{limits.max_prompt_length} with {dropped} of {len(groups)} middle prompt exchanges "
                          "dropped and its reasoning trimmed (a pair keeps the system message and the prompt's last "
                          "exchange)")
    # 2. each response over its side's limit: its rendered reasoning
    lengths, limit = side_lengths(example), limits.side_limit(example)
    for side in (s for s in SIDES if lengths[s] > limit):
        messages, measured = render(prompt, side)
        messages, _, n_trimmed = trim_reasoning(messages, measured, limit, tokenizer, tools=pair.tools,
                                                policy=side_policy, turns=range(len(prompt), len(messages)))
        if n_trimmed:
            responses[side], trimmed = _reasoning_of(messages[len(prompt):], responses[side]), trimmed + n_trimmed
    # 3. what is still over: cut with max_response_length, too_long without (build_preference_example says which)
    try:
        example = build(prompt, cut=True)
    except RowRejected as rej:
        if rej.reason != DropReason.TOO_LONG:
            raise
        raise RowRejected(DropReason.TOO_LONG, f"{rej.detail}; with {dropped} of {len(groups)} middle prompt "
                          f"exchanges dropped and {trimmed} reasoning tokens trimmed") from None
    return FittedPair(example, before, dropped, trimmed, tuple(example["cut_sides"]))


def _over(example: dict, limits: PairLimits) -> str:
    """What of a pair is over its limits, for a ``too_long`` detail."""
    lengths = side_lengths(example)
    longer = max(SIDES, key=lengths.__getitem__)
    if limits.max_prompt_length and example["prompt_length"] > limits.max_prompt_length:
        return f"prompt: {example['prompt_length']} tokens > max_prompt_length={limits.max_prompt_length}"
    if lengths[longer] > limits.max_length:
        return f"{longer}: {lengths[longer]} tokens > max_length={limits.max_length}"
    return (f"{longer}: {lengths[longer] - example['prompt_length']} response tokens > max_response_length="
            f"{limits.max_response_length}")


def _reasoning_of(trimmed: list[Message], originals: list[Message]) -> list[Message]:
    """``originals`` with the ``reasoning_content`` of their trimmed renders (marked copies, same order)."""
    out = []
    for original, t in zip(originals, trimmed):
        m = {k: v for k, v in original.items() if k != "reasoning_content"}
        if "reasoning_content" in t:
            m["reasoning_content"] = t["reasoning_content"]
        out.append(m)
    return out


# ------------------------------------------------------------------------------------------------ the pipeline


def process_pair_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None,
                      positions: list[int] | None = None, texts: list[str] | None = None) -> dict[str, list]:
    """A batch of raw preference rows (``data.objective: preference``) -> ``processed.PAIR_ROW``'s pipeline columns
    (``rows.Batch.of`` says what the keywords name), a pair or a refusal per row.

    Each row: ``canonicalize_pair`` -> ``data.min_score_margin`` (``check_score_margin``) -> ``min_chars`` /
    ``max_chars`` over prompt and both responses -> ``data.rule_check`` on a sample (both sides) -> the dedup hash
    -> ``fit_pair`` (both sides within ``max_length`` and the per-side limits). ``num_tokens_before`` /
    ``num_tokens`` / ``num_trained_tokens`` / ``reasoning_trimmed_tokens`` count both sides; ``dropped_turns`` the
    prompt exchanges dropped; ``cut_sides`` names the sides whose response was cut. A pair is built with its own
    tokenizer call."""
    b = Batch.of(batch, PAIR_ROW, tokenizer, cfg, locations=locations, positions=positions, texts=texts)

    def pair_row(i: int, row) -> None:
        out = b.outs[i]
        pair = guarded(canonicalize_pair, row, cfg, tokenizer=tokenizer)
        out["parse_report"] = report_json(pair.report)  # a pair refused from here on is counted as parsed
        check_score_margin(pair, cfg.min_score_margin)
        check_length(content_chars(pair.prompt + pair.chosen + pair.rejected), cfg)
        b.check_responses(i, pair.report, pair.prompt, {"chosen": pair.chosen, "rejected": pair.rejected},
                          pair.tools, tokenizer)
        if cfg.dedup:
            out["content_hash"] = guarded(content_hash, ["preference", pair.prompt, pair.chosen, pair.rejected,
                                                         pair.tools])
        fitted = guarded(fit_pair, pair, tokenizer, max_length=cfg.max_length, policy=b.policy,
                         on_too_long=cfg.on_too_long, max_prompt_length=cfg.max_prompt_length,
                         max_response_length=cfg.max_response_length)
        ex = fitted.example
        if ex["reasoning_dropped_turns"]:
            pair.report.reasoning_dropped_rows = 1
            pair.report.reasoning_dropped_turns = ex["reasoning_dropped_turns"]
        lengths = side_lengths(ex)
        out.update({f"{side}_{key}": ex[f"{side}_{key}"] for side in SIDES for key in ("input_ids", "labels")})
        if ex["images"]:
            out.update(images=ex["images"], num_images=len(ex["images"]), num_image_tokens=ex["num_image_tokens"])
        out.update(prompt_length=ex["prompt_length"], chosen_tokens=lengths["chosen"],
                   rejected_tokens=lengths["rejected"], num_tokens_before=fitted.tokens_before,
                   num_tokens=sum(lengths.values()), num_trained_tokens=trained_tokens(ex),
                   dropped_turns=fitted.dropped_turns, reasoning_trimmed_tokens=fitted.reasoning_trimmed_tokens,
                   cut_sides=",".join(fitted.cut_sides), parse_report=report_json(pair.report))

    b.each(pair_row)
    return b.columns()
