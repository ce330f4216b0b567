from __future__ import annotations

import datasets
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qlora_train.data.packing import (
    PackingStats,
    Piece,
    best_fit_decreasing,
    pack_dataset,
    pack_examples,
    padded_efficiency,
    split_pieces,
)
from qlora_train.masking.tokenize import IGNORE_INDEX


def indices(bins):
    return [[p.index for p in b] for b in bins]


def test_best_fit_decreasing_by_hand():
    # sorted: 5 (ex 0), 4 (ex 2), 3 (ex 1), 2 (ex 3). 5 opens bin A (free 3); 4 does not fit: bin B (free 4);
    # 3 fits A exactly; 2 goes to B.
    assert best_fit_decreasing([5, 3, 4, 2], capacity=8) == [
        [Piece(0, 0, 5), Piece(1, 0, 3)], [Piece(2, 0, 4), Piece(3, 0, 2)]]


def test_best_fit_not_first_fit():
    # 7 -> A (free 3); 4 -> B (free 6); 4 -> B (free 2); 1 fits both: best fit takes B (free 2), first fit A
    assert indices(best_fit_decreasing([7, 4, 4, 1], capacity=10)) == [[0], [1, 2, 3]]


def test_equal_lengths_keep_input_order_and_ties_go_to_the_oldest_bin():
    assert indices(best_fit_decreasing([3, 3, 3, 3, 3], capacity=6)) == [[0, 1], [2, 3], [4]]
    # 6 -> A (free 4); 6 -> B (free 4); 4 fits both exactly: the oldest (A)
    assert indices(best_fit_decreasing([6, 6, 4], capacity=10)) == [[0, 2], [1]]


def test_too_long_example_is_an_error_unless_split_long():
    with pytest.raises(ValueError, match="example 1 has 9 tokens"):
        best_fit_decreasing([2, 9], capacity=4)
    assert split_pieces([2, 9], 4, split_long=True) == [
        Piece(0, 0, 2), Piece(1, 0, 4), Piece(1, 4, 8), Piece(1, 8, 9)]
    assert best_fit_decreasing([2, 9], capacity=4, split_long=True) == [
        [Piece(1, 0, 4)], [Piece(1, 4, 8)], [Piece(0, 0, 2), Piece(1, 8, 9)]]


def test_pack_examples_by_hand():
    a = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}
    b = {"input_ids": [4, 5], "labels": [4, 5]}  # its first label is trained: packing must mask it
    assert pack_examples([a, b]) == {
        "input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5],
        "position_ids": [0, 1, 2, 0, 1], "seq_lens": [3, 2]}
    assert b["labels"] == [4, 5]  # inputs untouched
    # pieces choose order and slices: a split piece restarts its positions and masks its first label
    assert pack_examples([a, b], [Piece(1, 0, 2), Piece(0, 1, 3)]) == {
        "input_ids": [4, 5, 2, 3], "labels": [-100, 5, -100, 3], "position_ids": [0, 1, 0, 1], "seq_lens": [2, 2]}


def test_efficiencies_by_hand():
    bins = best_fit_decreasing([5, 3, 4, 2], capacity=8)
    assert PackingStats.of([5, 3, 4, 2], bins, 8).efficiency == 14 / 16
    # batches of 2 in order: (5, 3) padded to 5, (4, 2) padded to 4 -> 14 / 18
    assert padded_efficiency([5, 3, 4, 2], batch_size=2) == 14 / 18


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=60), st.integers(1, 48), st.booleans())
def test_every_token_placed_once_and_no_bin_overflows(lengths, capacity, split_long):
    if not split_long and any(n > capacity for n in lengths):
        with pytest.raises(ValueError):
            best_fit_decreasing(lengths, capacity, split_long=split_long)
        return
    bins = best_fit_decreasing(lengths, capacity, split_long=split_long)
    assert all(0 < sum(p.length for p in b) <= capacity for b in bins)
    covered = {}
    for p in (p for b in bins for p in b):
        covered.setdefault(p.index, []).append((p.start, p.stop))
    for i, n in enumerate(lengths):
        spans = sorted(covered.pop(i))
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(s1 == s0 for (_, s0), (s1, _) in zip(spans, spans[1:]))  # contiguous, no overlap
        assert len(spans) == (1 if n <= capacity else -(-n // capacity))  # split only when too long
    assert not covered
    # no two bins could be merged: best fit never leaves two bins that fit together
    if not split_long:
        fills = sorted(sum(p.length for p in b) for b in bins)
        assert len(fills) < 2 or fills[0] + fills[1] > capacity


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 999), min_size=1, max_size=12), min_size=1, max_size=8), st.data())
def test_packed_example_invariants(id_lists, data):
    examples = [{"input_ids": ids, "labels": [data.draw(st.sampled_from([x, IGNORE_INDEX])) for x in ids]}
                for ids in id_lists]
    packed = pack_examples(examples)
    assert len(packed["input_ids"]) == len(packed["labels"]) == len(packed["position_ids"]) == sum(packed["seq_lens"])
    at = 0
    for ex, n in zip(examples, packed["seq_lens"]):
        assert packed["input_ids"][at:at + n] == ex["input_ids"]
        assert packed["position_ids"][at:at + n] == list(range(n))
        assert packed["labels"][at] == IGNORE_INDEX
        assert packed["labels"][at + 1:at + n] == ex["labels"][1:]  # otherwise labels are preserved
        at += n


def test_pack_dataset_writes_the_planned_bins():
    ds = datasets.Dataset.from_dict({
        "input_ids": [[1] * 5, [2] * 3, [3] * 4, [4] * 2],
        "labels": [[1] * 5, [-100] * 3, [3] * 4, [4] * 2],
    })
    packed, stats = pack_dataset(ds, capacity=8)
    assert packed.column_names == ["input_ids", "labels", "position_ids", "seq_lens"]
    assert packed["input_ids"] == [[1] * 5 + [2] * 3, [3] * 4 + [4] * 2]
    assert packed["labels"] == [[-100, 1, 1, 1, 1, -100, -100, -100], [-100, 3, 3, 3, -100, 4]]
    assert packed["position_ids"] == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1]]
    assert packed["seq_lens"] == [[5, 3], [4, 2]]
    assert (stats.examples, stats.sequences, stats.tokens, stats.capacity) == (4, 2, 14, 8)
    assert stats.efficiency == 14 / 16
    assert stats.line() == "packing 4 examples into 2 sequences of <= 8 tokens: 87.5% real tokens"
