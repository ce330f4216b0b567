"""Preference training (``train.method: dpo | orpo | kto``) with the transformers ``Trainer``.

A step on a ``[2B, L]`` pair batch (``PairCollator``: chosen rows, then rejected rows):

1. the reference log-probs (DPO only), under ``torch.no_grad`` and ``reference_model(model)``;
2. the policy log-probs: the decoder runs once on the whole batch, and ``sequence_logps`` turns its last hidden
   states and the LM head's weight into per-row sums over trained positions, chunked (no vocabulary-sized
   logits of the batch);
3. the objective (``PreferenceObjective``): the loss, and the metrics the Trainer logs beside it.

KTO's batch (``UnpairedCollator``: B completions, then B rows pairing each prompt with another row's completion)
takes ``kto_step``: the reference on all 2B rows, the policy on the mismatched rows without gradient (the KL
estimate is detached), then the policy on the completions.

Both passes are calls of the model itself, ``model(..., logps_chunk_tokens=n)``: ``use_pair_forward`` gives the
CausalLM inside the peft model a forward that, called with ``logps_chunk_tokens``, runs the decoder and returns
the rows' ``SequenceLogps`` instead of logits (as the fused SFT loss returns its loss). So the policy pass goes
through whatever the Trainer wrapped the model in: under DDP (``torchrun``, ``accelerate launch``) its forward is
DDP's, whose reducer then all-reduces the adapter's gradients in backward, and under mixed precision both passes
run in accelerate's autocast as SFT's forward does. The reference pass (no gradient) runs on the unwrapped model.

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
import functools
import types
from collections import defaultdict

import torch
from transformers import Trainer

from qlora_train.errors import ConfigError
from qlora_train.masking import IGNORE_INDEX
from qlora_train.train.fused_loss import fused_loss_blocker, inner_causal_lm, whole
from qlora_train.train.loss import CHUNK_TOKENS, trained_positions
from qlora_train.train.preference_loss import PreferenceObjective, SequenceLogps, sequence_logps, token_logps

TRAINED_ADAPTER = "default"  # peft's name for the adapter get_peft_model / from_pretrained make
REFERENCE_ADAPTER = "reference"


def chosen_trained(labels: torch.Tensor) -> torch.Tensor:
    """``[2B, L]`` pair-batch labels (chosen rows first) -> ``[B, L]`` bool: the chosen rows' trained positions, as
    ``sequence_logps`` counts them. A pair whose chosen row has none is blank (``global_batches``)."""
    return trained_positions(labels[: labels.shape[0] // 2]) != IGNORE_INDEX


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


def use_pair_forward(model) -> None:
    """Give the CausalLM inside ``model`` (a peft model, the CausalLM, or a DDP wrapper around either) the pair
    forward: called with ``logps_chunk_tokens``, ``pair_forward``; otherwise the model class's own forward.
    Idempotent; it carries the class forward's signature and binds to the instance (as the fused SFT loss)."""
    while hasattr(model, "module") and not hasattr(model, "get_base_model"):  # DDP / DataParallel
        model = model.module
    causal_lm = inner_causal_lm(model)
    if getattr(causal_lm, "has_pair_forward", False):
        return
    cls = type(causal_lm)
    own = vars(causal_lm).get("forward")  # e.g. the fused SFT forward; else the class's

    @functools.wraps(cls.forward)
    def forward(self, *args, **kwargs):
        if "logps_chunk_tokens" in kwargs:
            return pair_forward(self, *args, **kwargs)
        return own(*args, **kwargs) if own is not None else cls.forward(self, *args, **kwargs)

    causal_lm.forward = types.MethodType(forward, causal_lm)
    causal_lm.has_pair_forward = True


# a vision-language batch's (ImageCollator): Qwen-VL's grids and mm_token_type_ids, Gemma 3's token_type_ids,
# Mistral 3's image_sizes, Idefics3's pixel_attention_mask (one per tile, as its pixels)
IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids", "token_type_ids", "image_sizes",
                "pixel_attention_mask", "batch_num_images")


