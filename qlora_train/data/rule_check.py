"""``data.rule_check``: the fast path checked against the rule on the user's own rows, at run time.

Which rows (``selected``): with ``sample`` (the default) the first ``FIRST_ROWS`` rows of each source (64 with a
declared layout: ``first_rows``) and 1 in ``ONE_IN`` of the rest, picked by a CRC-32 of the row as read (its JSON line),
so the same rows are checked on every run and machine whatever ``data.batch_size``, ``data.num_proc`` or the
rows' order; ``all`` checks every row, ``off`` none. A selected chat row's examples (with ``reasoning_history:
expand``, its extra ones too) or a pair's two sides are masked again by the rule (``masking.check_with_rule``),
token by token:

- all agree -> ``rule_checked_rows`` (a row the layout could not verify was verified by the rule: it agrees);
- the rule cannot decide (the template is not prefix-stable on it) -> ``rule_unchecked_rows``, the row kept;
- any disagrees -> the row is refused as ``mask_disagrees`` and counted in ``rule_disagreements``.

After the map, more than ``STOP_AFTER`` disagreements that are also more than ``STOP_SHARE`` of the rows checked
stop the run (``MaskDisagreementError``): the layout is wrong for this data, not one odd row.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable

from qlora_train.data.drops import DropReason
from qlora_train.data.parse import ParseReport
from qlora_train.errors import QloraError
from qlora_train.masking import (
    AGREE,
    DISAGREE,
    UNDECIDED,
    LossPolicy,
    Masked,
    RowRejected,
    RuleCheck,
    TemplateLayout,
    check_with_rule,
    mark_side,
    pair_policy,
    render_example,
    verify_encoder,
)

log = logging.getLogger(__name__)

FIRST_ROWS = 8  # ``sample``: the first rows of each source are always checked
FIRST_ROWS_DECLARED = 64  # ... where model.template_layout declares parts the probe did not find (first_rows)
ONE_IN = 64  # ``sample``: and 1 in 64 of the rest
STOP_AFTER = 3  # disagreements a run tolerates whatever their share
STOP_SHARE = 0.01  # ... and above it, of the rows checked, the run stops
COUNTS = ("rule_checked_rows", "rule_unchecked_rows", "rule_disagreements")  # ParseReport / DatasetReport fields


def selected(mode: str, position: int, text: str | Callable[[], str], first: int = FIRST_ROWS) -> bool:
    """Whether ``data.rule_check`` (``mode``) checks the row at ``position`` of its source (``sample``: the
    ``first`` rows, and 1 in ``ONE_IN`` of the others by ``row_hash`` of ``text``, the row as read: its JSON line,
    or a function giving it, called only when needed).

    >>> selected("sample", 3, "{}"), selected("off", 0, "{}"), selected("all", 10**6, "{}")
    (True, False, True)
    """
    if mode != "sample":
        return mode == "all"
    return position < first or row_hash(text if isinstance(text, str) else text()) % ONE_IN == 0


def row_hash(text: str) -> int:
    """A stable hash of a row as read (CRC-32 of its text): the same in every process and run, unlike Python's
    salted ``hash()``, and a few microseconds for a row of a few kilobytes."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass"))


def row_text(row) -> str:
    """A row given as a value (``process_rows`` called directly) as the text ``row_hash`` reads: its canonical
    JSON."""
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)


def first_rows(layout: TemplateLayout) -> int:
    """How many first rows of a source ``sample`` checks: ``FIRST_ROWS_DECLARED`` where ``model.template_layout``
    declares a part other than the probe found (the user's own reading of the template, that no probe
    confirmed: a wrong one is to stop the run early), else ``FIRST_ROWS``."""
    return FIRST_ROWS_DECLARED if layout.declared else FIRST_ROWS


def worst(checks: list[RuleCheck]) -> RuleCheck:
    """A row's outcome from its examples' (or sides'): the first disagreement, else undecided if any is, else
    agree."""
    for outcome in (DISAGREE, UNDECIDED):
        found = next((c for c in checks if c.outcome == outcome), None)
        if found is not None:
            return found
    return RuleCheck(AGREE)


def count(report: ParseReport, check: RuleCheck) -> None:
    """The row's outcome into its report (one of ``COUNTS`` set to 1)."""
    if check.outcome == AGREE:
        report.rule_checked_rows = 1
    elif check.outcome == UNDECIDED:
        report.rule_unchecked_rows = 1
    else:
        report.rule_disagreements = 1


def refusal(check: RuleCheck) -> RowRejected:
    return RowRejected(DropReason.MASK_DISAGREES, f"the layout's mask differs from the rule's: {check.detail}")


