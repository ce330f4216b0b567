"""GRPO (``train.method: grpo``) with the transformers ``Trainer``: each optimizer step samples, scores and learns.

A step, read top to bottom (``GRPOTrainer``):

1. ``get_batch_samples``: the Trainer fetches the step's micro-batches of prompt rows (``PromptCollator``: each
   prompt's ids as the data pipeline rendered them, its messages, its reward columns, its location); each becomes a
   rollout batch (``roll_out``), unless the step reuses the last step's (``rl.num_iterations``);
2. ``roll_out``: the policy samples ``rl.num_generations`` completions per prompt (``rl.rollout.sample``: token in,
   token out, its own seeded generator); the reward functions score them (``rl.rewards.score``); the advantages are
   each completion's summed reward against its group's (``rl.loss.group_advantages``); without gradient, the old
   policy's per-token log-probs (``rl.num_iterations > 1``) and the reference's (``rl.beta > 0``: the adapter
   switched off, or the frozen ``model.adapter_path`` copy, as DPO's: ``preference.reference_model``);
3. ``compute_loss``: the policy's per-token log-probs of the completions (one decoder pass through the model the
   Trainer hands in; the output head only at the completion tokens, in chunks: ``completion_logps``), then
   ``rl.loss.grpo_loss``.

A rollout batch holds ``input_ids`` (the prompts left-padded, then the completions right-padded: TRL's layout),
``attention_mask``, ``completion_mask`` (1 at each completion's tokens the loss reads: a truncated completion's are 0
under ``rl.mask_truncated``), ``advantages`` and the old and reference log-probs ``[N, C]`` where computed.

Each step's draw is seeded from ``train.seed``, the step and the micro-batch (``step_seed``): a resumed run samples
what the uninterrupted run sampled. With ``rl.num_iterations`` > 1 the sampler (``RepeatedBlocks``) hands each step's
prompts to that many consecutive steps, and the completions sampled on the first are reused; a checkpoint saved in
between keeps them (``rollouts.pt``), so a run resumed there goes on with them.

Logged (means since the last log): ``reward`` and ``reward_std`` (the summed reward), per function
``rewards/<name>/mean``, ``/std`` and ``/none`` (the completions it left out), ``frac_reward_zero_std`` (completions
whose group's rewards were all alike: no signal), ``completions/mean_length``, ``/max_length``, ``/truncated`` (the
share without an end-of-turn token), ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean``, ``kl`` (``rl.beta
> 0``) and ``tokens_per_second`` (sampling).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler
from transformers import Trainer

from qlora_train.config import RLConfig
from qlora_train.errors import ConfigError, UsageError
from qlora_train.masking import IGNORE_INDEX, end_of_turn_tokens
from qlora_train.rl.agent import AgentLimits, AgentRollout, agent_rollout, marked_text
from qlora_train.rl.guide import CallGuide
from qlora_train.rl.loss import group_advantages, grpo_loss, nanstd
from qlora_train.rl.rewards import RewardFunction, score
from qlora_train.rl.rollout import Rollout, Sampling, sample
from qlora_train.train.preference import reference_model, use_pair_forward

log = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.pt"  # a checkpoint's completions still to be reused (rl.num_iterations > 1)
# completion tokens per chunk of the output head in GRPO's log-prob passes: a quarter of the SFT loss's (one chunk's
# float32 logits: 0.15 GiB at Qwen's vocabulary, not 0.58), measured (make bench-grpo, 2 x 8 completions of 128
# tokens) at 0.20 GiB over the loaded model against 0.66 with 1,024, in the same step time within its noise
GRPO_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class PromptCollator:
    """Prompt rows (``processed.PROMPT_ROW``'s model columns) -> the batch a rollout starts from: plain lists.

    >>> PromptCollator()([{"input_ids": [5, 6], "prompt": "[]", "reward_columns": "{}", "location": "a:1"}])
    {'prompt_ids': [[5, 6]], 'prompt': ['[]'], 'reward_columns': ['{}'], 'location': ['a:1']}
    """

    def __call__(self, features: list[dict]) -> dict[str, list]:
        return {"prompt_ids": [list(f["input_ids"]) for f in features], "prompt": [f["prompt"] for f in features],
                "reward_columns": [f["reward_columns"] for f in features],
                "location": [f["location"] for f in features]}


class RepeatedBlocks(Sampler):
    """A seeded random order of ``n`` rows, each block of ``block`` rows (one optimizer step's prompts) given
    ``repeats`` times in a row (``rl.num_iterations``: the steps that reuse its completions), TRL's
    ``RepeatSampler``'s order. ``set_epoch`` draws a new order per epoch.

    >>> list(RepeatedBlocks(4, block=2, repeats=2, seed=0))
    [0, 1, 0, 1, 3, 2, 3, 2]
    """

    def __init__(self, n: int, *, block: int, repeats: int, seed: int):
        self.n, self.block, self.repeats, self.seed, self.epoch = n, block, repeats, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for start in range(0, self.n, self.block):
            for _ in range(self.repeats):
                yield from order[start:start + self.block]

    def __len__(self) -> int:
        return self.n * self.repeats


def check_end_of_turn(tokenizer) -> tuple[int, ...]:
    """The template's end-of-turn ids (``masking.end_of_turn_tokens``): ``ConfigError`` when an end marker is not
    one token (a sampled turn could not be seen to end)."""
    end = end_of_turn_tokens(tokenizer)
    if end.strings or not end.ids:
        raise ConfigError([f"train.method: grpo needs the template's end-of-turn marker as one token of the "
                           f"vocabulary to see a sampled turn end; {list(end.strings) or 'none'} is not (model."
                           "new_tokens: auto adds the template's markers as tokens)"])
    return end.ids


def completion_logps(model, batch: dict, *, temperature: float, chunk_tokens: int = GRPO_CHUNK_TOKENS) -> torch.Tensor:
    """A rollout batch -> the per-token log-probs ``[N, C]`` of its completions under ``model`` (a peft model, or
    the DDP wrapper around it) at ``temperature``: one decoder pass, the output head only at the tokens
    ``completion_mask`` keeps, in chunks (``pair_forward`` with ``logps_temperature``); 0 elsewhere."""
    use_pair_forward(model)
    width = batch["input_ids"].shape[1] - batch["completion_mask"].shape[1]
    keep = torch.cat([torch.zeros_like(batch["attention_mask"][:, :width]), batch["completion_mask"]], dim=1)
    labels = batch["input_ids"].masked_fill(keep == 0, IGNORE_INDEX)
    logps = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                  logps_chunk_tokens=chunk_tokens, logps_temperature=temperature)
    return logps[:, width:]


def rollout_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], loss_rows: list[bool], *,
                  pad_id: int, device, trained: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Prompts and completions (ids) -> ``input_ids`` (prompts left-padded to the longest, completions right-padded),
    ``attention_mask`` and ``completion_mask`` (a completion's tokens where ``loss_rows``, else 0; of an agent
    rollout, where ``trained`` is 1: its generated ids, not its tool turns').

    >>> b = rollout_batch([[5], [6, 7]], [[8, 9], [1]], [True, False], pad_id=0, device="cpu")
    >>> b["input_ids"].tolist(), b["attention_mask"].tolist(), b["completion_mask"].tolist()
    ([[0, 5, 8, 9], [6, 7, 1, 0]], [[0, 1, 1, 1], [1, 1, 0, 0]], [[1, 1], [0, 0]])
    >>> # an agent rollout: a completion (8), a tool turn (3, 4: attended to, not trained), a completion (9)
    >>> b = rollout_batch([[5]], [[8, 3, 4, 9]], [True], pad_id=0, device="cpu", trained=[[1, 0, 0, 1]])
    >>> b["attention_mask"].tolist(), b["completion_mask"].tolist()
    ([[1, 1, 1, 1, 1]], [[1, 0, 0, 1]])
    """
    n, p, c = len(prompt_ids), max(map(len, prompt_ids)), max(1, max(map(len, completion_ids)))
    ids = torch.full((n, p + c), pad_id, dtype=torch.long)
    attention = torch.zeros((n, p + c), dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
        ids[i, p - len(prompt):p] = torch.tensor(prompt, dtype=torch.long)
        ids[i, p:p + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention[i, p - len(prompt):p] = 1
        if loss_rows[i]:
            attention[i, p:p + len(completion)] = 1
    completion_mask = attention[:, p:].clone()
    if trained is not None:
        for i, mask in enumerate(trained):
            completion_mask[i, :len(mask)] *= torch.tensor(mask, dtype=torch.long)
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device),
            "completion_mask": completion_mask.to(device)}


def malformed_call_rewards(values: torch.Tensor, weights: torch.Tensor, malformed: list[bool],
                           reward: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rl.malformed_call_reward``: the rewards ``[N, F]`` and weights ``[F]`` with one more column, weight 1,
    holding ``reward`` at each rollout whose call did not parse (its other rewards left out), nan elsewhere.

    >>> v, w = malformed_call_rewards(torch.tensor([[1.0], [0.5]]), torch.tensor([2.0]), [False, True], -1.0)
    >>> v.tolist(), w.tolist()
    ([[1.0, nan], [nan, -1.0]], [2.0, 1.0])
    """
    rows = torch.tensor(malformed, dtype=torch.bool, device=values.device)
    column = torch.full((values.shape[0], 1), float("nan"), dtype=values.dtype, device=values.device)
    column[rows] = reward
    values = values.clone()
    values[rows] = float("nan")
    return torch.cat([values, column], dim=1), torch.cat([weights, weights.new_ones(1)])


class GRPOTrainer(Trainer):
    """The ``Trainer`` with GRPO's step (see the module doc); the loss is already divided as the step needs it
    (``loss_is_scaled_for_ga``), its metrics kept as sums and counts and logged as means since the last log."""

    loss_is_scaled_for_ga = True

    def __init__(self, *args, rl: RLConfig, rewards: list[RewardFunction], end_ids: tuple[int, ...],
                 chunk_tokens: int = GRPO_CHUNK_TOKENS, tools: list | None = None, call_format=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools, self.call_format = tools or [], call_format
        self.guide = None
        if self.tools and rl.guided_first_call:
            end = self.processing_class.decode([end_ids[0]])
            self.guide = CallGuide.for_tool(self.processing_class, call_format, self.tools[0], end=end)
        self._shown_rollouts: set[str] = set()
        use_pair_forward(self.model)
        self.rl, self.rewards, self.chunk_tokens = rl, rewards, chunk_tokens
        tok = self.processing_class
        self.end_ids = end_ids
        self.stop_ids = tuple(dict.fromkeys([*end_ids, *([tok.eos_token_id] if tok.eos_token_id is not None else [])]))
        self.sampling = Sampling(rl.num_generations, rl.max_completion_length, rl.temperature, rl.top_p)
        self._rollouts: list[dict] | None = None
        self._eval_draws = 0
        self._metrics = {"train": defaultdict(lambda: [0.0, 0]), "eval": defaultdict(lambda: [0.0, 0])}

    # ---------------------------------------------------------------------------------------------- the data

    def _get_train_sampler(self, train_dataset=None):
        if self.rl.num_iterations == 1:
            return super()._get_train_sampler(train_dataset)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        block = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        return RepeatedBlocks(len(dataset), block=block, repeats=self.rl.num_iterations, seed=self.args.seed)

    def step_seed(self, micro_batch: int) -> int:
        """The draw of a micro-batch of this optimizer step: a function of ``train.seed``, the step and the
        micro-batch alone."""
        return (self.args.seed * 1_000_003 + self.state.global_step * 1_009 + micro_batch) % 2**63

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """The step's prompt batches -> their rollout batches (new, or the last step's reused: see the module doc),
        each with ``num_items_in_batch``, the loss tokens of all of them (``dapo``'s normalizer)."""
        self.model.train()  # the old and reference log-probs in training mode, as the policy's (and TRL's)
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        same = self._rollouts is not None and [r["location"] for r in self._rollouts] == \
            [b["location"] for b in batches]
        if not (same and self.state.global_step % self.rl.num_iterations):
            self._rollouts = [self.roll_out(b, seed=self.step_seed(k), mode="train") for k, b in enumerate(batches)]
        tokens = sum(float(r["completion_mask"].sum()) for r in self._rollouts)
        return [{**r, "num_items_in_batch": tokens} for r in self._rollouts], None

    # ---------------------------------------------------------------------------------------------- a rollout

    def roll_out(self, prompts: dict, *, seed: int, mode: str) -> dict:
        """A prompt batch (``PromptCollator``) -> its rollout batch (see the module doc); its sampling and reward
        metrics recorded under ``mode``."""
        model = self.accelerator.unwrap_model(self.model)
        tok, g = self.processing_class, self.rl.num_generations
        repeat = lambda values: [v for v in values for _ in range(g)]  # noqa: E731
        agents, trained = None, None
        if self.tools:
            rollout, agents = self.roll_out_agents(model, prompts, seed=seed)
            completions = [r.messages[len(json.loads(p)):] for r, p in zip(agents, repeat(prompts["prompt"]),
                                                                           strict=True)]
            generated = [[t for c in r.completions for t in c] for r in agents]
            trained = [r.trained[r.prompt_length:] for r in agents]
        else:
            rollout = sample(model, prompts["prompt_ids"], self.sampling, stop=self.stop_ids, end=self.end_ids,
                             pad_id=tok.pad_token_id, seed=seed)
            texts = tok.batch_decode([ids[:-1] if ended else ids for ids, ended in zip(rollout.completion_ids,
                                                                                      rollout.ended, strict=True)],
                                     skip_special_tokens=True)
            completions = [[{"role": "assistant", "content": t}] for t in texts]
            generated = rollout.completion_ids
        scores = score(self.rewards, [json.loads(p) for p in repeat(prompts["prompt"])], completions,
                       [json.loads(c) for c in repeat(prompts["reward_columns"])],
                       completion_ids=generated, rows=repeat(prompts["location"]), trainer_state=self.state)
        device = self.args.device
        values = torch.tensor(scores.values, dtype=torch.float32, device=device)
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32, device=device)
        if agents is not None and self.rl.malformed_call_reward is not None:
            values, weights = malformed_call_rewards(values, weights, [r.stop == "parse_error" for r in agents],
                                                     self.rl.malformed_call_reward)
        adv = group_advantages(values, weights, g, self.rl.scale_rewards)
        loss_rows = [ended or not self.rl.mask_truncated for ended in rollout.ended]
        batch = rollout_batch(rollout.prompt_ids, rollout.completion_ids, loss_rows, pad_id=tok.pad_token_id,
                              device=device, trained=trained)
        batch.update(advantages=adv.advantages, location=prompts["location"])
        with torch.no_grad(), self.accelerator.autocast():
            if self.rl.num_iterations > 1:
                batch["old_logps"] = completion_logps(model, batch, temperature=self.rl.temperature,
                                                      chunk_tokens=self.chunk_tokens)
            if self.rl.beta != 0.0:
                with reference_model(model):
                    batch["ref_logps"] = completion_logps(model, batch, temperature=self.rl.temperature,
                                                          chunk_tokens=self.chunk_tokens)
        self._record_rollout(mode, rollout, scores, values[:, :len(self.rewards)], adv)
        if agents is not None:
            self._record_agents(mode, agents)
        return batch

    def roll_out_agents(self, model, prompts: dict, *, seed: int) -> tuple[Rollout, list[AgentRollout]]:
        """Each prompt's ``num_generations`` agent rollouts (``rl.agent``), one completion sampled at a time with
        ``rl.rollout.sample`` (each draw seeded from ``seed`` and its place) -> a ``Rollout`` of everything after
        each prompt (its completions and tool turns) and the agent rollouts themselves."""
        tok = self.processing_class
        one = Sampling(1, self.rl.max_completion_length, self.rl.temperature, self.rl.top_p)
        limits = AgentLimits(self.rl.max_turns, self.rl.tool_timeout_s, self.rl.tool_max_chars)
        draws, seconds = [0], [0.0]

        def policy_of_a_rollout():
            turns = [0]

            def policy(ids: list[int]) -> list[int]:
                draws[0] += 1
                turns[0] += 1
                guide = self.guide.at(len(ids)) if self.guide is not None and turns[0] == 1 else None
                drawn = sample(model, [ids], one, stop=self.stop_ids, end=self.end_ids, pad_id=tok.pad_token_id,
                               seed=(seed + 7_919 * draws[0]) % 2**63, guide=guide)
                seconds[0] += drawn.seconds
                return drawn.completion_ids[0]

            return policy

        # each rollout starts from its prompt row's prepared ids: rendered with rl.tools' schemas (data.prompt_tools)
        agents = [agent_rollout(json.loads(p), policy_of_a_rollout(), tok, tools=self.tools,
                                call_format=self.call_format, limits=limits, prompt_ids=list(ids))
                  for p, ids in zip(prompts["prompt"], prompts["prompt_ids"], strict=True)
                  for _ in range(self.rl.num_generations)]
        rollout = Rollout([r.input_ids[:r.prompt_length] for r in agents],
                          [r.input_ids[r.prompt_length:] for r in agents],
                          [r.stop != "truncated" for r in agents], seconds[0])
        return rollout, agents

    def _record_agents(self, mode: str, agents: list[AgentRollout]) -> None:
        n = len(agents)
        record = {"agent/turns": sum(r.turns for r in agents) / n, "agent/calls": sum(r.calls for r in agents) / n,
                  "agent/tool_errors": sum(sum(r.tool_errors.values()) for r in agents) / n,
                  "agent/parse_errors": sum(r.stop == "parse_error" for r in agents) / n,
                  "agent/max_turns": sum(r.stop == "max_turns" for r in agents) / n,
                  "agent/render_differs": sum(r.render_differs for r in agents) / n}
        for key, value in record.items():
            totals = self._metrics[mode][key]
            totals[0] += value * n
            totals[1] += n
        shown = None
        for kind, wanted in (("first", lambda r: True), ("first with a call that got a result",
                                                         lambda r: r.calls > sum(r.tool_errors.values()))):
            match = next((r for r in agents if wanted(r)), None)
            if match is not None and kind not in self._shown_rollouts:
                self._shown_rollouts.add(kind)
                if match is shown:
                    continue
                shown = match
                log.info("agent rollout (%s, step %d):\n%s", kind, self.state.global_step,
                         marked_text(match, self.processing_class))

    def _record_rollout(self, mode: str, rollout, scores, values: torch.Tensor, adv) -> None:
        n = len(rollout.completion_ids)
        lengths = [len(ids) for ids in rollout.completion_ids]
        scored = ~torch.isnan(adv.rewards)
        record = {
            "reward": (float(torch.nanmean(adv.rewards)), int(scored.sum())),
            "reward_std": (float(nanstd(adv.rewards)), 1),
            "frac_reward_zero_std": (float(adv.std_zero.float().mean()), n),
            "completions/mean_length": (sum(lengths) / n, n),
            "completions/max_length": (max(lengths), 1),
            "completions/truncated": (1 - sum(rollout.ended) / n, n),
            "tokens_per_second": (rollout.tokens / max(rollout.seconds, 1e-9), 1),
        }
        for f, reward in enumerate(self.rewards):
            column = values[:, f]
            given = int((~torch.isnan(column)).sum())
            record[f"rewards/{reward.name}/mean"] = (float(torch.nanmean(column)), given)
            record[f"rewards/{reward.name}/std"] = (float(nanstd(column)), 1)
            record[f"rewards/{reward.name}/none"] = (scores.none[f], 1)
        for key, (value, count) in record.items():
            if count and not math.isnan(value):
                totals = self._metrics[mode][key]
                totals[0] += value * count
                totals[1] += count

    # ---------------------------------------------------------------------------------------------- the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise UsageError("GRPO's loss has no outputs to return")
        mode = "train" if model.training else "eval"
        logps = completion_logps(model, inputs, temperature=self.rl.temperature, chunk_tokens=self.chunk_tokens)
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        normalizer = inputs.get("num_items_in_batch") if mode == "train" else None
        terms = grpo_loss(logps, inputs["completion_mask"], inputs["advantages"], loss_type=self.rl.loss_type,
                          old_logps=inputs.get("old_logps"), ref_logps=inputs.get("ref_logps"),
                          epsilon=self.rl.epsilon, epsilon_high=self.rl.epsilon_high, beta=self.rl.beta,
                          max_completion_length=self.rl.max_completion_length, normalizer=normalizer,
                          accumulation=accumulation)
        tokens = int(inputs["completion_mask"].sum())
        for key, value in (("clip_ratio/low_mean", terms.clip_low), ("clip_ratio/high_mean", terms.clip_high),
                           ("clip_ratio/region_mean", terms.clip_region), ("kl", terms.kl)):
            if value is not None and tokens:
                totals = self._metrics[mode][key]
                totals[0] += value * tokens
                totals[1] += tokens
        return terms.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation: the held-out prompts' completions sampled and scored as in training, and their loss."""
        self._eval_draws += 1
        batch = self.roll_out(inputs, seed=(self.args.seed + 7_919 * self._eval_draws) % 2**63, mode="eval")
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, batch)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        split = "train" if "loss" in logs else "eval"
        prefix = "" if split == "train" else "eval_"
        logs.update({prefix + key: (s / n if n else float("nan")) for key, (s, n) in self._metrics[split].items()})
        self._metrics[split].clear()
        super().log(logs, start_time)

    # ---------------------------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.rl.num_iterations > 1 and self._rollouts is not None and self.state.global_step % \
                self.rl.num_iterations and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            step = self.state.global_step
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
            tensors = [{k: v for k, v in r.items() if isinstance(v, torch.Tensor)} for r in self._rollouts]
            locations = [r["location"] for r in self._rollouts]
            torch.save({"rollouts": tensors, "locations": locations}, os.path.join(folder, ROLLOUTS_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = os.path.join(resume_from_checkpoint, ROLLOUTS_FILE)
        if self.rl.num_iterations > 1 and os.path.isfile(path):
            saved = torch.load(path, map_location=self.args.device, weights_only=True)
            self._rollouts = [{**tensors, "location": locations}
                              for tensors, locations in zip(saved["rollouts"], saved["locations"], strict=True)]
