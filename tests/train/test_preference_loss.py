"""Preference objectives: chunked sequence log-probs equal log_softmax of full logits (values and gradients);
DPO, IPO and ORPO on numbers checkable by hand; config keys refused with the fix named."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qlora_train.config import ConfigError, load_config
from qlora_train.data.tokenize import IGNORE_INDEX
from qlora_train.train.preference_loss import PreferenceObjective, SequenceLogps, sequence_logps

REL = 1e-5


# ------------------------------------------------------------------------------------- sequence_logps, by hand


def naive_sequence_logps(logits: torch.Tensor, labels: torch.Tensor):
    """Full float32 logits ``[rows, seq, vocab]`` -> per-row sum of the log-prob of each next label, and count."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    trained = targets != IGNORE_INDEX
    token = logits.float().log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    return (token * trained).sum(1), trained.sum(1)


def test_uniform_head_gives_log_one_over_vocab_per_trained_token():
    """A zero head: every token has probability 1/4, so a row's sum is (trained tokens) x log(1/4)."""
    hidden = torch.randn(2, 5, 3)
    labels = torch.tensor([[-100, -100, 1, 2, 3], [-100, 0, -100, -100, -100]])  # 3 and 1 trained after the shift
    out = sequence_logps(hidden, torch.zeros(4, 3), labels, chunk_tokens=2)
    assert out.counts.tolist() == [3, 1]
    assert torch.allclose(out.sums, torch.tensor([3 * math.log(0.25), math.log(0.25)]))


@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen-head", "trained-head"])
def test_sequence_logps_and_gradients_equal_full_log_softmax(weight_grad):
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=weight_grad)
    labels = torch.randint(0, 50, (3, 11))
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[1, 7:] = IGNORE_INDEX  # padding
    labels[2, :] = IGNORE_INDEX  # nothing trained: sum 0, count 0
    upstream = torch.tensor([0.3, -1.7, 2.0])  # each row's log-prob weighted differently, as DPO does

    out = sequence_logps(hidden, weight, labels, chunk_tokens=4)
    (out.sums * upstream).sum().backward()
    fused_grads = [hidden.grad.clone()] + ([weight.grad.clone()] if weight_grad else [])
    hidden.grad, weight.grad = None, None

    sums, counts = naive_sequence_logps(hidden @ weight.t(), labels)
    (sums * upstream).sum().backward()
    naive_grads = [hidden.grad] + ([weight.grad] if weight_grad else [])

    assert out.counts.tolist() == counts.tolist() == [7, 6, 0]  # labels 4..10; labels 1..6 (0 predicts nothing)
    assert torch.allclose(out.sums, sums, rtol=REL, atol=1e-6) and out.sums[2] == 0
    for fused, naive in zip(fused_grads, naive_grads):
        assert naive.norm() > 0
        assert (fused - naive).norm() <= REL * naive.norm()


def test_objectives_on_numbers_checkable_by_hand():
    """One pair: policy log-probs -5 (chosen, 5 tokens) and -7 (rejected, 7 tokens), reference -6 and -6, so
    h = (-5 + 6) - (-7 + 6) = 2."""
    policy = SequenceLogps(torch.tensor([-5.0, -7.0]), torch.tensor([5, 7]))
    reference = SequenceLogps(torch.tensor([-6.0, -6.0]), torch.tensor([5, 7]))
    loss, metrics = PreferenceObjective("dpo", beta=0.5)(policy, reference)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1)))  # -log sigmoid(0.5 * 2)
    assert metrics["rewards/chosen"] == 0.5 and metrics["rewards/rejected"] == -0.5
    assert metrics["rewards/margins"] == 1 and metrics["rewards/accuracies"] == 1
    assert metrics["logps/chosen"] == -5 and metrics["logps/rejected"] == -7
    loss, _ = PreferenceObjective("dpo", beta=0.5, label_smoothing=0.25)(policy, reference)
    assert loss.item() == pytest.approx(0.75 * math.log1p(math.exp(-1)) + 0.25 * math.log1p(math.exp(1)))
    loss, _ = PreferenceObjective("dpo", beta=0.5, dpo_loss="ipo")(policy, reference)
    assert loss.item() == pytest.approx(1.0)  # (2 - 1 / (2 * 0.5))^2
    # ORPO: mean log-probs -1 and -1, equal odds: log sigmoid(0) = -log 2; NLL = 5 / 5 tokens = 1
    loss, metrics = PreferenceObjective("orpo", orpo_lambda=0.2)(policy, None)
    assert loss.item() == pytest.approx(1 + 0.2 * math.log(2))
    assert metrics["nll_loss"] == pytest.approx(1) and metrics["log_odds_ratio"] == pytest.approx(-math.log(2))
    assert metrics["rewards/chosen"] == pytest.approx(-0.2)  # orpo_lambda x mean log-prob


# ----------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("train, model, message", [
    ("{method: dpo, packing: true}", "", "train.packing: method: dpo trains each pair as two padded rows"),
    ("{method: orpo, group_by_length: true}", "", "train.group_by_length: not available with method: orpo"),
    ("{method: dpo, dpo_loss: ipo, label_smoothing: 0.1}", "",
     "train.label_smoothing: applies to method: dpo with dpo_loss: sigmoid only"),
    ("{method: kto}", "", "train.method: Input should be 'sft', 'dpo' or 'orpo'"),
    ("{method: sft}", ", adapter_path: ADAPTER", "model.adapter_path: starts preference training"),
], ids=["packing", "group-by-length", "label-smoothing-ipo", "unknown-method", "adapter-path-sft"])
def test_preference_config_errors_name_the_fix(tmp_path, train, model, message):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    (tmp_path / "adapter").mkdir()
    text = (f"model: {{name_or_path: Qwen/Qwen3-0.6B{model.replace('ADAPTER', str(tmp_path / 'adapter'))}}}\n"
            f"data: {{datasets: [{{path: {tmp_path / 'd.jsonl'}}}]}}\ntrain: {train}\n")
    (tmp_path / "cfg.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.yaml")
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems
