"""Our preference losses against TRL 1.16's own code on the same model, adapter weights and pairs (issue 20).

Setup: the tiny Qwen3 model in float32 on CPU (no 4-bit: the comparison is of the objectives and the log-probs,
not of the quantised layers), a LoRA adapter that ``DPOTrainer`` itself adds (``peft_config``) whose B matrices
are then set to seeded nonzero values, so the policy (adapter on) is not the reference (adapter off, the way TRL
and ``reference_model`` both take it for a fresh adapter). TRL tokenizes the conversational pairs itself
(``DPOTrainer._prepare_dataset``, ``ORPOTrainer.tokenize_row``), collates them with its own collator and computes
the loss through ``DPOTrainer.compute_loss`` / ``ORPOTrainer.get_batch_loss_metrics`` on the model; ours is
``build_preference_example`` -> ``PairCollator`` -> ``preference_step``.

The template is Llama 3's (on the Qwen vocabulary, its markers added as special tokens): it ends an assistant
turn with ``<|eot_id|>`` and nothing after it, so TRL's completion (everything after the prompt rendered with the
generation prompt) is exactly the tokens we train; the test asserts that TRL's ids and completion masks equal ours
before comparing any loss. On Qwen3's (ChatML) template they differ: TRL also trains the ``\\n`` the template writes
after ``<|im_end|>`` (one more token per side; asserted below), so no loss is compared there.

Where the definitions agree, the loss and the logged rewards must agree within 1e-5:

- DPO ``sigmoid`` (beta 0.1, no label smoothing: TRL 1.x's sigmoid reads none) and ``robust`` (label_smoothing
  0.1): loss, ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``logps/*`` (summed);
- ORPO: the odds-ratio term (loss - nll_loss), ``rewards/*`` (lambda x mean log-prob), ``log_odds_ratio``,
  ``log_odds_chosen``. TRL's ORPO NLL is the mean over the chosen rows' prompt *and* response tokens, ours over the
  response's trained tokens only (as SFT), so the NLL and the total loss differ; TRL's ORPO ``logps/*`` are
  means, ours sums.
- IPO: TRL divides each log-ratio by its completion's token count before squaring; ours is the paper's, on sums.
  The test checks TRL's value equals that length-normalised formula on our log-probs (so only the definition
  differs), and that ours differs from it.
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

pytestmark = pytest.mark.slow  # ~27 s on a loaded 2-core CPU (~10 s of it the tokenizer and the tiny model)

TOL = 1e-5
BETA = 0.1
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "4."}],
     "rejected": [{"role": "assistant", "content": "It is 5, I think."}]},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "Lyon, the old capital of Gaul."}]},
    {"prompt": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}],
     "chosen": [{"role": "assistant", "content": "Green."}],
     "rejected": [{"role": "assistant", "content": "A number: 7."}]},
]


@pytest.fixture(scope="module")
def setup(qwen_tokenizer_dir, tiny_model_dir, tmp_path_factory):
    """TRL's DPOTrainer (fresh LoRA adapter, then B set nonzero), its collated batch, and our pair batch."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from qlora_train.data import build_preference_example, canonicalize_pair, get_chat_template
    from qlora_train.train.collator import PairCollator

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tok = get_chat_template(tok, "llama3")
    tok.eos_token = "<|eot_id|>"  # as Llama 3 Instruct's: TRL's ORPO appends eos to a response not ending with it

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl-dpo")), bf16=False, use_cpu=True, report_to=[],
                     per_device_train_batch_size=len(ROWS), max_length=None, beta=BETA, loss_type=["sigmoid"],
                     save_strategy="no", seed=0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(ROWS), processing_class=tok,
                         peft_config=lora)
    peft_model = trainer.model
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        lora_b = [p for name, p in peft_model.named_parameters() if "lora_B" in name]
        assert lora_b
        for p in lora_b:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    peft_model.train()

    trl_rows = [trainer.train_dataset[i] for i in range(len(ROWS))]
    ours = []
    for row in ROWS:
        pair = canonicalize_pair(row)
        ours.append(build_preference_example(pair.prompt, pair.chosen, pair.rejected, tok))
    return types.SimpleNamespace(tok=tok, trainer=trainer, model=peft_model, trl_rows=trl_rows, ours=ours,
                                 trl_batch=trainer.data_collator(trl_rows),
                                 our_batch=PairCollator(tok.pad_token_id)(ours))


def trl_dpo(setup, loss_type: str, label_smoothing: float = 0.0):
    """TRL's DPO loss and logged metrics for one batch: ``DPOTrainer.compute_loss`` with the loss type it would
    read from ``DPOConfig`` (set on the trainer, where ``__init__`` puts it, instead of building a trainer per loss)."""
    trainer = setup.trainer
    trainer.loss_types, trainer.loss_weights, trainer.label_smoothing = [loss_type], [1.0], label_smoothing
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(setup.model, setup.trl_batch)
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def ours(setup, objective):
    from qlora_train.train.preference import preference_step

    loss, metrics = preference_step(setup.model, setup.our_batch, objective)
    return loss.item(), metrics


def test_trl_tokenizes_the_pairs_as_we_do(setup):
    """TRL's prompt + completion ids are our ids, and its completion mask is exactly our trained labels."""
    for trl_row, ex in zip(setup.trl_rows, setup.ours, strict=True):
        prompt = trl_row["prompt_ids"]
        assert len(prompt) == ex["prompt_length"]
        for side in ("chosen", "rejected"):
            completion = trl_row[f"{side}_ids"]
            assert prompt + completion == list(ex[f"{side}_input_ids"])
            assert [-100] * len(prompt) + completion == list(ex[f"{side}_labels"])
    # and the collated batches: TRL's completion mask (shifted as the loss reads it) is our trained positions
    trl_batch, our_batch = setup.trl_batch, setup.our_batch
    width = trl_batch["input_ids"].shape[1]
    assert torch.equal(our_batch["labels"][:, :width] != -100, trl_batch["completion_mask"].bool())
    assert (our_batch["labels"][:, width:] == -100).all()


