"""N ranks train one process's global batches, the epoch's ragged last one included: blank rows, never repeats."""

from __future__ import annotations

import datasets
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, SequentialSampler

from qlora_train.data.processed import PAIR_ROW, SFT_ROW
from qlora_train.masking import IGNORE_INDEX
from qlora_train.train.collator import ImageCollator, PackedCollator, PadCollator, PairCollator
from qlora_train.train.global_batches import BLANK, BlankRows, WholeGlobalBatches, blank_row
from qlora_train.train.loss import causal_lm_loss
from qlora_train.train.preference_loss import PreferenceObjective, SequenceLogps


def rank_batches(rows: int, batch_size: int, ranks: int, *, ours: bool) -> list[list[list[int]]]:
    """What each rank draws, step by step, from accelerate's sharding of the batches (even_batches, as the
    Trainer prepares them) over ``rows`` rows in order: of ``WholeGlobalBatches`` (``ours``) or of the plain
    ``BatchSampler`` the Trainer's DataLoader makes."""
    sampler = SequentialSampler(range(rows))
    inner = (WholeGlobalBatches(sampler, batch_size, ranks) if ours
             else BatchSampler(sampler, batch_size, drop_last=False))
    return [list(BatchSamplerShard(inner, num_processes=ranks, process_index=r, even_batches=True))
            for r in range(ranks)]


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 40), batch_size=st.integers(1, 4), ranks=st.integers(1, 4))
@example(rows=43, batch_size=2, ranks=2)  # the quickstart: a last step of 3 rows
@example(rows=45, batch_size=2, ranks=2)  # a last step of 1 row: one rank's batch all blank
@example(rows=1, batch_size=3, ranks=4)  # fewer rows than ranks
def test_the_ranks_step_k_is_one_process_step_k(rows, batch_size, ranks):
    per_rank = rank_batches(rows, batch_size, ranks, ours=True)
    one = list(BatchSampler(SequentialSampler(range(rows)), batch_size * ranks, drop_last=False))
    assert all(len(steps) == len(one) for steps in per_rank)  # every rank takes part in every step, no more
    for k, want in enumerate(one):
        step = [per_rank[r][k] for r in range(ranks)]
        assert all(len(batch) == batch_size for batch in step)  # whole micro-batches: accelerate fills nothing
        assert [i for batch in step for i in batch if i != BLANK] == want  # one process's rows, each once
    assert len(WholeGlobalBatches(SequentialSampler(range(rows)), batch_size, ranks)) == len(one) * ranks


def test_accelerate_alone_repeats_rows_in_the_ragged_step():
    """What this replaces (so that the test above is not vacuous): the quickstart's 43 rows on 2 ranks x 2 rows."""
    rank0, rank1 = rank_batches(43, 2, 2, ours=False)
    assert rank0[-1] == [40, 41] and rank1[-1] == [42, 0]  # row 0 trained a second time in the epoch's last step
    rank0, rank1 = rank_batches(43, 2, 2, ours=True)
    assert rank0[-1] == [40, 41] and rank1[-1] == [42, BLANK]


def test_blank_rows_answer_blank_and_pass_the_rest_through():
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6], [7]], "attention_mask": [[1, 1], [1]],
                                     "labels": [[-100, 6], [7]]})
    rows = BlankRows(ds, pad_token_id=0)
    assert len(rows) == 2
    blank = {"input_ids": [0], "attention_mask": [1], "labels": [IGNORE_INDEX]}
    assert rows.__getitems__([1, BLANK, 0, BLANK]) == [ds[1], blank, ds[0], blank]
    assert rows.__getitems__([BLANK]) == [blank] and rows[BLANK] == blank and rows[0] == ds[0]


