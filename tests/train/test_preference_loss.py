"""Preference objectives: chunked sequence log-probs equal log_softmax of full logits (values and gradients); DPO,
IPO and ORPO equal naive formulas on full logits; the reference is the base (fresh adapter) or a frozen copy of
the starting adapter; real 4-bit QLoRA DPO steps run and log what users watch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from qlora_train.config import Config, ConfigError, load_config
from qlora_train.data import build_preference_example, canonicalize_pair
from qlora_train.masking.tokenize import IGNORE_INDEX
from qlora_train.train.collator import PairCollator
from qlora_train.train.preference import REFERENCE_ADAPTER, preference_step
from qlora_train.train.preference_loss import PreferenceObjective, SequenceLogps, sequence_logps

CHUNK = 16  # small: every batch here is cut into several chunks, the last one short
REL = 1e-5
PAIRS = [
    {"prompt": "What is 2 + 2?", "chosen": "4.", "rejected": "It is 5, I think."},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}],
     "chosen": "<think>\nEasy.\n</think>\n\nParis.", "rejected": "Lyon, the capital of Gaul."},
    {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "A number: 7."},
]


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
    loss, _ = PreferenceObjective("dpo", beta=0.5, dpo_loss="robust", label_smoothing=0.25)(policy, reference)
    assert loss.item() == pytest.approx((0.75 * math.log1p(math.exp(-1)) - 0.25 * math.log1p(math.exp(1))) / 0.5)
    loss, _ = PreferenceObjective("dpo", beta=0.5, dpo_loss="ipo")(policy, reference)
    assert loss.item() == pytest.approx(1.0)  # (2 - 1 / (2 * 0.5))^2
    # ORPO: mean log-probs -1 and -1, equal odds: log sigmoid(0) = -log 2; NLL = 5 / 5 tokens = 1
    loss, metrics = PreferenceObjective("orpo", orpo_lambda=0.2)(policy, None)
    assert loss.item() == pytest.approx(1 + 0.2 * math.log(2))
    assert metrics["nll_loss"] == pytest.approx(1) and metrics["log_odds_ratio"] == pytest.approx(-math.log(2))
    assert metrics["rewards/chosen"] == pytest.approx(-0.2)  # orpo_lambda x mean log-prob


# --------------------------------------------------------------------------------- on the tiny model with LoRA


@pytest.fixture(scope="module")
def pair_examples(qwen3_tok):
    out = []
    for row in PAIRS:
        pair = canonicalize_pair(row)
        out.append(build_preference_example(pair.prompt, pair.chosen, pair.rejected, qwen3_tok))
    return out


@pytest.fixture(scope="module")
def batch(pair_examples, qwen3_tok):
    """Two pairs (the one with reasoning among them): a [4, L] batch."""
    return PairCollator(qwen3_tok.pad_token_id)(pair_examples[:2])


def lora_model(model_dir, *, fresh: bool, seed: int = 0):
    """The tiny model in float32 with LoRA on every linear layer: B = 0 (``fresh``, peft's default), or A and B
    random (policy != reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=fresh,
                      task_type="CAUSAL_LM")
    return get_peft_model(base, lora)


@pytest.fixture(scope="module")
def trained_lora(tiny_model_dir):
    return lora_model(tiny_model_dir, fresh=False)


def model_logps(model, batch):
    """The model's own forward (full logits) -> naive per-row sums and counts."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return naive_sequence_logps(logits, batch["labels"])


def halves(t):
    n = t.shape[0] // 2
    return t[:n], t[n:]


def naive_dpo(policy, reference, beta, smoothing=0.0):
    (pc, pr), (rc, rr) = halves(policy), halves(reference)
    h = (pc - rc) - (pr - rr)
    return (-(1 - smoothing) * F.logsigmoid(beta * h) - smoothing * F.logsigmoid(-beta * h)).mean()


def naive_robust(policy, reference, beta, e):
    (pc, pr), (rc, rr) = halves(policy), halves(reference)
    h = (pc - rc) - (pr - rr)
    return ((-(1 - e) * F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h)) / (1 - 2 * e)).mean()


def naive_ipo(policy, reference, beta):
    (pc, pr), (rc, rr) = halves(policy), halves(reference)
    return (((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2).mean()


def naive_orpo(logits, labels, lam):
    sums, counts = naive_sequence_logps(logits, labels)
    (sc, sr), (nc, nr) = halves(sums), halves(counts)
    mc, mr = sc / nc, sr / nr
    log_odds = (mc - torch.log1p(-torch.exp(mc))) - (mr - torch.log1p(-torch.exp(mr)))
    n = sums.shape[0] // 2
    nll = F.cross_entropy(logits[:n, :-1].reshape(-1, logits.shape[-1]), labels[:n, 1:].reshape(-1),
                          ignore_index=IGNORE_INDEX)
    return nll - lam * F.logsigmoid(log_odds).mean()


def test_pair_logps_equal_the_models_own_logits(trained_lora, batch):
    from qlora_train.train.preference import pair_logps

    with torch.no_grad():
        fused = pair_logps(trained_lora, batch, chunk_tokens=CHUNK)
        sums, counts = model_logps(trained_lora, batch)
    assert fused.counts.tolist() == counts.tolist() and min(counts.tolist()) >= 2
    assert torch.allclose(fused.sums, sums, rtol=REL, atol=0)


def test_fresh_adapter_dpo_loss_is_log_2_with_zero_rewards(tiny_model_dir, batch):
    model = lora_model(tiny_model_dir, fresh=True)
    loss, metrics = preference_step(model, batch, PreferenceObjective("dpo", beta=0.1), chunk_tokens=CHUNK)
    assert abs(loss.item() - math.log(2)) < 1e-6
    assert metrics["rewards/chosen"] == metrics["rewards/rejected"] == metrics["rewards/margins"] == 0
    assert metrics["rewards/accuracies"] == 0  # a tie is not a win
    assert metrics["logps/chosen"] < 0 and metrics["logps/rejected"] < 0


OBJECTIVES = {"dpo": PreferenceObjective("dpo", beta=0.1),
              "dpo-label-smoothing": PreferenceObjective("dpo", beta=0.5, label_smoothing=0.2),
              "robust": PreferenceObjective("dpo", beta=0.5, dpo_loss="robust", label_smoothing=0.2),
              "ipo": PreferenceObjective("dpo", beta=0.1, dpo_loss="ipo"),
              "orpo": PreferenceObjective("orpo", orpo_lambda=0.3)}
# the DPO variants differ only in the weights of the same per-token gradients: checking DPO's and ORPO's suffices
GRADIENTS_CHECKED = ("dpo", "orpo")


def test_losses_and_lora_gradients_equal_naive_formulas(trained_lora, batch):
    """Each objective through preference_step (chunked, trained positions only) vs its formula on the model's own
    full logits (one forward, shared), with the adapter disabled as the reference: loss and margins; the LoRA
    gradients of DPO and ORPO."""
    model = trained_lora
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(params) == 2 * 7 * 2  # A and B of 7 linears in 2 layers
    with torch.no_grad(), model.disable_adapter():
        reference, _ = model_logps(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    policy, _ = naive_sequence_logps(logits, batch["labels"])
    for name, objective in OBJECTIVES.items():
        with_grads = name in GRADIENTS_CHECKED
        with torch.set_grad_enabled(with_grads):
            loss, metrics = preference_step(model, batch, objective, chunk_tokens=CHUNK)
        if objective.method == "orpo":
            naive = naive_orpo(logits, batch["labels"], objective.orpo_lambda)
        else:
            if objective.dpo_loss == "ipo":
                naive = naive_ipo(policy, reference, objective.beta)
            elif objective.dpo_loss == "robust":
                naive = naive_robust(policy, reference, objective.beta, objective.label_smoothing)
            else:
                naive = naive_dpo(policy, reference, objective.beta, objective.label_smoothing)
            (pc, pr), (rc, rr) = halves(policy.detach()), halves(reference)
            margins = objective.beta * ((pc - rc) - (pr - rr))
            assert metrics["rewards/margins"] == pytest.approx(margins.mean().item(), rel=1e-4), name
            assert metrics["rewards/margins"] != 0, name  # the adapter moved the policy away from the reference
        assert abs(loss.item() - naive.item()) <= REL * max(1.0, abs(naive.item())), name
        if not with_grads:
            continue
        fused_grads = torch.autograd.grad(loss, list(params.values()))
        naive_grads = torch.autograd.grad(naive, list(params.values()), retain_graph=True)
        for param, fused, g in zip(params, fused_grads, naive_grads):
            assert g.norm() > 0, (name, param)
            assert (fused - g).norm() <= REL * g.norm(), (name, param)


def test_at_most_one_chunk_of_logits_exists(trained_lora, batch):
    """Forward (reference and policy) and backward of a DPO step make no vocabulary-sized tensor of more than one
    chunk's rows."""
    from tests.train.test_fused_loss import LargestLogits

    assert int((batch["labels"][..., 1:] != IGNORE_INDEX).sum()) > 2 * CHUNK
    watch = LargestLogits()
    with watch:
        loss, _ = preference_step(trained_lora, batch, OBJECTIVES["dpo"], chunk_tokens=CHUNK)
        loss.backward()
    trained_lora.zero_grad(set_to_none=True)
    assert watch.rows == CHUNK


def test_starting_adapter_is_the_frozen_reference(tiny_model_dir, tmp_path, batch):
    """model.adapter_path: the trained copy and a frozen `reference` copy on one base; the reference log-probs are
    the starting adapter's, and only the trained copy gets gradients (before and after the reference pass)."""
    from transformers import AutoModelForCausalLM

    from qlora_train.train.model import start_from_adapter

    start = lora_model(tiny_model_dir, fresh=False, seed=1)
    start.save_pretrained(tmp_path / "sft")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = start_from_adapter(base, str(tmp_path / "sft"), with_reference=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    assert any(f".{REFERENCE_ADAPTER}." in n for n, _ in model.named_parameters())
    with torch.no_grad():  # the trained copy moves away from where it started
        for name, p in model.named_parameters():
            if name in trainable and "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))

    loss, metrics = preference_step(model, batch, PreferenceObjective("dpo", beta=0.1), chunk_tokens=CHUNK)
    loss.backward()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable
    with torch.no_grad():
        reference, _ = model_logps(start, batch)  # the starting adapter on its own base
        policy, _ = model_logps(model, batch)
        with model.disable_adapter():
            base_logps, _ = model_logps(model, batch)
    assert abs(loss.item() - naive_dpo(policy, reference, 0.1).item()) <= REL
    assert abs(loss.item() - naive_dpo(policy, base_logps, 0.1).item()) > 1e-3  # the base would be another reference
    assert metrics["rewards/margins"] != 0
    model.save_pretrained(tmp_path / "run")  # what the Trainer saves: the trained copy only
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "run" / REFERENCE_ADAPTER).exists()


# ------------------------------------------------------------------------------- one real QLoRA step, config


def preference_config(model_dir, output_dir, **train) -> Config:
    return Config.model_validate({
        "model": {"name_or_path": str(model_dir), "chat_template": "qwen3"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "train": {"output_dir": str(output_dir), "max_steps": 2, "per_device_train_batch_size": 2,
                  "learning_rate": 5e-3, "logging_steps": 1, "save_steps": 100, "report_to": "none",
                  "lr_scheduler": "constant", "warmup_ratio": 0.0, **train},
    })


class Snapshot(TrainerCallback):
    """The trainable parameters at train begin; the model at the end."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_train_end(self, args, state, control, model=None, **kw):
        self.model = model


# trains (two real QLoRA DPO steps through run.train): make test (CI) runs it, make test-fast does not; the loss,
# its gradients and the reference are checked fast above on the same model
@pytest.mark.slow
def test_train_runs_two_qlora_dpo_steps_logs_rewards_and_changes_the_adapter(tiny_model_dir, tmp_path,
                                                                              pair_examples, monkeypatch):
    """run.train with train.method: dpo on pair rows (the data pipeline does not make them yet: its result is
    stood in for): the real 4-bit base, the pair collator, the preference trainer, eval on held-out pairs, outputs."""
    from datasets import Dataset

    from qlora_train.data.dataset import DatasetReport
    from qlora_train.data.prepared import TrainingData
    from qlora_train.train import run

    pairs = Dataset.from_list(pair_examples)
    monkeypatch.setattr(run, "training_data", lambda cfg, tokenizer: TrainingData(pairs, pairs, DatasetReport()))
    cfg = preference_config(tiny_model_dir, tmp_path / "out", method="dpo", save_steps=2)
    cfg.data.eval_fraction = 0.5  # an eval split exists: evaluate at step 2
    snapshot = Snapshot()
    trainer = run.train(cfg, callbacks=[snapshot])
    assert any("Linear4bit" in type(m).__name__ for m in trainer.model.modules())  # really 4-bit
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert all(0 <= h["rewards/accuracies"] <= 1 and "rewards/margins" in h and "logps/chosen" in h for h in logs)
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-4 and logs[0]["rewards/margins"] == 0  # fresh adapter
    assert logs[1]["rewards/margins"] != 0  # the first step moved the policy
    assert any("eval_rewards/accuracies" in h and "eval_loss" in h for h in trainer.state.log_history)
    after = dict(snapshot.model.named_parameters())
    changed = [n for n, before in snapshot.before.items() if not torch.equal(before, after[n].detach())]
    assert changed and all("lora_" in n for n in changed)
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file() and (out / "training_complete.json").is_file()


@pytest.mark.slow  # trains; fast: test_fresh_adapter_dpo_loss_is_log_2_with_zero_rewards, test_starting_adapter_is_...
def test_train_from_an_sft_adapter_starts_at_log_2_and_saves_only_the_trained_copy(tiny_model_dir, tmp_path,
                                                                                     pair_examples, monkeypatch,
                                                                                     capsys):
    """model.adapter_path through run.train: the summary names the adapter and the reference; the starting adapter
    is both the policy and the reference at step 1 (loss log 2), only its trained copy changes, and only it is
    saved."""
    from datasets import Dataset

    from qlora_train.data.dataset import DatasetReport
    from qlora_train.data.prepared import TrainingData
    from qlora_train.train import run

    lora_model(tiny_model_dir, fresh=False, seed=2).save_pretrained(tmp_path / "sft")
    pairs = Dataset.from_list(pair_examples)
    monkeypatch.setattr(run, "training_data", lambda cfg, tokenizer: TrainingData(pairs, None, DatasetReport()))
    cfg = preference_config(tiny_model_dir, tmp_path / "out", method="dpo")
    cfg.model.adapter_path = str(tmp_path / "sft")
    snapshot = Snapshot()
    trainer = run.train(cfg, callbacks=[snapshot])
    assert (f"\nmethod     dpo from the adapter in {tmp_path / 'sft'}; reference: that adapter, frozen (loaded a "
            "second time beside the trained copy)\n") in capsys.readouterr().out
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-4 and logs[1]["rewards/margins"] != 0
    after = dict(snapshot.model.named_parameters())
    assert snapshot.before and all(".default." in n for n in snapshot.before)
    assert any(not torch.equal(b, after[n].detach()) for n, b in snapshot.before.items())
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file() and not (out / REFERENCE_ADAPTER).exists()


def test_the_summary_says_where_a_preference_run_starts_and_its_reference():
    from qlora_train.train.run import method_line

    def line(method: str, adapter: str | None) -> str:
        return method_line(Config.model_validate({"model": {"name_or_path": "m", "adapter_path": adapter},
                                                  "data": {"datasets": [{"path": "d.jsonl"}]},
                                                  "train": {"method": method, "per_device_train_batch_size": 2}}))

    assert line("dpo", "runs/sft") == ("dpo from the adapter in runs/sft; reference: that adapter, frozen (loaded a "
                                       "second time beside the trained copy)")
    assert line("kto", None) == "kto from a new adapter on the base; reference: the base (the adapter switched off)"
    assert line("orpo", "runs/sft") == "orpo from the adapter in runs/sft; no reference model (ORPO)"


@pytest.mark.parametrize("train, model, message", [
    ("{method: dpo, packing: true}", "", "train.packing: method: dpo trains each pair as two padded rows"),
    ("{method: orpo, group_by_length: true}", "", "train.group_by_length: not available with method: orpo"),
    ("{method: dpo, dpo_loss: ipo, label_smoothing: 0.1}", "",
     "train.label_smoothing: applies to method: dpo with dpo_loss: sigmoid or robust only"),
    ("{method: ppo}", "", "train.method: Input should be 'sft', 'dpo', 'orpo', 'kto' or 'grpo'"),
    ("{method: sft}", ", adapter_path: ADAPTER", "model.adapter_path: starts preference or RL training"),
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


def test_a_preference_method_on_chat_rows_is_refused(tmp_path, tiny_model_dir):
    from datasets import Dataset

    from qlora_train.train.run import check_rows_fit_method

    chat_rows = Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[-100, 2]]})
    with pytest.raises(ConfigError, match="train.method: dpo trains on preference pairs, but the data gave chat"):
        check_rows_fit_method(preference_config(tiny_model_dir, tmp_path, method="dpo"), chat_rows)
    check_rows_fit_method(preference_config(tiny_model_dir, tmp_path, method="sft"), chat_rows)
