"""The objectives (``data.objective``) and their pipelines: what a raw row becomes is decided here, once.

``objective(cfg)`` is the ``Objective`` a data config names: its row type (``processed.RowType``: the columns a
processed row holds), its pipeline (a batch of raw rows -> the row type's pipeline columns, one row each, kept or
refused with its reason) and its conversations (what the pipeline renders of a raw row, for ``--debug-samples``'
both masks of a refused row):

- ``sft``: ``sft.process_sft_rows``, ``processed.SFT_ROW``;
- ``preference`` (DPO, ORPO): ``pairs.process_pair_rows``, ``processed.PAIR_ROW``;
- ``unpaired`` (KTO): ``unpaired.process_unpaired_rows``, ``processed.UNPAIRED_ROW``;
- ``prompt`` (GRPO): ``prompts.process_prompt_rows``, ``processed.PROMPT_ROW``.

A new objective is one pipeline module, its row type, an entry of ``OBJECTIVES`` and its loss.
``process_rows(batch, tokenizer, cfg)`` runs the objective's pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qlora_train.config import DataConfig
from qlora_train.data.pairs import canonicalize_pair, process_pair_rows
from qlora_train.data.parse import canonicalize_row
from qlora_train.data.processed import PAIR_ROW, PROMPT_ROW, SFT_ROW, UNPAIRED_ROW, RowType
from qlora_train.data.prompts import canonicalize_prompt, process_prompt_rows
from qlora_train.data.sft import process_sft_rows
from qlora_train.data.unpaired import canonicalize_unpaired, process_unpaired_rows
from qlora_train.masking import SIDES, LossPolicy, mark_side, pair_policy

# a conversation as the pipeline renders it: (label, marked messages, tools, the policy it is rendered with)
Conversation = tuple[str, list, "list[dict] | None", LossPolicy]


@dataclass(frozen=True)
class Objective:
    name: str  # data.objective
    row_type: RowType
    process: Callable[..., dict[str, list]]  # (batch, tokenizer, cfg, *, locations, positions, texts) -> columns
    conversations: Callable[[dict, object, DataConfig], list[Conversation]]  # (raw row, tokenizer, cfg)


def _chat_conversations(row, tokenizer, cfg: DataConfig) -> list[Conversation]:
    policy = LossPolicy.of(cfg)
    canon = canonicalize_row(row, cfg, tokenizer=tokenizer, policy=policy)
    return [("", canon.messages, canon.tools, policy)]


def _pair_conversations(row, tokenizer, cfg: DataConfig) -> list[Conversation]:
    pair = canonicalize_pair(row, cfg, tokenizer=tokenizer)
    side_policy = pair_policy(LossPolicy.of(cfg))
    return [(f"{side} ", mark_side(pair.prompt, response, side_policy), pair.tools, side_policy)
            for side, response in zip(SIDES, (pair.chosen, pair.rejected))]


def _unpaired_conversations(row, tokenizer, cfg: DataConfig) -> list[Conversation]:
    unpaired = canonicalize_unpaired(row, cfg, tokenizer=tokenizer)
    side_policy = pair_policy(LossPolicy.of(cfg))
    return [("", mark_side(unpaired.prompt, unpaired.completion, side_policy), unpaired.tools, side_policy)]


def _prompt_conversations(row, tokenizer, cfg: DataConfig) -> list[Conversation]:
    prompt = canonicalize_prompt(row, cfg, tokenizer=tokenizer)
    policy = LossPolicy.of(cfg)
    return [("", policy.mark([{**m, "train": False} for m in prompt.prompt]), prompt.tools, policy)]


OBJECTIVES = {o.name: o for o in (
    Objective("sft", SFT_ROW, process_sft_rows, _chat_conversations),
    Objective("preference", PAIR_ROW, process_pair_rows, _pair_conversations),
    Objective("unpaired", UNPAIRED_ROW, process_unpaired_rows, _unpaired_conversations),
    Objective("prompt", PROMPT_ROW, process_prompt_rows, _prompt_conversations),
)}


def objective(cfg: DataConfig) -> Objective:
    """The ``Objective`` ``data.objective`` names."""
    return OBJECTIVES[cfg.objective]


def process_rows(batch, tokenizer, cfg: DataConfig, *, locations: list[str] | None = None,
                 positions: list[int] | None = None, texts: list[str] | None = None) -> dict[str, list]:
    """A batch of raw rows -> the objective's row type's pipeline columns (``objective(cfg).process``).

    ``batch`` is a dict of columns as ``datasets.map(batched=True)`` hands it, or a list of rows. No exception from
    a row escapes: a row refused, or failing unexpectedly, has its ``drop_reason`` (a ``DropReason``) and
    ``drop_detail`` (its location and why); each row's work is bounded by ``data.row_budget``
    (``masking.RowSpending``: renders, characters, template steps, seconds; over it: ``over_budget``).
    ``locations`` name the rows in drop details (default: ``row <index in batch>``). ``data.rule_check`` picks rows
    by ``positions``, their indices in their source (default: in the batch), and ``texts``, the rows as read
    (default: their canonical JSON, ``rule_check.row_text``).
    """
    return objective(cfg).process(batch, tokenizer, cfg, locations=locations, positions=positions, texts=texts)
