"""Preference training (``train.method: dpo | orpo``) with the transformers ``Trainer``.

A step on a ``[2B, L]`` pair batch (``PairCollator``: chosen rows, then rejected rows):

1. the reference log-probs (DPO only), under ``torch.no_grad`` and ``reference_model(model)``;
2. the policy log-probs: the decoder runs once on the whole batch, and ``sequence_logps`` turns its last hidden
   states and the LM head's weight into per-row sums over trained positions, chunked (no vocabulary-sized
   logits of the batch);
3. the objective (``PreferenceObjective``): the loss, and the metrics the Trainer logs beside it.

The reference is where training starts, never a second copy of the base in memory:

- a fresh adapter (LoRA B = 0, so the policy equals the base): the base itself, the adapter switched off with
  peft's ``disable_adapter()``;
- an adapter training starts from (``model.adapter_path``, usually an SFT run's output): ``load_model`` loads it
  twice on the one base, as the trained ``default`` adapter and as a frozen ``reference`` one (a few MB of LoRA
  weights); the reference pass makes ``reference`` the active adapter and then ``default`` again. Disabling the
  adapter there would make the base the reference, not the SFT model DPO is meant to stay close to.

Reference first, then policy: switching adapters sets ``requires_grad`` of their weights (peft's
``set_adapter``), which must not happen between the policy's forward and its backward.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from transformers import Trainer

from qlora_train.errors import ConfigError
from qlora_train.train.fused_loss import fused_loss_blocker, inner_causal_lm
from qlora_train.train.loss import CHUNK_TOKENS
from qlora_train.train.preference_loss import PreferenceObjective, SequenceLogps, sequence_logps

TRAINED_ADAPTER = "default"  # peft's name for the adapter get_peft_model / from_pretrained make
REFERENCE_ADAPTER = "reference"


def check_preference_head(model) -> None:
    """``ConfigError`` unless the model's logits are its decoder's last hidden states through a plain
    bias-free head (what ``sequence_logps`` computes with); the same conditions as the fused SFT loss."""
    why = fused_loss_blocker(inner_causal_lm(model))
    if why:
        raise ConfigError([f"train.method: preference training computes log-probs from the decoder's hidden "
                           f"states and the output head, which is not exact for this model: {why}"])


@contextlib.contextmanager
def reference_model(model):
    """Within: ``model`` (a peft model) computes as the reference: its ``reference`` adapter when it has one
    (``model.adapter_path``), else the base with the adapter disabled."""
    if REFERENCE_ADAPTER not in model.peft_config:
        with model.disable_adapter():
            yield
        return
    active = model.active_adapter
    model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(active)  # trainable again


def pair_logps(model, batch: dict, *, chunk_tokens: int = CHUNK_TOKENS) -> SequenceLogps:
    """One decoder pass over a pair batch -> per-row log-probs of the trained tokens (``sequence_logps``)."""
    causal_lm = inner_causal_lm(model)
    outputs = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    return sequence_logps(outputs[0], causal_lm.lm_head.weight, batch["labels"], chunk_tokens=chunk_tokens)


def preference_step(model, batch: dict, objective: PreferenceObjective, *, chunk_tokens: int = CHUNK_TOKENS):
    """A pair batch -> (loss, metrics): reference log-probs when the objective needs them, then the policy's."""
    reference = None
    if objective.needs_reference:
        with torch.no_grad(), reference_model(model):
            reference = pair_logps(model, batch, chunk_tokens=chunk_tokens)
    policy = pair_logps(model, batch, chunk_tokens=chunk_tokens)
    return objective(policy, reference)


class PreferenceTrainer(Trainer):
    """The ``Trainer`` with ``preference_step`` as its loss; the objective's metrics are averaged over the
    micro-batches since the last log and logged with the loss (``eval_``-prefixed in evaluation)."""

    # the loss is a mean over this micro-batch's pairs: the Trainer divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def __init__(self, *args, objective: PreferenceObjective, chunk_tokens: int = CHUNK_TOKENS, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.world_size > 1:
            raise ConfigError([f"train.method: {objective.method} runs in one process only for now "
                               "(launch without torchrun / accelerate)"])
        self.objective, self.chunk_tokens = objective, chunk_tokens
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        model = self.accelerator.unwrap_model(model)
        loss, metrics = preference_step(model, inputs, self.objective, chunk_tokens=self.chunk_tokens)
        for key, value in metrics.items():
            self._metrics["train" if model.training else "eval"][key].append(value)
        return (loss, {"loss": loss}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        split = "train" if "loss" in logs else "eval"
        prefix = "" if split == "train" else "eval_"
        for key, values in self._metrics[split].items():
            logs[prefix + key] = sum(values) / len(values)
        self._metrics[split].clear()
        super().log(logs, start_time)
