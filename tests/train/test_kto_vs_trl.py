"""Our KTO loss against TRL 1.16's ``KTOTrainer`` on the same model, adapter weights and unpaired rows (issue 36).

The setup of ``test_preference_vs_trl.py``: the tiny Qwen3 model in float32 on CPU, a LoRA adapter that
``KTOTrainer`` adds itself (``peft_config``) whose B matrices are then set to seeded nonzero values, so that the
policy (adapter on) is not the reference (adapter off, as TRL and ``reference_model`` both take it for a fresh
adapter); Llama 3's template on the Qwen vocabulary, which ends an assistant turn with ``<|eot_id|>`` and nothing
after it, so TRL's completion (everything after the prompt rendered with the generation prompt) is exactly the
tokens we train. TRL tokenizes the conversational rows itself (``KTOTrainer._prepare_dataset``: also its
``KL_completion_ids``, each row's completion shifted by one within a batch), collates them
(``DataCollatorForUnpairedPreference``) and computes the loss through ``KTOTrainer.compute_loss``; ours is
``build_unpaired_example`` -> ``UnpairedCollator`` (the same shift, made per batch) -> ``preference_step``.

The ids and completion masks are asserted equal first (also those of the mismatched KL rows); then the loss, the KL
estimate and the logged rewards and log-probs agree within 1e-5, with equal and with unequal label weights.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

try:  # a dev extra (pyproject: trl==1.16.0): missing, the file fails under CI and is skipped locally
    import trl  # noqa: F401
except ImportError:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise
    pytest.skip("trl is not installed (pip install -e '.[dev]')", allow_module_level=True)

pytestmark = pytest.mark.slow

TOL = 1e-5
BETA = 0.1
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
     "completion": [{"role": "assistant", "content": "4."}], "label": True},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}],
     "completion": [{"role": "assistant", "content": "Lyon, the old capital of Gaul."}], "label": False},
    {"prompt": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}],
     "completion": [{"role": "assistant", "content": "Green."}], "label": True},
    {"prompt": [{"role": "user", "content": "Is ice cold?"}],
     "completion": [{"role": "assistant", "content": "No, ice is usually hot to the touch."}], "label": False},
]


@pytest.fixture(scope="module")
def setup(qwen_tokenizer_dir, tiny_model_dir, tmp_path_factory):
    """TRL's KTOTrainer (fresh LoRA adapter, then B set nonzero), its collated batch, and our unpaired batch."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from qlora_train.data import get_chat_template
    from qlora_train.data.unpaired import build_unpaired_example, canonicalize_unpaired
    from qlora_train.train.collator import UnpairedCollator

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tok = get_chat_template(tok, "llama3")
    tok.eos_token = "<|eot_id|>"

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    args = KTOConfig(output_dir=str(tmp_path_factory.mktemp("trl-kto")), bf16=False, use_cpu=True, report_to=[],
                     per_device_train_batch_size=len(ROWS), max_length=None, beta=BETA, save_strategy="no", seed=0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    trainer = KTOTrainer(model=model, args=args, train_dataset=Dataset.from_list(ROWS), processing_class=tok,
                         peft_config=lora)
    peft_model = trainer.model
    peft_model.train()
    ours = []
    for row in ROWS:
        canon = canonicalize_unpaired(row)
        ex = build_unpaired_example(canon.prompt, canon.completion, tok)
        ours.append({**ex, "desirable": int(canon.desirable)})
    our_batch = UnpairedCollator(tok.pad_token_id)(ours)
    lora_b = [p for name, p in peft_model.named_parameters() if "lora_B" in name]
    assert lora_b
    # seeded nonzero B matrices, the first draw (of a fixed sequence) whose KL estimate is positive: a negative one
    # is clamped to 0 by both, and the KL term would go untested
    for seed, sign in ((s, sign) for s in range(1, 9) for sign in (1, -1)):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in lora_b:
                p.copy_(sign * torch.randn(p.shape, generator=generator) * 0.3)
        if mismatched_log_ratio(peft_model, our_batch) > 1e-2:
            break
    else:
        pytest.fail("no seeded adapter gives a positive KL estimate")

    trl_rows = [trainer.train_dataset[i] for i in range(len(ROWS))]
    return types.SimpleNamespace(tok=tok, trainer=trainer, model=peft_model, trl_rows=trl_rows, ours=ours,
                                 trl_batch=trainer.data_collator(trl_rows), our_batch=our_batch)


def mismatched_log_ratio(model, batch) -> float:
    """The mean over the mismatched rows of log pi - log ref (the KL estimate before its clamp)."""
    from qlora_train.train.preference import pair_logps, reference_model, rows_of

    kl_rows = rows_of(batch, slice(len(ROWS), None))
    with torch.no_grad():
        policy = pair_logps(model, kl_rows)
        with reference_model(model):
            reference = pair_logps(model, kl_rows)
    return (policy.sums - reference.sums).mean().item()


def test_trl_tokenizes_the_rows_and_their_kl_rows_as_we_do(setup):
    """TRL's prompt + completion ids are our ids, its completion mask our trained labels; its KL rows (each prompt
    with the previous row's completion) are our mismatched rows."""
    n = len(ROWS)
    for trl_row, ex in zip(setup.trl_rows, setup.ours, strict=True):
        prompt, completion = trl_row["prompt_ids"], trl_row["completion_ids"]
        assert len(prompt) == ex["prompt_length"]
        assert prompt + completion == list(ex["input_ids"])
        assert [-100] * len(prompt) + completion == list(ex["labels"])
    assert [r["label"] for r in setup.trl_rows] == setup.our_batch["desirable"].tolist() == [True, False, True, False]
    trl_batch, ours = setup.trl_batch, setup.our_batch
    for prefix, rows in (("", slice(None, n)), ("KL_", slice(n, None))):
        ids, mask = trl_batch[f"{prefix}input_ids"], trl_batch[f"{prefix}completion_mask"].bool()
        width = ids.shape[1]
        real = trl_batch[f"{prefix}attention_mask"].bool()
        assert torch.equal(ours["input_ids"][rows, :width][real], ids[real])
        assert torch.equal(ours["labels"][rows, :width] != -100, mask)
        assert (ours["labels"][rows, width:] == -100).all()


def trl_kto(setup, desirable_weight: float, undesirable_weight: float):
    trainer = setup.trainer
    trainer.desirable_weight, trainer.undesirable_weight = desirable_weight, undesirable_weight
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(setup.model, setup.trl_batch)
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize(("desirable_weight", "undesirable_weight"), [(1.0, 1.0), (1.33, 0.7)])
def test_kto_loss_kl_and_rewards_equal_trl(setup, desirable_weight, undesirable_weight):
    from qlora_train.train.preference import preference_step
    from qlora_train.train.preference_loss import PreferenceObjective

    trl_loss, trl_metrics = trl_kto(setup, desirable_weight, undesirable_weight)
    objective = PreferenceObjective("kto", beta=BETA, desirable_weight=desirable_weight,
                                    undesirable_weight=undesirable_weight)
    loss, metrics = preference_step(setup.model, setup.our_batch, objective)
    # the policy is not the reference, and the KL estimate is not clamped to 0: each term is exercised
    assert min(abs(metrics["rewards/chosen"]), abs(metrics["rewards/rejected"])) > 100 * TOL, metrics
    assert metrics["kl"] > 100 * TOL, metrics
    assert loss.item() == pytest.approx(trl_loss, abs=TOL)
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert metrics[key] == pytest.approx(trl_metrics[key], abs=TOL), key
    for key in ("logps/chosen", "logps/rejected"):  # summed log-probs, tens of nats: relative
        assert metrics[key] == pytest.approx(trl_metrics[key], rel=TOL), key


def test_the_loss_by_hand_from_the_log_probs(setup):
    """The formula, on our own log-probs: w_d (1 - sigmoid(beta (r - z))) and w_u (1 - sigmoid(beta (z - r))), z the
    mean log-ratio of the mismatched rows clamped at 0; and the gradient reaches the adapter through the
    completions only (the KL estimate is detached)."""
    from qlora_train.train.preference import pair_logps, preference_step, reference_model, rows_of
    from qlora_train.train.preference_loss import PreferenceObjective

    batch, n = setup.our_batch, len(ROWS)
    with torch.no_grad():
        policy = pair_logps(setup.model, batch)
        with reference_model(setup.model):
            reference = pair_logps(setup.model, batch)
    ratio = policy.sums - reference.sums
    z = ratio[n:].mean().clamp(min=0)
    desirable = batch["desirable"]
    r = ratio[:n]
    expected = torch.where(desirable, 1.33 * (1 - torch.sigmoid(BETA * (r - z))),
                           0.7 * (1 - torch.sigmoid(BETA * (z - r)))).mean()
    objective = PreferenceObjective("kto", beta=BETA, desirable_weight=1.33, undesirable_weight=0.7)
    setup.model.zero_grad()
    loss, _ = preference_step(setup.model, batch, objective)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    loss.backward()
    grads = [p.grad for name, p in setup.model.named_parameters() if "lora_A" in name]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    setup.model.zero_grad()
    assert rows_of(batch, slice(None, n))["input_ids"].shape[0] == n