@pytest.mark.parametrize(("columns", "collator"), [
    (SFT_ROW.model_columns, PadCollator(0)),
    (SFT_ROW.model_columns, ImageCollator(0, None)),  # a vision-language model's, on rows without images
    (("input_ids", "labels", "position_ids", "seq_lens"), PackedCollator(0)),
    (("input_ids", "labels", "position_ids", "seq_lens"), PackedCollator(0, attention="position_ids")),
    (PAIR_ROW.model_columns, PairCollator(0)),
], ids=["padded", "images", "packed", "packed-flash", "pairs"])
def test_a_blank_row_batches_with_every_collator_and_trains_nothing(columns, collator):
    real = {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "position_ids": [0, 1, 2],
            "seq_lens": [3], "chosen_input_ids": [5, 6], "chosen_labels": [-100, 6], "rejected_input_ids": [5, 8],
            "rejected_labels": [-100, 8], "prompt_length": 1, "images": []}
    batch = collator([{c: real[c] for c in columns}, blank_row(columns, pad_token_id=0)])
    labels = batch["labels"]
    if labels.shape[0] == 1:  # flattened for flash-attention: the blank is the last token
        assert labels[0, -1] == IGNORE_INDEX and batch["position_ids"][0, -1] == 0
    else:  # the blank's rows: no label; with pairs, row 1 (chosen) and row 3 (rejected)
        blanks = [1, 3] if collator.__class__ is PairCollator else [1]
        assert (labels[blanks] == IGNORE_INDEX).all() and (labels[[0]] != IGNORE_INDEX).any()


def test_a_column_without_a_blank_value_is_named():
    with pytest.raises(ValueError, match="'domain'"):
        blank_row(["input_ids", "domain"], pad_token_id=0)


def test_an_all_blank_batch_adds_nothing_to_the_loss_or_the_gradient():
    """A rank whose batch is all blank: the loss over the global batch's tokens is 0 and every gradient 0, finite."""
    hidden = torch.randn(2, 4, 8, requires_grad=True)
    weight = torch.randn(16, 8, requires_grad=True)
    loss = causal_lm_loss(hidden, weight, torch.full((2, 4), IGNORE_INDEX), num_items_in_batch=torch.tensor(7))
    loss.backward()
    assert loss.item() == 0.0 and (hidden.grad == 0).all() and (weight.grad == 0).all()


def pair_logps(chosen, rejected, counts=None):
    """SequenceLogps of pairs given as chosen and rejected sums (counts 3 unless given)."""
    sums = torch.tensor([*chosen, *rejected], requires_grad=True)
    counts = torch.tensor(counts if counts is not None else [3] * len(sums))
    return SequenceLogps(sums, counts)


@pytest.mark.parametrize("objective", [PreferenceObjective("dpo", beta=0.5), PreferenceObjective("orpo"),
                                       PreferenceObjective("dpo", beta=0.5, dpo_loss="ipo")],
                         ids=["dpo", "orpo", "ipo"])
def test_blank_pairs_are_left_out_of_the_loss_and_the_metrics(objective):
    """Pairs [a, b] and the same with a blank pair (no trained tokens) after them: the same loss and metrics;
    ``pairs`` divides the summed loss (the ranks' mean count of real pairs); a batch of blanks adds 0."""
    reference = pair_logps([-4.0, -6.0], [-5.0, -5.5])
    policy = pair_logps([-3.0, -6.5], [-5.5, -5.0])
    with_blank = pair_logps([-3.0, -6.5, 0.0], [-5.5, -5.0, 0.0], counts=[3, 3, 0, 3, 3, 0])
    reference_blank = pair_logps([-4.0, -6.0, 0.0], [-5.0, -5.5, 0.0], counts=[3, 3, 0, 3, 3, 0])
    ref = lambda r: r if objective.needs_reference else None
    loss, metrics = objective(policy, ref(reference))
    loss_b, metrics_b = objective(with_blank, ref(reference_blank))
    assert loss_b.item() == pytest.approx(loss.item()) and metrics_b == pytest.approx(metrics)
    halved, _ = objective(with_blank, ref(reference_blank), pairs=4.0, nll_tokens=6.0)
    # the pair term over 4 pairs, not 2; ORPO's NLL over the 6 chosen tokens it had
    assert halved.item() == pytest.approx(loss.item() / 2 if objective.method == "dpo" else
                                          metrics["nll_loss"] - objective.orpo_lambda * metrics["log_odds_ratio"] / 2)
    blank = pair_logps([0.0], [0.0], counts=[0, 0])
    nothing, _ = objective(blank, ref(pair_logps([0.0], [0.0], counts=[0, 0])), pairs=1.0, nll_tokens=6.0)
    nothing.backward()
    assert nothing.item() == 0.0 and (blank.sums.grad == 0).all()
