"""Prompt rows (GRPO): a raw row -> a prompt to sample completions for, and the columns its rewards read.

    >>> row = canonicalize_prompt({"prompt": "2+2?", "answer": "4"})
    >>> row.prompt, row.columns
    ([{'role': 'user', 'content': '2+2?'}], {'answer': '4'})
    >>> fitted = fit_prompt(row, tok, max_prompt_length=64)  # Qwen3's template
    >>> tok.decode(fitted.prompt.input_ids), fitted.prompt.generation_prompt_tokens
    ('<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n', 3)

A prompt row is one of (after ``data.field_mappings``):

- a ``prompt`` (or ``question``) column, a string (one user turn) or a message list, or ``instruction`` (+
  ``input``, joined as for Alpaca rows): TRL's prompt-only form, as a pair's or an unpaired row's prompt is read;
- a conversation (``data.messages_field``, ``messages``, ``conversations``: OpenAI or ShareGPT messages) ending with
  a user turn or a tool result.

Either way it must end with a user turn or a tool result: a conversation ending with an assistant turn is refused as
``prompt_ends_with_assistant`` (there is nothing left for the model to write). A row's ``system`` column opens the
prompt, ``data.tools_columns`` give its tools (with ``rl.tools``, ``data.prompt_tools``: every prompt has their
schemas as its tools, so its length counts them, and a row with tools of its own is refused,
``tools_beside_rl_tools``: the model would be shown tools its rollouts cannot run), images are refused
(``bad_image``: not supported yet). Every other column is kept, by its own name, for the reward functions
(``columns``: TRL passes a row's columns but ``prompt``, ``completion`` and ``completion_ids``; so does this, and
leaves out the message list a conversation's prompt was
read from); a column named like an argument of the reward call
(``prompts``, ``completions``, ``completion_ids``, ``trainer_state``) refuses the row (``bad_row``), which would
otherwise be lost or break every call.

The prompt's ids are the engine's (``masking.render_prompt``): the render with the generation prompt, tokenized in
one piece; none is ever trained. A prompt over ``data.max_prompt_length`` (``train.method: grpo``: ``max_length -
rl.max_completion_length``) loses whole middle exchanges, oldest first (the system message and the last exchange
kept, as a pair's prompt); one still over it is ``too_long``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from qlora_train.config import DataConfig
from qlora_train.data.drops import DropReason
from qlora_train.data.pairs import PROMPT_KEYS, _messages
from qlora_train.data.parse import (
    MESSAGE_KEYS,
    ParseReport,
    canonical_messages,
    check_user_turns,
    instruction_prompt,
    map_fields,
    row_image_column,
    row_tools,
    with_row_system,
)
from qlora_train.data.processed import PROMPT_ROW
from qlora_train.data.rows import Batch, check_length, content_chars, content_hash, guarded, report_json
from qlora_train.data.truncate import middle_exchanges
from qlora_train.masking import Message, RenderedPrompt, RowRejected, render_prompt

# a row's columns TRL leaves out of the reward call (the prompt is its `prompts`); those the call itself names
NOT_REWARD_COLUMNS = ("prompt", "completion", "completion_ids")
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
PROMPT_FORMATS = ("prompt", "instruction", "messages")  # CanonicalPrompt.format


@dataclass
class CanonicalPrompt:
    """A prompt row in canonical messages, its tools and the columns its rewards read."""

    prompt: list[Message]
    tools: list[dict] | None
    columns: dict  # the row's other columns by name (JSON values), for the reward functions
    format: str  # one of PROMPT_FORMATS
    report: ParseReport = field(default_factory=ParseReport)


def canonicalize_prompt(row: dict, cfg: DataConfig | None = None, *, tokenizer=None) -> CanonicalPrompt:
    """A raw prompt row -> ``CanonicalPrompt``, or ``RowRejected`` with a reason (see the module doc)."""
    cfg = cfg or DataConfig()
    if isinstance(row, list):  # a bare message list
        row = {cfg.messages_field: row}
    if not isinstance(row, dict):
        raise RowRejected(DropReason.BAD_ROW, f"row is a {type(row).__name__}, not a mapping")
    clash = [k for k in REWARD_ARGUMENTS if k in row]
    if clash:
        raise RowRejected(DropReason.BAD_ROW, f"column '{clash[0]}' has the name of an argument the reward functions "
                          f"are called with ({', '.join(REWARD_ARGUMENTS)}): rename it in the data")
    columns = {k: v for k, v in row.items() if k not in NOT_REWARD_COLUMNS}
    mapped = map_fields(row, cfg.field_mappings)
    found = row_image_column(mapped, cfg)
    if found is not None:
        raise RowRejected(DropReason.BAD_IMAGE, f"column '{found[0]}': images in prompt rows are not supported yet")
    report = ParseReport(schema="prompt", schemas={"prompt": 1}, rows=1)
    prompt_key = next((k for k in PROMPT_KEYS if k in mapped), None)
    messages_key = next((k for k in (cfg.messages_field, *MESSAGE_KEYS) if isinstance(mapped.get(k), list)), None)
    if prompt_key is not None:
        prompt, form = _messages(mapped[prompt_key], prompt_key, "user", cfg, report, tokenizer), "prompt"
    elif "instruction" in mapped:
        prompt = _messages(instruction_prompt(mapped, cfg), "instruction", "user", cfg, report, tokenizer)
        form = "instruction"
    elif messages_key is not None:
        raw = mapped[messages_key]
        first = raw[0] if raw and isinstance(raw[0], dict) else {}
        schema = "sharegpt" if "from" in first and "value" in first else "messages"
        prompt = canonical_messages(raw, cfg, report, schema=schema, tokenizer=tokenizer)
        form = "messages"
        columns.pop(messages_key, None)  # the prompt itself: the reward functions get it as `prompts`
    else:
        raise RowRejected(DropReason.UNKNOWN_SCHEMA, f"a prompt row (train.method: grpo) needs 'prompt' (or "
                          f"'question', 'instruction') or a message list ('{cfg.messages_field}'); it has keys "
                          f"{sorted(row)[:8]} (data.field_mappings names other columns, e.g. {{prompt: problem}})")
    prompt = with_row_system(prompt, mapped, cfg, report)
    check_prompt_row(prompt)
    tools = row_tools(mapped, cfg, report)
    if cfg.prompt_tools:  # an agent run: every prompt is rendered with the tools its rollouts run, decided here
        if tools is not None:
            column = next((c for c in cfg.tools_columns if mapped.get(c) not in (None, "", [])), "tools")
            raise RowRejected(DropReason.TOOLS_BESIDE_RL_TOOLS, f"column '{column}': the row gives its own tools, but "
                              "with rl.tools every prompt is rendered with rl.tools' schemas (the tools its rollouts "
                              "can run): drop the column, or leave rl.tools out to sample plain completions")
        tools = tool_schemas(tuple(cfg.prompt_tools))
    return CanonicalPrompt(prompt, tools, columns, form, report=report)


@functools.lru_cache(maxsize=4)
def tool_schemas(specs: tuple[str, ...]) -> list[dict]:
    """``data.prompt_tools`` (``rl.tools``) -> their JSON schemas (``rl.tools.load_tools``), read once per
    process."""
    from qlora_train.rl.tools import load_tools

    return [tool.schema for tool in load_tools(specs)]


def check_prompt_row(prompt: list[Message]) -> None:
    """A prompt must end with a user turn or a tool result (``prompt_ends_with_assistant`` where the model's turn is
    last), and each of its user turns say something (``empty_user_turn``)."""
    if not prompt:
        raise RowRejected(DropReason.PAIR_BAD_PROMPT, "the prompt is empty: nothing for a completion to answer")
    last = prompt[-1]["role"]
    if last == "assistant":
        raise RowRejected(DropReason.PROMPT_ENDS_WITH_ASSISTANT, f"messages[{len(prompt) - 1}]: the prompt ends with "
                          "an assistant turn, so there is nothing left to sample (GRPO writes that turn): drop the "
                          "last assistant turn from such rows, or train them with train.method: sft")
    if last not in ("user", "tool"):
        raise RowRejected(DropReason.PAIR_BAD_PROMPT, f"the prompt ends with a {last} message: it must end with a "
                          "user turn (or a tool result) for a completion to answer")
    check_user_turns(prompt, "prompt")


@dataclass(frozen=True)
class FittedPrompt:
    """A prompt row's render within its limit (``fit_prompt``) and what fitting it took."""

    prompt: RenderedPrompt
    messages: list[Message]  # the prompt as rendered (without the middle exchanges dropped)
    tokens_before: int  # before middle exchanges were dropped
    dropped_turns: int = 0  # middle exchanges dropped


