"""The train flow, top to bottom: config -> data -> 4-bit model + LoRA -> Trainer -> outputs.

Runs unchanged as one process or under ``torchrun`` / ``accelerate launch``:
rank 0 preprocesses first and the others reuse the datasets cache; only rank
0 writes reports and outputs; each rank loads its own 4-bit model.

Before anything loads, the output directory decides whether the run starts, resumes its own checkpoints or
refuses (``resume.py``): the same command again continues a killed run. It must be a folder of ours, and this
run's alone while it runs (``output_dir.RunLock``: missing, empty or marked ours, never among the run's inputs;
locked until the run returns). Faults: Ctrl-C / SIGTERM saves a
checkpoint at the current step and raises ``TrainingInterrupted`` (``signals.py``). The final outputs are staged in
``<output_dir>/.final.tmp``, moved into place file by file (each ``os.replace``
is atomic), and ``training_complete.json`` is written last: a run is complete
exactly when that marker exists.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import yaml

from qlora_train.config import Config, ConfigError
from qlora_train.data.packing import PackingStats
from qlora_train.data.prepared import training_data
from qlora_train.errors import UsageError
from qlora_train.files import fresh_dir, write_atomic
from qlora_train.masking import SIDES, image_rule
from qlora_train.output_dir import RunLock, mark, run_inputs
from qlora_train.terminal import visible
from qlora_train.tokenizer import NO_NEW_TOKENS, NewTokens, load_tokenizer_with_new_tokens
from qlora_train.train.collator import (
    ImageCollator,
    PackedCollator,
    PackedImageCollator,
    PadCollator,
    PairCollator,
    UnpairedCollator,
)
from qlora_train.train.distributed import (
    ShardReport,
    check_distributed_setup,
    check_new_tokens,
    fsdp_config,
    with_fsdp,
)
from qlora_train.train.fused_loss import inner_causal_lm, use_fused_loss
from qlora_train.train.global_batches import with_global_batches
from qlora_train.train.model import count_parameters, load_model, load_model_config, resolve_runtime
from qlora_train.train.resume import (
    COMPLETE_MARKER,
    STAGING_DIR,
    Decision,
    agree,
    decide,
    last_checkpoint,
    prepare_output_dir,
    read_output_dir,
    refusing_unsafe_files,
    run_fingerprint,
)
from qlora_train.train.signals import StopOnSignal, TrainingInterrupted, handle_stop_signals
from qlora_train.vision import VisionBase, check_images_readable, check_vision_training, tower_line, vision_base

log = logging.getLogger("qlora_train")


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def check_optimizer(name: str) -> None:
    """``train.optim`` must be a transformers optimiser name (checked before anything loads)."""
    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError([f"train.optim: unknown optimizer '{name}'{hint}"])


def training_arguments(cfg: Config, runtime, has_eval: bool):
    from transformers import TrainingArguments

    t = cfg.train
    check_optimizer(t.optim)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    report_to = t.report_to if isinstance(t.report_to, list) else [t.report_to]
    fsdp = t.distributed == "fsdp"
    return TrainingArguments(
        output_dir=t.output_dir, max_steps=t.max_steps, num_train_epochs=t.num_epochs,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_eval_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps, learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, optim=runtime.optim, bf16=runtime.bf16, fp16=runtime.fp16,
        use_cpu=runtime.device == "cpu", logging_steps=t.logging_steps, save_strategy="steps",
        save_steps=t.save_steps, save_total_limit=t.save_total_limit,
        eval_strategy="steps" if has_eval else "no", eval_steps=t.eval_steps or t.save_steps,
        seed=t.seed, data_seed=t.seed, report_to=[] if report_to == ["none"] else report_to,
        dataloader_num_workers=t.dataloader_num_workers, remove_unused_columns=False,
        train_sampling_strategy="group_by_length" if t.group_by_length else "random",
        ddp_find_unused_parameters=False, ddp_backend="gloo" if runtime.device == "cpu" and distributed else None,
        fsdp=True if fsdp else None, fsdp_config=fsdp_config(t.fsdp_cpu_offload) if fsdp else None,
    )


def check_packing_support(model_config, packing_length: int) -> None:
    """Refuse packing where a block-diagonal mask would not keep examples apart: recurrent / linear-attention
    layers (their state flows along the row) and sliding windows shorter than a packed sequence (one 4D mask
    serves every layer, so it would widen the window). Reads the model's config only: checked before the data
    is processed or any weight loads."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    kinds = set(getattr(text, "layer_types", None) or ())
    other = sorted(kinds - {"full_attention", "sliding_attention"})
    if other:
        raise ConfigError([f"train.packing: the model has {', '.join(other)} layers, whose state would flow from "
                           "one packed example into the next; train without packing"])
    window = getattr(text, "sliding_window", None)
    if "sliding_attention" in kinds and window and window < packing_length:
        raise ConfigError([f"train.packing: sliding-window layers ({window} tokens) would see a full block mask; "
                           f"set train.packing_length <= {window}"])


