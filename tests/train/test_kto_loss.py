"""The KTO objective on hand-made log-probs (no model): the formula by hand, the KL estimate's clamp and detach, the
label weights, blank rows left out, and the collator's mismatched rows with a blank row of ``global_batches``."""

from __future__ import annotations

import math

import pytest
import torch

from qlora_train.data.processed import UNPAIRED_ROW
from qlora_train.train.collator import UnpairedCollator
from qlora_train.train.global_batches import blank_row
from qlora_train.train.preference_loss import PreferenceObjective, SequenceLogps


def logps(*sums, counts=None) -> SequenceLogps:
    return SequenceLogps(torch.tensor(sums, dtype=torch.float32),
                         torch.tensor(counts if counts is not None else [3] * len(sums)))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_the_loss_by_hand():
    """r = (-4 + 5, -9 + 7) = (1, -2); z = mean(-6 + 8, -3 + 4) = 1.5; beta 0.5, weights 2 and 1."""
    objective = PreferenceObjective("kto", beta=0.5, desirable_weight=2.0, undesirable_weight=1.0)
    loss, metrics = objective.kto(logps(-4.0, -9.0), logps(-5.0, -7.0), logps(-6.0, -3.0), logps(-8.0, -4.0),
                                  torch.tensor([True, False]))
    desirable = 2.0 * (1 - sigmoid(0.5 * (1 - 1.5)))
    undesirable = 1.0 * (1 - sigmoid(0.5 * (1.5 - (-2))))
    assert loss.item() == pytest.approx((desirable + undesirable) / 2, abs=1e-6)
    assert metrics["kl"] == pytest.approx(1.5)
    assert (metrics["rewards/chosen"], metrics["rewards/rejected"]) == pytest.approx((0.5, -1.0))
    assert metrics["rewards/margins"] == pytest.approx(1.5)
    assert (metrics["logps/chosen"], metrics["logps/rejected"]) == pytest.approx((-4.0, -9.0))


def test_the_kl_estimate_is_clamped_at_zero_and_carries_no_gradient():
    policy, policy_kl = logps(-4.0, -9.0), logps(-9.0, -9.0)
    policy.sums.requires_grad_(True)
    policy_kl.sums.requires_grad_(True)
    loss, metrics = PreferenceObjective("kto", beta=1.0).kto(policy, logps(-4.0, -9.0), policy_kl,
                                                            logps(-1.0, -1.0), torch.tensor([True, True]))
    assert metrics["kl"] == 0.0  # mean log-ratio -8, clamped
    assert loss.item() == pytest.approx(0.5)  # r = 0 and z = 0 for both rows
    loss.backward()
    assert policy.sums.grad is not None and policy_kl.sums.grad is None


def test_only_one_label_in_the_batch_gives_nan_for_the_other():
    _, metrics = PreferenceObjective("kto").kto(logps(-4.0), logps(-4.0), logps(-1.0), logps(-1.0),
                                                torch.tensor([False]))
    assert math.isnan(metrics["rewards/chosen"]) and metrics["rewards/rejected"] == 0.0
    assert math.isnan(metrics["rewards/margins"])


def test_a_blank_row_changes_nothing():
    """A blank row (``global_batches``: no trained token) and the mismatched row it lends its empty completion to
    leave the loss, the KL estimate and the metrics as they are without it."""
    objective = PreferenceObjective("kto", beta=0.3)
    desirable = torch.tensor([True, False])
    base = objective.kto(logps(-4.0, -9.0), logps(-5.0, -7.0), logps(-6.0, -3.0), logps(-8.0, -4.0), desirable)
    # a third row, blank: counts 0; its own mismatched row borrows row 1's completion (real counts) but is its
    # own row's, so it is left out; row 0's mismatched row would borrow the blank's empty completion (counts 0)
    with_blank = objective.kto(logps(-4.0, -9.0, 0.0, counts=[3, 3, 0]), logps(-5.0, -7.0, 0.0, counts=[3, 3, 0]),
                               logps(-6.0, -3.0, -50.0, counts=[3, 3, 3]), logps(-8.0, -4.0, 0.0, counts=[3, 3, 3]),
                               torch.tensor([True, False, False]))
    assert with_blank[0].item() == pytest.approx(base[0].item(), abs=1e-7)
    assert with_blank[1] == pytest.approx(base[1])


def test_the_collator_on_a_batch_with_a_blank_row():
    rows = [{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "prompt_length": 1,
             "desirable": 1},
            blank_row(UNPAIRED_ROW.model_columns, pad_token_id=0)]
    assert rows[1] == {"input_ids": [0], "attention_mask": [1], "labels": [-100], "prompt_length": 1,
                       "desirable": 0, "images": []}
    batch = UnpairedCollator(0, pad_to_multiple_of=1)(rows)
    # row 0's mismatched row: its prompt with the blank's empty completion, nothing trained
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100], [-100, -100, -100], [-100, 6, 7]]
    assert batch["input_ids"].tolist()[2:] == [[5, 0, 0], [0, 6, 7]]
    assert batch["desirable"].tolist() == [True, False]