def fit_prompt(row: CanonicalPrompt, tokenizer, *, max_prompt_length: int, on_too_long: str = "truncate",
               layout=None) -> FittedPrompt:
    """A canonical prompt -> its ``RenderedPrompt`` within ``max_prompt_length`` tokens, or ``RowRejected``
    (``too_long``; at once with ``on_too_long: drop``)."""
    def render(messages: list[Message]) -> RenderedPrompt:
        return render_prompt(messages, tokenizer, tools=row.tools, layout=layout)

    rendered = render(row.prompt)
    before = rendered.num_tokens
    if before <= max_prompt_length:
        return FittedPrompt(rendered, row.prompt, before)
    if on_too_long == "drop":
        raise RowRejected(DropReason.TOO_LONG, f"prompt: {before} tokens > max_prompt_length={max_prompt_length} "
                          "(data.on_too_long: drop)")
    groups = middle_exchanges(row.prompt)
    for dropped in range(1, len(groups) + 1):
        drop = {i for group in groups[:dropped] for i in group}
        messages = [m for i, m in enumerate(row.prompt) if i not in drop]
        rendered = render(messages)
        if rendered.num_tokens <= max_prompt_length:
            return FittedPrompt(rendered, messages, before, dropped)
    raise RowRejected(DropReason.TOO_LONG, f"prompt: {rendered.num_tokens} tokens > max_prompt_length="
                      f"{max_prompt_length} with {len(groups)} of {len(groups)} middle exchanges dropped (with "
                      "train.method: grpo the limit is data.max_length - rl.max_completion_length)")