def pair_forward(causal_lm, input_ids=None, attention_mask=None, *, labels, logps_chunk_tokens: int,
                 logps_temperature: float | None = None, **unused) -> SequenceLogps | torch.Tensor:
    """The decoder once on a pair batch, then ``sequence_logps`` on its last hidden states and the head's weight:
    per-row log-probs of the trained tokens, no logits. With ``logps_temperature`` (GRPO), ``token_logps`` instead:
    each trained token's log-prob ``[batch, seq]`` under the logits divided by it. A vision-language batch's image
    inputs (``IMAGE_INPUTS``) go to the decoder, which merges the images' features into their tokens' embeddings.
    What peft's forward adds besides is ``None`` here."""
    images = {k: unused.pop(k) for k in IMAGE_INPUTS if unused.get(k) is not None}
    extra = sorted(k for k, v in unused.items() if v is not None)
    if extra:
        raise TypeError(f"the pair forward takes input_ids, attention_mask, labels and image inputs only, not "
                        f"{', '.join(extra)}")
    outputs = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **images)
    weight = whole(causal_lm.lm_head.weight)
    if logps_temperature is not None:
        return token_logps(outputs[0], weight, labels, temperature=logps_temperature, chunk_tokens=logps_chunk_tokens)
    return sequence_logps(outputs[0], weight, labels, chunk_tokens=logps_chunk_tokens)


def pair_logps(model, batch: dict, *, chunk_tokens: int = CHUNK_TOKENS) -> SequenceLogps:
    """One decoder pass over a pair batch -> per-row log-probs of the trained tokens (``sequence_logps``), as a
    call of ``model`` (a peft model, or the DDP wrapper around it) with the pair forward (``use_pair_forward``)."""
    use_pair_forward(model)
    images = {k: batch[k] for k in IMAGE_INPUTS if k in batch}  # a vision-language pair batch's
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 logps_chunk_tokens=chunk_tokens, **images)


def preference_step(model, batch: dict, objective: PreferenceObjective, *, chunk_tokens: int = CHUNK_TOKENS,
                    policy_model=None, nll_tokens: float | None = None, pairs: float | None = None,
                    reduce_kl=None):
    """A pair batch -> (loss, metrics): reference log-probs when the objective needs them (on ``model``, the peft
    model), then the policy's, through ``policy_model`` (what the Trainer wrapped ``model`` in; default ``model``);
    ``nll_tokens`` and ``pairs`` as the objective reads them. KTO's batch: ``kto_step`` (``pairs``: its rows)."""
    if objective.method == "kto":
        return kto_step(model, batch, objective, chunk_tokens=chunk_tokens, policy_model=policy_model, rows=pairs,
                        reduce_kl=reduce_kl)
    reference = None
    if objective.needs_reference:
        with torch.no_grad(), reference_model(model):
            reference = pair_logps(model, batch, chunk_tokens=chunk_tokens)
    policy = pair_logps(model if policy_model is None else policy_model, batch, chunk_tokens=chunk_tokens)
    return objective(policy, reference, nll_tokens=nll_tokens, pairs=pairs)


def rows_of(batch: dict, rows: slice) -> dict:
    """The model inputs of ``rows`` of an unpaired batch, its first half or its second (``input_ids``,
    ``attention_mask``, ``labels``, and a vision-language batch's image inputs: each half holds the same images in
    the same order, ``UnpairedCollator``, so each half's pixels and grids are the same half of them)."""
    out = {key: batch[key][rows] for key in ("input_ids", "attention_mask", "labels")}
    for key in IMAGE_INPUTS:
        if key not in batch:
            continue
        if key.endswith("token_type_ids"):  # one row per sequence
            out[key] = batch[key][rows]
        else:  # one entry per image (grids) or per patch (pixels): the two halves' images, one after the other
            half = batch[key].shape[0] // 2
            out[key] = batch[key][:half] if rows.start is None else batch[key][half:]
    return out


def kto_step(model, batch: dict, objective: PreferenceObjective, *, chunk_tokens: int = CHUNK_TOKENS,
             policy_model=None, rows: float | None = None, reduce_kl=None):
    """An unpaired batch (``UnpairedCollator``: B completion rows, then B mismatched rows, ``desirable``) ->
    (loss, metrics), as TRL's ``KTOTrainer`` computes them: the reference's log-probs of all 2B rows (no gradient,
    ``reference_model``), the policy's of the mismatched rows (no gradient: the KL estimate is detached), then the
    policy's of the completions through ``policy_model`` (the one pass backward goes through)."""
    n = batch["desirable"].shape[0]
    with torch.no_grad():
        with reference_model(model):
            reference = pair_logps(model, batch, chunk_tokens=chunk_tokens)
        policy_kl = pair_logps(model, rows_of(batch, slice(n, None)), chunk_tokens=chunk_tokens)
    policy = pair_logps(model if policy_model is None else policy_model, rows_of(batch, slice(None, n)),
                        chunk_tokens=chunk_tokens)
    ref_completions, ref_kl = (SequenceLogps(sums, counts) for sums, counts in
                               zip(reference.halves(reference.sums), reference.halves(reference.counts)))
    return objective.kto(policy, ref_completions, policy_kl, ref_kl, batch["desirable"], rows=rows,
                         reduce_kl=reduce_kl)


