"""Our GRPO loss against TRL 1.16's ``GRPOTrainer`` on the same model, adapter, completions and rewards (issue 49).

The tiny Qwen3 model in float32 on CPU, a LoRA adapter ``GRPOTrainer`` adds itself (``peft_config``) whose B
matrices are set to seeded nonzero values, so that the policy (adapter on) is not the reference (adapter off, as TRL
and ``reference_model`` both take it for a fresh adapter). TRL's ``_generate`` is replaced by one that returns our
fixed prompt and completion ids (some ending with the end-of-turn token, some truncated, of several lengths), and the
reward functions return fixed rewards (one of them ``None`` for some completions, both for one): TRL's own
``_generate_and_score_completions`` then computes the advantages, the old policy's log-probs (``num_iterations``
2) and the reference's (``beta`` > 0), as ``roll_out`` computes ours. Then the adapter is moved (an optimizer step
would), so that the ratio to the old policy is not 1 and the clip acts, and both losses are computed on the moved
policy: TRL's ``_compute_loss`` and ours (``completion_logps`` -> ``rl.loss.grpo_loss``).

Asserted within 1e-5, for ``loss_type`` grpo, dr_grpo and dapo, with and without ``beta``, with ``num_iterations``
1 and 2, and with ``mask_truncated``: the advantages, the old and reference log-probs, the loss, the clip ratios and
the KL.
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
G = 4  # completions per prompt
C = 6  # max completion length
TEMPERATURE = 0.7
EOT = 151645  # <|im_end|>
PROMPTS = [[{"role": "user", "content": "What is 2 + 2?"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]]
# each prompt's 4 completions: ended ones (closing with <|im_end|>) of several lengths, and truncated ones (C tokens)
COMPLETIONS = [[1000, 2000, EOT], [1001, 2001, 3001, 4001, 5001, 6001], [1002, EOT], [1003, 2003, 3003, 4003, EOT],
               [1100, 2100, 3100, 4100, 5100, 6100], [1101, EOT], [1102, 2102, 3102, EOT], [1103, 2103, 3103, 4103,
                                                                                            5103, 6103]]
ACCURACY = [1.0, 0.0, 1.0, None, 0.0, 0.0, 1.0, None]  # None: left out of this function's mean
BREVITY = [0.5, -1.0, 0.8, None, -1.0, 0.9, 0.2, -0.5]  # completion 3: no function scores it (advantage 0)
WEIGHTS = (1.0, 0.5)


def accuracy(prompts, completions, **kwargs):
    return list(ACCURACY)


def brevity(prompts, completions, **kwargs):
    return list(BREVITY)


@pytest.fixture(scope="module")
def setup(qwen_tokenizer_dir, tiny_model_dir, tmp_path_factory):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("trl-grpo")), bf16=False, use_cpu=True, report_to=[],
                      per_device_train_batch_size=len(COMPLETIONS), num_generations=G, max_completion_length=C,
                      temperature=TEMPERATURE, reward_weights=list(WEIGHTS), save_strategy="no", seed=0,
                      epsilon=0.2, epsilon_high=0.28, logging_steps=1)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    rows = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = GRPOTrainer(model=model, reward_funcs=[accuracy, brevity], args=args, train_dataset=rows,
                          processing_class=tok, peft_config=lora)
    peft_model = trainer.model
    peft_model.train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    prompt_ids = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                  for p in PROMPTS]
    repeated = [ids for ids in prompt_ids for _ in range(G)]

    def fixed_generate(self, prompts):  # TRL's sampling, replaced: our completions, as sampled ids
        texts = tok.batch_decode(COMPLETIONS, skip_special_tokens=True)
        return (repeated, [list(c) for c in COMPLETIONS], None, [[{"role": "assistant", "content": t}] for t in texts],
                None, {}, None, [])

    trainer._generate = types.MethodType(fixed_generate, trainer)
    trainer.current_gradient_accumulation_steps = 1
    return types.SimpleNamespace(tok=tok, trainer=trainer, model=peft_model, prompt_ids=repeated)


def perturb(model, seed: int) -> dict:
    """Move every LoRA weight a little (what an optimizer step does); returns the weights before, to restore."""
    saved = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return saved


def restore(model, saved: dict) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in saved:
                p.copy_(saved[name])


def both(setup, *, loss_type: str, beta: float, num_iterations: int, mask_truncated: bool, grads: bool = False):
    """TRL's scored batch and ours from the same completions, then both losses (and metrics) after the move."""
    from qlora_train.rl.loss import group_advantages, grpo_loss
    from qlora_train.train.grpo import completion_logps, rollout_batch
    from qlora_train.train.preference import reference_model

    trainer, model = setup.trainer, setup.model
    trainer.loss_type, trainer.beta, trainer.num_iterations = loss_type, beta, num_iterations
    trainer.mask_truncated_completions = mask_truncated
    trainer._metrics["train"].clear()
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(G)]
    trl_batch = trainer._generate_and_score_completions(inputs)

    ended = [c[-1] == EOT for c in COMPLETIONS]
    ours = rollout_batch(setup.prompt_ids, COMPLETIONS, [e or not mask_truncated for e in ended],
                         pad_id=setup.tok.pad_token_id, device="cpu")
    rewards = torch.tensor([[float("nan") if v is None else v for v in pair] for pair in zip(ACCURACY, BREVITY)])
    ours["advantages"] = group_advantages(rewards, torch.tensor(WEIGHTS), G, "group").advantages
    with torch.no_grad():
        if num_iterations > 1:
            ours["old_logps"] = completion_logps(model, ours, temperature=TEMPERATURE)
        if beta:
            with reference_model(model):
                ours["ref_logps"] = completion_logps(model, ours, temperature=TEMPERATURE)

    saved = perturb(model, seed=7)
    lora = [p for name, p in model.named_parameters() if "lora_" in name]
    try:
        model.zero_grad()
        trl = trainer._compute_loss(model, trl_batch)
        trl_grads = torch.autograd.grad(trl, lora) if grads else None
        logps = completion_logps(model, ours, temperature=TEMPERATURE)
        terms = grpo_loss(logps, ours["completion_mask"], ours["advantages"], loss_type=loss_type,
                          old_logps=ours.get("old_logps"), ref_logps=ours.get("ref_logps"), epsilon=0.2,
                          epsilon_high=0.28, beta=beta, max_completion_length=C,
                          normalizer=ours["completion_mask"].sum())
        our_grads = torch.autograd.grad(terms.loss, lora) if grads else None
    finally:
        restore(model, saved)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    if grads:
        return trl_grads, our_grads
    return trl_batch, ours, trl.item(), terms, metrics


