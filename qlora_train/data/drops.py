"""Why rows are refused, and what a refused row does to the run: every reason a row is counted under
(``DropReason``), the drops the config asks for (``CONFIGURED_DROPS``), and ``data.on_bad_row: error``
(``stop_at_first_bad_row``, ``BadRowError``).

``DropReason`` holds the mask engine's reasons (``masking.DropReason``: the template and the mask, what the
engine itself refuses) and the data's own (reading, parsing, limits, deduplication, pairs), so a user of
``qlora_train.data`` names every reason through this one class; the strings are what the reports count:

    >>> DropReason.TOO_LONG, DropReason.MASK_UNVERIFIED
    ('too_long', 'mask_unverified')
    >>> stop_at_first_bad_row(["", "too_long", "no_messages"], ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"])
    Traceback (most recent call last):
    ...
    qlora_train.data.drops.BadRowError: bad row (no_messages) at a.jsonl:3 [data.on_bad_row: error; ...]
"""

from __future__ import annotations

from qlora_train.errors import DataError
from qlora_train.masking import DropReason as EngineDropReason


class DropReason(EngineDropReason):
    """Why a row was refused. Every refused row is counted under exactly one of these: the engine's (inherited)
    or one of the data's below."""

    UNPARSEABLE_JSON = "unparseable_json"
    UNKNOWN_SCHEMA = "unknown_schema"
    NO_MESSAGES = "no_messages"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    EMPTY_ASSISTANT = "empty_assistant_turn"
    EMPTY_USER_TURN = "empty_user_turn"  # a user message without content (chat rows and pairs alike)
    TOOLS_UNPARSEABLE = "tools_unparseable"
    MASK_DISAGREES = "mask_disagrees"  # data.rule_check: the layout's mask differs from the rule's on this row
    NO_TRAINED_TOKEN = "no_trained_token_after_truncation"
    BAD_PRETOKENIZED = "bad_pretokenized"
    FILTERED_BY_LENGTH = "filtered_by_length"
    DUPLICATE = "duplicate"
    TOO_LONG = "too_long"
    # preference pairs (data/pairs.py; the engine's: pair_identical, pair_prompt_differs)
    PAIR_MISSING_SIDE = "pair_missing_side"
    UNPAIRED_PREFERENCE = "unpaired_preference"
    PAIR_BAD_PROMPT = "pair_bad_prompt"
    PAIR_EMPTY_RESPONSE = "pair_empty_response"
    PAIR_BAD_RESPONSE = "pair_bad_response"
    BELOW_SCORE_MARGIN = "below_score_margin"  # data.min_score_margin
    # VLFeedback's rated completions (pairs.vlfeedback_row): fewer than two rated, or all rated the same
    PAIR_NO_PREFERENCE = "pair_no_preference"
    # prompt rows (data/prompts.py, GRPO): a prompt whose last turn is the model's leaves it nothing to sample
    PROMPT_ENDS_WITH_ASSISTANT = "prompt_ends_with_assistant"
    # with rl.tools every prompt is rendered with their schemas: a row's own tools are not the tools its rollouts run
    TOOLS_BESIDE_RL_TOOLS = "tools_beside_rl_tools"


KNOWN_DROP_REASONS = frozenset(v for c in DropReason.__mro__ for k, v in vars(c).items() if k.isupper())

# Drops the user asked for (``on_too_long: drop``, ``dedup``, ``min_chars``/``max_chars``, ``min_score_margin``):
# ``data.on_bad_row: error`` does not stop on them.
CONFIGURED_DROPS = frozenset({DropReason.TOO_LONG, DropReason.DUPLICATE, DropReason.FILTERED_BY_LENGTH,
                              DropReason.BELOW_SCORE_MARGIN})


class BadRowError(DataError):
    """``data.on_bad_row: error`` and a row was refused: the message names the row and the reason."""


def stop_at_first_bad_row(reasons: list[str], details: list[str]) -> None:
    """``data.on_bad_row: error``: raise ``BadRowError`` for the first refused row (configured drops excepted)."""
    for reason, detail in zip(reasons, details):
        if reason and reason not in CONFIGURED_DROPS:
            raise BadRowError(f"bad row ({reason}) at {detail} [data.on_bad_row: error; use skip to drop and count "
                              "such rows]")