def check_encoder(report: ParseReport, renders, tokenizer) -> None:
    """A checked row's renders encoded by the fast byte-level encoder and by ``tokenizers`` (``verify_encoder``):
    where their ids or offsets differ, counted in the report (``fast_encoder_mismatches``) and the tokenizer
    switched back to ``tokenizers`` for the run. Refuses nothing: the row is re-encoded by ``tokenizers``."""
    if verify_encoder(renders, tokenizer) is not None:
        report.fast_encoder_mismatches = 1


def check_examples(examples, tokenizer, *, policy: LossPolicy, layout: TemplateLayout) -> RuleCheck:
    """A chat row's examples (``(messages, tools, rendered)``, the fast path's renders) -> the row's outcome."""
    return worst([check_with_rule(messages, rendered, tokenizer, tools=tools, policy=policy, layout=layout)
                  for messages, tools, rendered in examples])


def check_responses(prompt: list, responses: dict[str, list], tools: list[dict] | None, tokenizer, *,
                    policy: LossPolicy, layout: TemplateLayout, report: ParseReport | None = None
                    ) -> RuleCheck | None:
    """A prompt and its responses (a pair's two sides, ``{"chosen": ..., "rejected": ...}``, or an unpaired row's
    completion), each rendered as ``masking.mask_pair`` renders it -> the row's outcome; None where the fast path
    refuses a side (the pipeline then refuses the row with that reason)."""
    side_policy = pair_policy(policy)
    checks = []
    for side, response in responses.items():
        messages = mark_side(prompt, response, side_policy)
        try:
            example = render_example(messages, tokenizer, tools=tools, policy=side_policy, layout=layout)
        except RowRejected:
            return None
        if report is not None:
            check_encoder(report, [example.rendered], tokenizer)
        check = check_with_rule(messages, example.rendered, tokenizer, tools=tools, policy=side_policy, layout=layout)
        named = len(responses) > 1 and check.detail
        checks.append(check._replace(detail=f"{side}: {check.detail}") if named else check)
    return worst(checks)


def both_masks(conversations, tokenizer) -> list[tuple[str, Masked]]:
    """A row's conversations (``(label, marked messages, tools, policy)``: ``pipeline.Objective.conversations``)
    -> its masks, ``(whose, tokens)``: by the layout, then by the rule, for each conversation where they differ:
    what ``--debug-samples`` shows of a row refused as ``mask_disagrees``. Empty where they no longer differ (a
    changed config) or only an extra example of ``reasoning_history: expand`` differs (its detail names it)."""
    out = []
    for side, messages, tools, pol in conversations:
        example = render_example(messages, tokenizer, tools=tools, policy=pol)
        check = check_with_rule(messages, example.rendered, tokenizer, tools=tools, policy=pol)
        if check.outcome == DISAGREE and check.fast is not None:
            out += [(f"{side}by the layout", check.fast), (f"{side}by the rule", check.rule)]
    return out


class MaskDisagreementError(QloraError):
    """The layout's masks differ from the rule's on more rows than ``data.rule_check`` tolerates."""

    exit_code = 2  # fixed in the config: model.template_layout


def template_name(tokenizer) -> str:
    """What names the chat template in a message: ``model.chat_template`` where the config sets one, else the
    template of the tokenizer it came with."""
    return f"the chat template (model.chat_template, else the one of {tokenizer.name_or_path or 'the tokenizer'})"


def stop_on_disagreements(checked: int, disagreements: int, first: str, tokenizer) -> None:
    """The counts over every processed row -> the first disagreement logged; more than ``STOP_AFTER`` and more
    than ``STOP_SHARE`` of the rows checked -> ``MaskDisagreementError``."""
    if not disagreements:
        return
    compared = checked + disagreements
    what = (f"{disagreements} of {compared} rows checked against the rule (data.rule_check) are masked differently "
            f"by the layout of {template_name(tokenizer)} and refused as mask_disagrees; the first: {first}")
    if disagreements > STOP_AFTER and disagreements > STOP_SHARE * compared:
        raise MaskDisagreementError(
            f"{what}\nstopped: the layout does not fit this data (more than {STOP_AFTER} rows and {STOP_SHARE:.0%} "
            "of those checked). Run --stats-only: it prints the layout as the YAML block model.template_layout "
            "takes; correct the part the disagreement shows (an end marker, a header, a trailer) and declare it "
            "under model: template_layout: in the config. --debug-samples N --debug-refused shows both masks of "
            "each refused row. data.rule_check: off skips the check (the rows are then trained as the layout "
            "masks them).")
    log.warning("%s (rows refused; the run stops above %d rows and %.0f%% of those checked)", what, STOP_AFTER,
                100 * STOP_SHARE)