def test_our_rollout_batch_is_trls_layout(setup):
    """The same ids, prompt and completion masks as TRL builds from the same prompt and completion ids."""
    trl_batch, ours, *_ = both(setup, loss_type="grpo", beta=0.0, num_iterations=1, mask_truncated=False)
    assert torch.equal(ours["input_ids"], torch.cat([trl_batch["prompt_ids"], trl_batch["completion_ids"]], dim=1))
    assert torch.equal(ours["attention_mask"], torch.cat([trl_batch["prompt_mask"], trl_batch["completion_mask"]], 1))
    assert torch.equal(ours["completion_mask"], trl_batch["completion_mask"])


CASES = [(loss, beta, k, False) for loss in ("grpo", "dr_grpo", "dapo") for beta in (0.0, 0.04) for k in (1, 2)] + [
    (loss, 0.04, 2, True) for loss in ("grpo", "dr_grpo", "dapo")]  # truncated completions left out of the loss


@pytest.mark.parametrize(("loss_type", "beta", "num_iterations", "mask_truncated"), CASES)
def test_loss_equals_trls(setup, loss_type, beta, num_iterations, mask_truncated):
    trl_batch, ours, trl_loss, terms, metrics = both(setup, loss_type=loss_type, beta=beta,
                                                     num_iterations=num_iterations, mask_truncated=mask_truncated)
    assert ours["advantages"].tolist() == pytest.approx(trl_batch["advantages"].tolist(), abs=TOL)
    assert ours["advantages"][3] == 0  # no function scored it
    if num_iterations > 1:  # the old policy's log-probs, kept from before the move
        mask = ours["completion_mask"].bool()
        assert torch.allclose(ours["old_logps"][mask], trl_batch["old_per_token_logps"][mask], atol=TOL)
    if beta:
        mask = ours["completion_mask"].bool()
        assert torch.allclose(ours["ref_logps"][mask], trl_batch["ref_per_token_logps"][mask], atol=TOL)
        assert terms.kl == pytest.approx(metrics["kl"], abs=TOL)
        assert terms.kl > 100 * TOL  # the policy is not the reference: the KL term is exercised
    assert terms.loss.item() == pytest.approx(trl_loss, abs=TOL)
    if num_iterations > 1 or beta or loss_type != "grpo":  # else -mean(A) over whole groups: 0 by construction
        assert abs(trl_loss) > 100 * TOL
    for ours_key, trl_key in (("clip_low", "clip_ratio/low_mean"), ("clip_high", "clip_ratio/high_mean"),
                              ("clip_region", "clip_ratio/region_mean")):
        assert getattr(terms, ours_key) == pytest.approx(metrics[trl_key], abs=TOL), trl_key
    if num_iterations > 1:  # the moved policy's ratio leaves the clip range somewhere: the clip is exercised
        assert terms.clip_region > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gradients_equal_trls(setup, loss_type):
    """Not only the value: the adapter's gradients (through our chunked head and TRL's fused one, the clip, the
    ratio-weighted KL) agree, relative to their size."""
    trl_grads, our_grads = both(setup, loss_type=loss_type, beta=0.04, num_iterations=2, mask_truncated=False,
                                grads=True)
    scale = max(g.abs().max().item() for g in trl_grads)
    assert scale > 1e-4
    assert max((a - b).abs().max().item() for a, b in zip(trl_grads, our_grads, strict=True)) < TOL * max(1.0, scale)