@pytest.mark.parametrize(("loss_type", "label_smoothing"), [("sigmoid", 0.0), ("robust", 0.1)])
def test_dpo_loss_and_rewards_equal_trl(setup, loss_type, label_smoothing):
    from qlora_train.train.preference_loss import PreferenceObjective

    trl_loss, trl_metrics = trl_dpo(setup, loss_type, label_smoothing)
    loss, metrics = ours(setup, PreferenceObjective("dpo", beta=BETA, dpo_loss=loss_type,
                                                    label_smoothing=label_smoothing))
    # the policy is not the reference: every reward is far from 0 against the tolerance
    assert min(abs(metrics["rewards/chosen"]), abs(metrics["rewards/rejected"])) > 100 * TOL, metrics
    assert loss == pytest.approx(trl_loss, abs=TOL)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[key] == pytest.approx(trl_metrics[key], abs=TOL), key
    for key in ("logps/chosen", "logps/rejected"):  # summed log-probs, tens of nats: relative
        assert metrics[key] == pytest.approx(trl_metrics[key], rel=TOL), key


def test_ipo_differs_from_trl_only_by_length_normalisation(setup):
    """TRL's ``ipo`` = ``(h_w / n_w - h_l / n_l - 1/(2 beta))^2`` (h: log-ratio, n: completion tokens); ours is the
    paper's ``(h_w - h_l - 1/(2 beta))^2``."""
    from qlora_train.train.preference import pair_logps, reference_model
    from qlora_train.train.preference_loss import PreferenceObjective

    trl_loss, _ = trl_dpo(setup, "ipo")
    loss, _ = ours(setup, PreferenceObjective("dpo", beta=BETA, dpo_loss="ipo"))
    with torch.no_grad():
        policy = pair_logps(setup.model, setup.our_batch)
        with reference_model(setup.model):
            reference = pair_logps(setup.model, setup.our_batch)
    ratio_w, ratio_l = policy.halves((policy.sums - reference.sums) / policy.counts)
    normalised = ((ratio_w - ratio_l - 1 / (2 * BETA)) ** 2).mean().item()
    assert trl_loss == pytest.approx(normalised, rel=TOL)
    assert abs(loss - trl_loss) > 0.1


def test_orpo_odds_ratio_term_and_rewards_equal_trl(setup, tmp_path):
    """TRL's (experimental) ORPOTrainer on the same model: the odds-ratio term, the rewards and log odds agree; the
    NLL term does not by definition (TRL's covers the chosen rows' prompt tokens too)."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from qlora_train.train.preference_loss import PreferenceObjective

    args = ORPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[], beta=BETA, max_length=1024,
                      per_device_train_batch_size=len(ROWS), remove_unused_columns=False, save_strategy="no")
    trainer = ORPOTrainer(model=setup.model, args=args, train_dataset=Dataset.from_list(ROWS),
                          processing_class=setup.tok)
    rows = [trainer.train_dataset[i] for i in range(len(ROWS))]
    for row, ex in zip(rows, setup.ours, strict=True):
        for side in ("chosen", "rejected"):
            assert row[f"{side}_input_ids"] == list(ex[f"{side}_input_ids"])
            assert row[f"{side}_labels"] == list(ex[f"{side}_labels"])
    with torch.no_grad():
        trl_loss, trl_metrics = trainer.get_batch_loss_metrics(setup.model, trainer.data_collator(rows))
    loss, metrics = ours(setup, PreferenceObjective("orpo", orpo_lambda=BETA))

    assert (loss - metrics["nll_loss"]) == pytest.approx(trl_loss.item() - trl_metrics["nll_loss"], abs=TOL)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "log_odds_ratio",
                "log_odds_chosen"):
        assert metrics[key] == pytest.approx(trl_metrics[key], abs=TOL), key
    assert metrics["nll_loss"] < trl_metrics["nll_loss"] - 0.01  # prompt tokens are harder for a random model


def test_on_qwen3_template_trl_also_trains_the_newline_after_im_end(setup, qwen_tokenizer_dir):
    """Why the comparison is on Llama 3's template: on ChatML TRL's completion is ours plus the ``\\n`` the template
    writes after ``<|im_end|>`` (the same prompt ids; TRL's own ``_prepare_dataset``)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from qlora_train.data import build_preference_example, canonicalize_pair, get_chat_template

    qwen3_tok = get_chat_template(AutoTokenizer.from_pretrained(qwen_tokenizer_dir), "qwen3")
    prepared = setup.trainer._prepare_dataset(Dataset.from_list(ROWS), qwen3_tok, setup.trainer.args, "qwen3")
    newline = qwen3_tok.encode("\n", add_special_tokens=False)
    for i, row in enumerate(ROWS):
        pair = canonicalize_pair(row)
        ex = build_preference_example(pair.prompt, pair.chosen, pair.rejected, qwen3_tok)
        assert prepared[i]["prompt_ids"] == list(ex["chosen_input_ids"][:ex["prompt_length"]])
        for side in ("chosen", "rejected"):
            trained = [t for t in ex[f"{side}_labels"] if t != -100]
            assert prepared[i][f"{side}_ids"] == trained + newline
