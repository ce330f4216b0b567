"""Drop reasons: each fact in its layer. The engine's ``DropReason`` holds what the engine itself refuses; the
data layer's extends it with the rest, and every reason is one string under one name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qlora_train.masking as masking
from qlora_train.data.drops import CONFIGURED_DROPS, KNOWN_DROP_REASONS, BadRowError, DropReason, stop_at_first_bad_row

PACKAGE = Path(__file__).resolve().parents[2] / "qlora_train"


def own(cls: type) -> dict[str, str]:
    return {k: v for k, v in vars(cls).items() if k.isupper()}


def reasons_named(folder: Path) -> set[str]:
    """The ``DropReason.NAME`` attributes the modules under ``folder`` read."""
    return {node.attr for path in folder.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "DropReason"
            and node.attr.isupper()}


def test_every_reason_is_one_string_under_one_name():
    engine, data = own(masking.DropReason), own(DropReason)
    assert engine.keys().isdisjoint(data) and set(engine.values()).isdisjoint(data.values())
    every = engine | data
    assert len(set(every.values())) == len(every) and KNOWN_DROP_REASONS == set(every.values())
    assert {k: getattr(DropReason, k) for k in every} == every  # the data class names the engine's too
    assert DropReason.TEMPLATE_ERROR == "template_error" and DropReason.TOO_LONG == "too_long"
    assert CONFIGURED_DROPS <= set(data.values())


def test_the_engine_holds_the_reasons_it_raises_and_no_other():
    """A reason only ``qlora_train.data`` raises lives there; one the engine raises, in the engine."""
    assert reasons_named(PACKAGE / "masking") == set(own(masking.DropReason))
    assert set(own(DropReason)) <= reasons_named(PACKAGE / "data")
    assert reasons_named(PACKAGE) <= set(own(masking.DropReason)) | set(own(DropReason))  # diagnostics, train too


def test_on_bad_row_error_stops_at_the_first_refused_row_not_at_a_configured_drop():
    stop_at_first_bad_row(["", "too_long", "duplicate", "filtered_by_length", "below_score_margin"], ["a"] * 5)
    with pytest.raises(BadRowError, match=r"^bad row \(mask_unverified\) at a.jsonl:2 "):
        stop_at_first_bad_row(["too_long", "mask_unverified", "no_messages"], ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"])
