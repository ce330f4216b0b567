"""The train flow, top to bottom: config -> data -> 4-bit model + LoRA -> Trainer -> outputs.

Runs unchanged as one process or under ``torchrun`` / ``accelerate launch``:
rank 0 preprocesses first and the others reuse the datasets cache; only rank
0 writes reports and outputs; each rank loads its own 4-bit model.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
import yaml

from qlora_train.config import Config
from qlora_train.data.dataset import build_datasets
from qlora_train.data.packing import PackingStats, example_lengths, pack_dataset
from qlora_train.train.collator import PackedCollator, PadCollator
from qlora_train.train.model import count_parameters, load_model, load_tokenizer, resolve_runtime

log = logging.getLogger("qlora_train")


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary name, then rename: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def training_arguments(cfg: Config, runtime, has_eval: bool):
    from transformers import TrainingArguments

    t = cfg.train
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    report_to = t.report_to if isinstance(t.report_to, list) else [t.report_to]
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
    )


def resolve_resume(cfg: Config) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    resume = cfg.train.resume_from_checkpoint
    if resume != "auto":
        return resume
    last = get_last_checkpoint(cfg.train.output_dir) if Path(cfg.train.output_dir).is_dir() else None
    log.info("resume_from_checkpoint: auto -> %s", last or "no checkpoint yet, starting fresh")
    return last


def pack_or_group(cfg: Config, train_ds, eval_ds):
    """``train.packing``: pack both splits; ``train.group_by_length``: add the ``length`` column the
    length-grouped sampler reads. Returns (train, eval, PackingStats of train or None)."""
    t = cfg.train
    if t.packing:
        length = t.packing_length or cfg.data.max_length
        train_ds, stats = pack_dataset(train_ds, length, split_long=t.split_long)
        if eval_ds is not None:
            eval_ds, _ = pack_dataset(eval_ds, length, split_long=t.split_long)
        return train_ds, eval_ds, stats
    if t.group_by_length:
        train_ds = train_ds.add_column("length", example_lengths(train_ds))
    return train_ds, eval_ds, None


def check_packing_support(model_config, packing_length: int) -> None:
    """Refuse packing where a block-diagonal mask would not keep examples apart: recurrent / linear-attention
    layers (their state flows along the row) and sliding windows shorter than a packed sequence (one 4D mask
    serves every layer, so it would widen the window)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    kinds = set(getattr(text, "layer_types", None) or ())
    other = sorted(kinds - {"full_attention", "sliding_attention"})
    if other:
        raise ValueError(f"train.packing: the model has {', '.join(other)} layers, whose state would flow from one "
                         "packed example into the next; train without packing")
    window = getattr(text, "sliding_window", None)
    if "sliding_attention" in kinds and window and window < packing_length:
        raise ValueError(f"train.packing: sliding-window layers ({window} tokens) would see a full block mask; "
                         f"set train.packing_length <= {window}")


def make_collator(cfg: Config, tokenizer, model, runtime):
    """Pad-only collator, or with packing the one whose attention fits the model's implementation:
    flash-attention (CUDA) reads restarting position ids, SDPA a boolean 4D mask, eager an additive one."""
    if not cfg.train.packing:
        return PadCollator(tokenizer.pad_token_id)
    check_packing_support(model.config, cfg.train.packing_length or cfg.data.max_length)
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if "flash" in attn and runtime.device == "cuda":
        return PackedCollator(tokenizer.pad_token_id, attention="position_ids")
    if attn == "eager":
        return PackedCollator(tokenizer.pad_token_id, mask_dtype=runtime.compute_dtype)
    return PackedCollator(tokenizer.pad_token_id, mask_dtype=torch.bool)


def summary_lines(cfg: Config, runtime, model, report, packing: PackingStats | None = None) -> list[str]:
    trainable, total = count_parameters(model)
    return [
        "=" * 72,
        f"model      {cfg.model.name_or_path}  (4-bit: {cfg.model.load_in_4bit}, template: {cfg.model.chat_template})",
        f"runtime    {runtime.note}",
        f"LoRA       r={cfg.lora.r} alpha={cfg.lora.alpha}  trainable {trainable:,} of {total:,} "
        f"({trainable / total:.2%})",
        *[f"data       {line}" for line in report.lines()],
        *([f"batches    {packing.line()}"] if packing else []),
        f"output     {cfg.train.output_dir}",
        "=" * 72,
    ]


def train(cfg: Config, *, callbacks: list | None = None):
    """Run one training job; returns the finished ``Trainer`` (outputs are in ``cfg.train.output_dir``)."""
    from transformers import Trainer, set_seed

    set_seed(cfg.train.seed)  # before the adapter is built: LoRA init is random
    out = Path(cfg.train.output_dir)
    main = is_main_process()
    runtime = resolve_runtime(cfg)
    log.info(runtime.note)
    tokenizer = load_tokenizer(cfg.model)
    args = training_arguments(cfg, runtime, has_eval=cfg.data.eval_fraction > 0)

    with args.main_process_first(desc="preprocessing"):
        train_ds, eval_ds, report = build_datasets(cfg.data, tokenizer)
        train_ds, eval_ds, packing = pack_or_group(cfg, train_ds, eval_ds)

    model = load_model(cfg, runtime)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "dataset_report.json", report.to_json())
        print("\n".join(summary_lines(cfg, runtime, model, report, packing)), flush=True)

    trainer = Trainer(
        model=model, args=args, data_collator=make_collator(cfg, tokenizer, model, runtime),
        train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer, callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resolve_resume(cfg))

    trainer.save_model(str(out))  # the LoRA adapter (rank 0 only)
    if main:
        trainer.save_state()
        tokenizer.save_pretrained(out)
        write_atomic(out / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        losses = [{"step": h["step"], "loss": h["loss"]} for h in trainer.state.log_history if "loss" in h]
        write_atomic(out / "loss_history.json", json.dumps(losses, indent=1))
        if len(losses) >= 2:
            log.info("loss %.4f (step %d) -> %.4f (step %d)", losses[0]["loss"], losses[0]["step"],
                     losses[-1]["loss"], losses[-1]["step"])
        log.info("adapter, tokenizer and config written to %s", out)
    return trainer