def reward_columns_json(columns: dict) -> str:
    """A row's reward columns as the JSON text a processed row stores (``bad_row`` for a value JSON cannot hold).

    >>> reward_columns_json({"answer": "4", "tests": [1, 2]})
    '{"answer": "4", "tests": [1, 2]}'
    """
    try:
        return json.dumps(columns)  # ASCII: a lone surrogate of a data file is stored as its escape
    except (TypeError, ValueError) as exc:
        raise RowRejected(DropReason.BAD_ROW, f"a column the reward functions read cannot be stored: {exc}") from None


def process_prompt_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None,
                        positions: list[int] | None = None, texts: list[str] | None = None) -> dict[str, list]:
    """A batch of raw prompt rows (``data.objective: prompt``, GRPO) -> ``processed.PROMPT_ROW``'s pipeline columns
    (``rows.Batch.of`` says what the keywords name), a prompt or a refusal per row.

    Each row: ``canonicalize_prompt`` -> ``min_chars`` / ``max_chars`` over the prompt -> the dedup hash (the
    prompt, its tools and its reward columns) -> ``fit_prompt`` within ``data.max_prompt_length`` (else
    ``max_length``). ``num_tokens`` is the prompt's tokens, ``num_trained_tokens`` 0 (completions are sampled in
    training); ``prompt`` is the prompt's messages as JSON (what the reward functions get as ``prompts``),
    ``reward_columns`` the row's other columns as JSON."""
    b = Batch.of(batch, PROMPT_ROW, tokenizer, cfg, locations=locations, positions=positions, texts=texts)
    limit = cfg.max_prompt_length or cfg.max_length

    def prompt_row(i: int, row) -> None:
        out = b.outs[i]
        canon = guarded(canonicalize_prompt, row, cfg, tokenizer=tokenizer)
        out["parse_report"] = report_json(canon.report)  # a row refused from here on is counted as parsed
        check_length(content_chars(canon.prompt), cfg)
        columns = reward_columns_json(canon.columns)
        if cfg.dedup:
            out["content_hash"] = guarded(content_hash, ["prompt", canon.prompt, canon.tools, canon.columns])
        fitted = guarded(fit_prompt, canon, tokenizer, max_prompt_length=limit, on_too_long=cfg.on_too_long,
                         layout=b.layout)
        rendered = fitted.prompt
        out.update(input_ids=rendered.input_ids, prompt=json.dumps(fitted.messages),
                   reward_columns=columns, generation_prompt_tokens=rendered.generation_prompt_tokens,
                   num_tokens_before=fitted.tokens_before, num_tokens=rendered.num_tokens, num_trained_tokens=0,
                   dropped_turns=fitted.dropped_turns)

    b.each(prompt_row)
    return b.columns()