def make_collator(cfg: Config, tokenizer, model, runtime):
    """Pad-only collator (pairs: both sides of each pair in one batch), or with packing the one whose attention
    fits the model's implementation: flash-attention (CUDA) reads restarting position ids, SDPA a boolean 4D mask,
    eager an additive one."""
    if cfg.train.method == "grpo":
        from qlora_train.train.grpo import PromptCollator

        return PromptCollator()
    if cfg.train.method == "kto":
        return UnpairedCollator(tokenizer.pad_token_id, max_length=cfg.data.max_length, rule=image_rule(tokenizer),
                                max_pixels=cfg.data.max_image_pixels)
    if cfg.train.method != "sft":  # a vision-language model's pairs carry their prompt's images
        return PairCollator(tokenizer.pad_token_id, rule=image_rule(tokenizer), max_pixels=cfg.data.max_image_pixels)
    rule = image_rule(tokenizer)  # a vision-language model's rows carry images
    if not cfg.train.packing:
        return (ImageCollator(tokenizer.pad_token_id, rule, max_pixels=cfg.data.max_image_pixels) if rule is not None
                else PadCollator(tokenizer.pad_token_id))
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if rule is not None:  # packed image rows: a block mask, and each example's 3D positions made for it alone
        if "flash" in attn:
            raise ConfigError([f"train.packing: packed image rows need a 4D block mask (attention sdpa or eager), "
                               f"not {attn}: its packed form reads 1D positions, and these models' are 3D"])
        return PackedImageCollator(tokenizer.pad_token_id, rule, inner_causal_lm(model).model.get_rope_index,
                                   mask_dtype=torch.bool if attn == "sdpa" else runtime.compute_dtype,
                                   max_pixels=cfg.data.max_image_pixels)
    if "flash" in attn and runtime.device == "cuda":
        return PackedCollator(tokenizer.pad_token_id, attention="position_ids")
    if attn == "eager":
        return PackedCollator(tokenizer.pad_token_id, mask_dtype=runtime.compute_dtype)
    return PackedCollator(tokenizer.pad_token_id, mask_dtype=torch.bool)


def check_rows_fit_method(cfg: Config, dataset) -> None:
    """A preference method needs pair rows (``chosen_input_ids`` ...), KTO unpaired rows (``desirable`` ...), SFT
    ``input_ids`` alone: ``ConfigError`` naming the fix when the data is another kind."""
    if dataset is None:
        return
    columns = set(dataset.column_names)
    pairs = {f"{side}_{key}" for side in SIDES for key in ("input_ids", "labels")} <= columns
    unpaired = "desirable" in columns
    prompts = "reward_columns" in columns
    method = cfg.train.method
    if method == "grpo" and not prompts:
        what = "preference pairs" if pairs else "unpaired rows" if unpaired else "chat rows"
        raise ConfigError([f"train.method: grpo samples completions for prompts, but the data gave {what} "
                           "(data.prepared_path holds rows prepared for another method: prepare them again)"])
    if prompts and method != "grpo":
        raise ConfigError([f"train.method: {method} does not train on prompts alone (the data gave prompt rows: "
                           "data.prepared_path was prepared for train.method: grpo)"])
    if method == "kto" and not unpaired:
        raise ConfigError([f"train.method: kto trains on unpaired rows (prompt, completion, label), but the data gave "
                           f"{'preference pairs' if pairs else 'chat rows'}; use unpaired rows or another method"])
    if method in ("dpo", "orpo") and not pairs:
        raise ConfigError([f"train.method: {method} trains on preference pairs, but the data gave "
                           f"{'unpaired rows' if unpaired else 'chat rows'} (no chosen/rejected columns); use pair "
                           "rows, or train.method: kto for unpaired rows, sft for chat rows"])
    if method == "sft" and pairs and "input_ids" not in columns:
        raise ConfigError(["train.method: sft trains on chat rows, but the data gave preference pairs; "
                           "set train.method: dpo or orpo"])
    if method == "sft" and unpaired:
        raise ConfigError(["train.method: sft trains on chat rows, but the data gave unpaired preference rows; "
                           "set train.method: kto"])