class PreferenceTrainer(Trainer):
    """The ``Trainer`` with ``preference_step`` as its loss; the objective's metrics are averaged over the real
    pairs (ORPO's NLL over the chosen tokens) since the last log, of every rank, and logged with the loss
    (``eval_``-prefixed in evaluation). On several processes the policy pass goes through the DDP model
    ``compute_loss`` is given, and in training the loss divides by the ranks' mean count of real pairs and ORPO's
    NLL by their mean chosen-token count (``rank_means``)."""

    # the loss is a mean over this micro-batch's pairs: the Trainer divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def __init__(self, *args, objective: PreferenceObjective, chunk_tokens: int = CHUNK_TOKENS, **kwargs):
        super().__init__(*args, **kwargs)
        use_pair_forward(self.model)
        self.objective, self.chunk_tokens = objective, chunk_tokens
        self._metrics = {"train": defaultdict(lambda: [0.0, 0]), "eval": defaultdict(lambda: [0.0, 0])}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        peft_model = self.accelerator.unwrap_model(model)
        chosen = chosen_trained(inputs["labels"])
        real, chosen_tokens = chosen.any(dim=1).sum(), chosen.sum()
        nll_tokens = pairs = None
        if self.args.world_size > 1 and peft_model.training:  # the global batch's counts, as the ranks' means
            pairs, nll_tokens = self.rank_means(real, chosen_tokens)
        reduce_kl = self.rank_sums if self.args.world_size > 1 else None
        loss, metrics = preference_step(peft_model, inputs, self.objective, chunk_tokens=self.chunk_tokens,
                                        policy_model=model, nll_tokens=nll_tokens, pairs=pairs, reduce_kl=reduce_kl)
        # each metric is a mean over this batch's real pairs (ORPO's NLL: over its chosen tokens; KTO's rewards
        # and log-probs: over its rows of that label): kept as a sum and a count, so that the logged mean is over
        # every pair (token, row) since the last log, on every rank
        counts = {"nll_loss": int(chosen_tokens)}
        if "desirable" in inputs:
            desirable = inputs["desirable"].to(chosen.device).bool() & chosen.any(dim=1)
            n_desirable = int(desirable.sum())
            counts.update({"rewards/chosen": n_desirable, "logps/chosen": n_desirable,
                           "rewards/rejected": int(real) - n_desirable, "logps/rejected": int(real) - n_desirable,
                           "rewards/margins": int(real) if 0 < n_desirable < int(real) else 0})
        for key, value in metrics.items():
            count = counts.get(key, int(real))
            totals = self._metrics["train" if peft_model.training else "eval"][key]
            totals[0] += value * count if count else 0.0
            totals[1] += count
        return (loss, {"loss": loss}) if return_outputs else loss

    def rank_means(self, *counts: torch.Tensor) -> list[float]:
        """``counts`` of this rank's micro-batch, each averaged over the ranks (every rank calls it at the same
        micro-batch): what the objective divides by in training (``mean_over``, ``orpo_loss``'s ``nll_tokens``),
        so that a step on N ranks is the step on their global batch. Not in evaluation: there each rank's batch is
        its own, as the Trainer's ``eval_loss`` weighs it, and the pairs accelerate repeats to even out the ranks
        do not count."""
        stacked = torch.stack([c.to(torch.float64) for c in counts]).to(self.args.device)
        return self.accelerator.reduce(stacked, reduction="mean").tolist()

    def rank_sums(self, total: torch.Tensor, count: int) -> tuple[torch.Tensor, float]:
        """KTO's KL estimate over the ranks (every rank calls it at the same micro-batch): this rank's ``(sum,
        count)`` -> the ranks' summed ``(sum, count)``; TRL averages the ranks' means, equal where every rank has
        as many rows."""
        stacked = torch.stack([total.to(torch.float64), torch.tensor(float(count), dtype=torch.float64,
                                                                     device=total.device)]).to(self.args.device)
        summed = self.accelerator.reduce(stacked, reduction="sum")
        return summed[0].to(total.dtype), float(summed[1])

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        split = "train" if "loss" in logs else "eval"
        prefix = "" if split == "train" else "eval_"
        keys = list(self._metrics[split])  # the objective's order, the same on every rank
        totals = torch.tensor([self._metrics[split][key] for key in keys], dtype=torch.float64)  # [keys, 2]
        if self.args.world_size > 1 and keys:  # every rank logs here at the same step: sum the ranks' totals
            totals = self.accelerator.reduce(totals.to(self.args.device), reduction="sum").cpu()
        logs.update({prefix + key: (s / n if n else float("nan")) for key, (s, n) in zip(keys, totals.tolist())})
        self._metrics[split].clear()
        super().log(logs, start_time)