def rl_rewards(cfg: Config, args) -> list:
    """``train.method: grpo``: ``rl.rewards`` imported (``RewardError`` naming the one that cannot be), on one
    process (several are not supported yet); other methods: none."""
    if cfg.train.method != "grpo":
        return []
    if args.world_size > 1:
        raise ConfigError(["train.method: grpo runs on one process (several, each sampling its own prompts, are not "
                           "supported yet): run it without torchrun / accelerate launch"])
    from qlora_train.rl.rewards import load_rewards

    return load_rewards(cfg.rl.rewards)


def summary_lines(cfg: Config, runtime, model, report, packing: PackingStats | None = None,
                  new_tokens: NewTokens = NO_NEW_TOKENS, vision: VisionBase | None = None) -> list[str]:
    trainable, total = count_parameters(model)
    tower = tower_line(vision, cfg.lora.train_vision, runtime.compute_dtype)
    return [
        "=" * 72,
        f"model      {cfg.model.name_or_path}  (4-bit: {cfg.model.load_in_4bit}, template: {template_note(cfg.model)})",
        f"runtime    {runtime.note}",
        f"LoRA       r={cfg.lora.r} alpha={cfg.lora.alpha}  trainable {trainable:,} of {total:,} "
        f"({trainable / total:.2%})",
        *([f"tokens     added {', '.join(f'{t} ({i})' for t, i in zip(new_tokens.tokens, new_tokens.ids))}: only "
           "their embedding rows train (and the output head's, when untied)"] if new_tokens else []),
        *([f"vision     {tower}"] if tower else []),
        *([f"method     {method_line(cfg)}"] if cfg.train.method != "sft" else []),
        *[f"data       {line}" for line in report.lines()],
        *([f"batches    {packing.line()}"] if packing else []),
        f"output     {cfg.train.output_dir}",
        "=" * 72,
    ]


def method_line(cfg: Config) -> str:
    """A preference run's method, the adapter it starts from and the reference it keeps close to (``preference``):
    ``dpo from the adapter in outputs/quickstart; reference: that adapter, frozen``."""
    t, m = cfg.train, cfg.model
    start = f"from the adapter in {m.adapter_path}" if m.adapter_path else "from a new adapter on the base"
    if t.method == "grpo":
        rl = cfg.rl
        sampling = (f"{rl.num_generations} completions of at most {rl.max_completion_length} tokens per prompt "
                    f"(temperature {rl.temperature}, top_p {rl.top_p}), loss {rl.loss_type}")
        if rl.beta == 0:
            return f"grpo {start}; {sampling}; no reference model (rl.beta: 0)"
        reference = ("reference: that adapter, frozen (loaded a second time beside the trained copy)"
                     if m.adapter_path else "reference: the base (the adapter switched off)")
        return f"grpo {start}; {sampling}; {reference}, KL weight rl.beta {rl.beta}"
    if t.method == "orpo":
        reference = "no reference model (ORPO)"
    elif m.adapter_path:
        reference = "reference: that adapter, frozen (loaded a second time beside the trained copy)"
    else:
        reference = "reference: the base (the adapter switched off)"
    return f"{t.method} {start}; {reference}"


def template_note(m) -> str:
    """``model`` section -> how the summary names its template, e.g. ``tokenizer's own, enable_thinking=false``."""
    name = "tokenizer's own" if m.chat_template in (None, "tokenizer") else m.chat_template
    return ", ".join([name, *(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in m.chat_template_kwargs.items())])


def oom_advice(cfg: Config) -> str:
    """CUDA out of memory -> what to change in the config, most effective first."""
    d, t, m = cfg.data, cfg.train, cfg.model
    tips = [f"lower data.max_length (now {d.max_length}); `--set data.on_too_long=drop` skips the longest rows "
            "instead of cutting them",
            f"lower train.per_device_train_batch_size (now {t.per_device_train_batch_size}) and raise "
            f"train.gradient_accumulation_steps (now {t.gradient_accumulation_steps}) to keep the effective batch"]
    if not t.gradient_checkpointing:
        tips.append("set train.gradient_checkpointing: true (recomputes activations instead of storing them)")
    if not t.fused_loss:
        tips.append("set train.fused_loss: true (logits only at trained positions, a chunk at a time)")
    if getattr(t, "packing", None) is False:
        tips.append("set train.packing: true with per_device_train_batch_size: 1 (no padding; each step holds "
                    "at most max_length tokens)")
    if not (m.load_in_4bit or m.load_in_8bit):
        tips.append("load the base in 4-bit: model.load_in_4bit: true")
    if t.per_device_eval_batch_size > 1:
        tips.append(f"lower train.per_device_eval_batch_size (now {t.per_device_eval_batch_size})")
    return "CUDA ran out of memory. Try, in this order:\n" + "\n".join(f"  - {tip}" for tip in tips)


def save_final_outputs(trainer, tokenizer, cfg: Config, out: Path, main: bool) -> None:
    """Adapter, tokenizer, config, trainer state and loss history -> ``out``, atomically (see the module doc)."""
    staging = out / STAGING_DIR
    if main:
        fresh_dir(staging)  # made new: nothing planted at its name is written through
    trainer.save_model(str(staging))  # every rank calls it; rank 0 writes the LoRA adapter
    if not main:
        return
    trainer.state.save_to_json(str(staging / "trainer_state.json"))
    tokenizer.save_pretrained(staging)
    rule = image_rule(tokenizer)
    if rule is not None:  # beside the adapter, so that the output serves: preprocessor_config.json
        rule.image_processor.save_pretrained(staging)
    write_atomic(staging / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    losses = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h]
    write_atomic(staging / "loss_history.json", json.dumps(losses, indent=1))
    rewards = [{"step": h["step"], "reward": h["reward"]} for h in trainer.state.log_history if "reward" in h]
    if rewards:  # GRPO: the summed reward of each logged step's completions
        write_atomic(staging / "reward_history.json", json.dumps(rewards, indent=1))
    mark(out, published=publish(staging, out))  # what --overwrite removes of this run besides its checkpoints
    write_atomic(out / COMPLETE_MARKER, json.dumps(
        {"global_step": trainer.state.global_step, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    if rewards:  # GRPO's loss is ~0 by construction (advantages are centred): the reward says how it went
        n = min(10, len(rewards))
        first, last = (sum(r["reward"] for r in part) / n for part in (rewards[:n], rewards[-n:]))
        log.info("reward %.3f (mean of the first %d logged steps) -> %.3f (the last %d, to step %d)", first, n, last,
                 n, rewards[-1]["step"])
    elif len(losses) >= 2:
        log.info("loss %.4f (step %d) -> %.4f (step %d)", losses[0]["loss"], losses[0]["step"],
                 losses[-1]["loss"], losses[-1]["step"])
    log.info("adapter, tokenizer and config written to %s", out)


def publish(staging: Path, out: Path) -> list[str]:
    """Move every staged entry into ``out`` (``os.replace``), ``adapter_config.json`` last, then drop ``staging``;
    returns the names published.

    Each file appears whole or not at all; peft finds an adapter by its config, so
    the config is only there once the weights are. A link at a name is replaced, never written through.
    """
    entries = sorted(staging.iterdir(), key=lambda p: p.name == "adapter_config.json")
    for src in entries:
        dst = out / src.name
        if dst.is_dir() and not dst.is_symlink() and src.is_dir():
            shutil.rmtree(dst)
        os.replace(src, dst)
    staging.rmdir()
    return sorted(src.name for src in entries)


def train(cfg: Config, *, callbacks: list | None = None, overwrite: bool = False):
    """Run one training job; returns the finished ``Trainer`` (outputs are in ``cfg.train.output_dir``).

    The output folder must be ours (``output_dir``: missing, empty or written by our runs, never a folder of the
    run's inputs) and free: the run holds its lock until it returns. Resumes the checkpoints of the same config
    found there; raises ``UsageError`` when it holds a finished run or another config's checkpoints, unless
    ``overwrite`` (``--overwrite``) removes them first. Raises ``TrainingInterrupted`` after saving a checkpoint
    when SIGINT/SIGTERM arrives.
    """
    with RunLock(Path(cfg.train.output_dir)) as lock:
        return _train(cfg, lock, callbacks=callbacks, overwrite=overwrite)


def _train(cfg: Config, lock: RunLock, *, callbacks: list | None, overwrite: bool):
    from transformers import IntervalStrategy, Trainer, set_seed

    from qlora_train.rl.agent import rl_call_format, rl_tools

    set_seed(cfg.train.seed)  # before the adapter is built: LoRA init is random
    out = Path(cfg.train.output_dir)
    main = is_main_process()
    runtime = resolve_runtime(cfg)
    has_eval = cfg.data.eval_fraction > 0 or bool(cfg.data.eval_datasets)
    check_distributed_setup(cfg, runtime)
    args = training_arguments(cfg, runtime, has_eval=has_eval)  # config errors before loading
    rewards = rl_rewards(cfg, args)  # rl.rewards imported before anything loads
    tools = rl_tools(cfg)  # rl.tools too
    fingerprint = run_fingerprint(cfg)
    refusal = lock.claim(run_inputs(cfg)) if main else None  # the folder ours (output_dir) and this run's alone
    start = agree(Decision("refuse", refusal) if refusal else decide(
        read_output_dir(out), fingerprint, resume=cfg.train.resume_from_checkpoint,
        overwrite=overwrite))  # every rank takes rank 0's view of the directory
    if start.action == "refuse":
        raise UsageError(start.line)
    vision = vision_base(cfg.model, strict=False)  # unreadable: the loads below say why
    check_vision_training(cfg, vision)  # unpaired and prompt rows, FSDP: refused for a vision-language model
    if cfg.train.packing:
        check_packing_support(load_model_config(cfg.model), cfg.packing_length)
    tokenizer, new_tokens = load_tokenizer_with_new_tokens(cfg.model)
    check_new_tokens(cfg.train.distributed, new_tokens)
    if cfg.train.method == "grpo":
        from qlora_train.train.grpo import check_end_of_turn

        end_ids = check_end_of_turn(tokenizer)  # a sampled turn must be seen to end
        call_format = rl_call_format(cfg, tokenizer) if tools else None  # the template's calls must be readable

    with args.main_process_first(desc="preprocessing"):  # or reading data.prepared_path
        data = training_data(cfg, tokenizer)
    train_ds, eval_ds, report, packing = data.train, data.eval, data.report, data.packing
    check_images_readable(cfg.model, vision, report.parse.get("image_rows", 0))
    check_rows_fit_method(cfg, train_ds)
    if eval_ds is None:  # asked for, but the split came out empty: the data stage said so in one line
        args.eval_strategy = IntervalStrategy.NO
    log.info(start.line)  # the data is there to train on: where the run starts

    model = load_model(cfg, runtime, new_tokens)
    trainer_class, trainer_kwargs = Trainer, {}
    if cfg.train.method == "sft":
        log.info(use_fused_loss(model, cfg.train.fused_loss))
    elif cfg.train.method == "grpo":
        from qlora_train.train.grpo import GRPOTrainer
        from qlora_train.train.preference import check_preference_head

        check_preference_head(model)
        trainer_class, trainer_kwargs = GRPOTrainer, {"rl": cfg.rl, "rewards": rewards, "end_ids": end_ids,
                                                      "tools": tools, "call_format": call_format}
        log.info("loss: %s clipped surrogate on the sampled tokens' log-probs, chunked (rl.loss_type)",
                 cfg.rl.loss_type)
    else:
        from qlora_train.train.preference import PreferenceTrainer, check_preference_head
        from qlora_train.train.preference_loss import PreferenceObjective

        check_preference_head(model)
        trainer_class, trainer_kwargs = PreferenceTrainer, {"objective": PreferenceObjective.from_config(cfg.train)}
        log.info("loss: %s on log-probs of the trained tokens only, chunked (train.method)", cfg.train.method)
    if main:
        prepare_output_dir(start, fingerprint, out)  # the others wait for rank 0 at the first step's collectives
        write_atomic(out / "dataset_report.json", report.to_json())
        print(visible("\n".join(summary_lines(cfg, runtime, model, report, packing, new_tokens, vision))), flush=True)

    if args.world_size > 1:  # the epoch's ragged last step: blank rows, not repeated ones
        trainer_class = with_global_batches(trainer_class)
    if args.fsdp:
        trainer_class = with_fsdp(trainer_class)
    stopper = StopOnSignal()
    with handle_stop_signals(stopper):
        trainer = trainer_class(
            **trainer_kwargs, model=model, args=args, data_collator=make_collator(cfg, tokenizer, model, runtime),
            train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
            callbacks=[*(callbacks or []), stopper, *([ShardReport()] if args.fsdp else [])],
        )
        with refusing_unsafe_files(start.checkpoint, f"resuming from {start.checkpoint}") if start.checkpoint \
                else contextlib.nullcontext():
            trainer.train(resume_from_checkpoint=start.checkpoint)
        if stopper.stopped_at is not None:
            raise TrainingInterrupted(stopper.signum, stopper.stopped_at, last_checkpoint(cfg.train.output_dir))
        save_final_outputs(trainer, tokenizer, cfg, out, main)  # a signal now waits for the save to finish
    return trainer
