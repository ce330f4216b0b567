"""A DPO training step, ours against TRL's ``DPOTrainer`` + peft: peak memory and step time on the same model and pairs.

    python benchmarks/bench_dpo.py [--sides 1024,2048] [--batches 2] [--steps 3] [--repeats 1]
                                   [--max-gib 9] [--model .cache/tiny-qwen3]

The tiny Qwen3 (2 layers, hidden 64, tied embeddings) with the real 151,936-token vocabulary, loaded as training
loads it for both sides (``load_base_model``: 4-bit nf4, then ``prepare_model_for_kbit_training`` with
non-reentrant gradient checkpointing) and given the same fresh LoRA adapter (r=16, alpha=32, dropout 0.05, every
linear layer). Pairs are random token ids: per side ``side`` tokens, a shared prompt of ``side - side // 3``
tokens then a response of ``side // 3`` (chosen and rejected differ), the same pairs for both trainers. DPO
``sigmoid``, beta 0.1, the reference = the base with the adapter disabled, ``--steps`` optimizer steps.

- "ours": ``PreferenceTrainer`` with ``PairCollator`` on pre-built pair rows (``chosen_input_ids``,
  ``chosen_labels``, ...), the arguments ``qlora_train.train.run`` builds (``training_arguments``), as a
  ``train.method: dpo`` run trains.
- "trl": TRL's ``DPOTrainer`` given the base and ``peft_config`` (TRL wraps it with peft and takes the disabled
  adapter as the reference, its default with peft), on the pairs as ``prompt_ids`` / ``chosen_ids`` /
  ``rejected_ids`` (TRL's tokenization step is skipped: the ids are already tokens), the same optimizer, learning
  rate, schedule, seed and gradient checkpointing. TRL casts the LoRA weights of a quantised model to bfloat16
  (its QLoRA default) and computes log-probs with its own chunked LM head (``add_fused_lm_head``).

Each (point, trainer) runs in a fresh process, ours and TRL's one after the other (who goes first alternates),
``--repeats`` times. Printed per run: peak memory (CPU: the process's peak RSS, ``ru_maxrss``, and how much the
training steps added over the RSS after loading and building the trainer; CUDA: ``torch.cuda.max_memory_allocated``
during training), the fastest step after the first (wall and process CPU seconds; best over repeats) and the first
logged loss (``log 2 = 0.693147`` for both: a fresh adapter is its own reference). Runs whose estimated peak
exceeds the memory available (CPU: 75% of MemAvailable, capped by ``--max-gib``; CUDA: 90% of free GPU memory)
are skipped and say how much they would need.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import (  # noqa: E402
    GIB,
    VOCAB,
    ensure_model,
    keep_best,
    memory_limit_gib,
    peak,
    step_timer,
    train_measured,
)

TARGET = (2048, 2)  # the point: 2,048-token sides, batch 2 (4 rows of 2,048 tokens a step)
METHODS = ("ours", "trl")
BETA = 0.1
BASE_GIB = 0.7  # the process after loading (bench_train's 0.6, plus TRL / datasets imported)
TRL_TOKEN_TILE, TRL_VOCAB_TILE = 4096, 32768  # trl.kernels.chunked_logprob: a [tokens, vocab] float32 tile


def estimate_gib(method: str, tokens: int) -> float:
    """Peak estimate of a run whose batch holds ``tokens`` tokens (both sides of every pair): ours keeps one chunk
    of logits of trained positions and its gradient; TRL's CPU path scores every position in float32 tiles of
    4,096 x 32,768 with tile-sized temporaries (exp, products, masks): 4.2 GiB over the loaded process measured
    at 1,024- and 2,048-token sides x batch 2, about 8.5 tiles."""
    from qlora_train.train.loss import CHUNK_TOKENS

    if method == "ours":
        return BASE_GIB + 2 * CHUNK_TOKENS * VOCAB * 4 / GIB + tokens * 64 * 1024 / GIB
    return BASE_GIB + 8.5 * min(tokens, TRL_TOKEN_TILE) * TRL_VOCAB_TILE * 4 / GIB + tokens * 64 * 1024 / GIB


def pairs(side: int, n: int, seed: int = 0) -> list[dict]:
    """``n`` pairs of random token ids: a shared prompt of ``side - side // 3`` tokens, then a chosen and a
    rejected response of ``side // 3`` tokens each. Each pair has both forms: TRL's (``prompt_ids``,
    ``chosen_ids``, ``rejected_ids``) and ours (``chosen_input_ids``, ``chosen_labels``, ...; the prompt masked)."""
    import torch

    from qlora_train.masking.tokenize import IGNORE_INDEX

    gen = torch.Generator().manual_seed(seed)
    response = side // 3
    out = []
    for _ in range(n):
        prompt = torch.randint(0, 151643, (side - response,), generator=gen).tolist()
        chosen, rejected = (torch.randint(0, 151643, (response,), generator=gen).tolist() for _ in range(2))
        row = {"prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
        for name, ids in (("chosen", chosen), ("rejected", rejected)):
            row[f"{name}_input_ids"] = prompt + ids
            row[f"{name}_labels"] = [IGNORE_INDEX] * len(prompt) + ids
        out.append(row)
    return out


def child(args) -> None:
    """One run: load, build the trainer, train ``args.steps`` steps, print a JSON line of what was measured."""
    from transformers import AutoTokenizer, set_seed

    from qlora_train.config import Config
    from qlora_train.train.model import resolve_runtime

    with tempfile.TemporaryDirectory() as out:
        cfg = Config.model_validate({
            "model": {"name_or_path": args.model},
            "train": {"output_dir": out, "method": "dpo", "beta": BETA, "dpo_loss": "sigmoid",
                      "max_steps": args.steps, "per_device_train_batch_size": args.batch, "learning_rate": 1e-3,
                      "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 10**6,
                      "report_to": "none"},
        })
        runtime = resolve_runtime(cfg)
        set_seed(cfg.train.seed)
        data = pairs(args.side, args.batch * args.steps)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        times = step_timer()
        trainer = (build_ours if args.method == "ours" else build_trl)(cfg, runtime, data, tokenizer, times)
        model = trainer.model
        measured = train_measured(trainer, times, args.steps)
    trainable = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
    print("RESULT " + json.dumps({
        **measured,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "lora_dtype": ",".join(trainable),
    }), flush=True)


def lora_config(cfg):
    """The LoRA adapter ``load_model`` gives a fresh run (the config's defaults: r=16, alpha=32, all-linear)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM")


def build_ours(cfg, runtime, data, tokenizer, times):
    """What ``run.train`` builds for ``train.method: dpo``: ``load_model`` (4-bit base, k-bit preparation with
    gradient checkpointing, a fresh LoRA adapter), ``PreferenceTrainer`` with ``PairCollator``."""
    from qlora_train.train.collator import PairCollator
    from qlora_train.train.model import load_model
    from qlora_train.train.preference import PreferenceTrainer, check_preference_head
    from qlora_train.train.preference_loss import PreferenceObjective
    from qlora_train.train.run import training_arguments

    model = load_model(cfg, runtime)
    check_preference_head(model)
    rows = [{k: r[k] for k in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")}
            for r in data]
    return PreferenceTrainer(model=model, args=training_arguments(cfg, runtime, has_eval=False),
                             objective=PreferenceObjective.from_config(cfg.train),
                             data_collator=PairCollator(tokenizer.pad_token_id), train_dataset=rows,
                             processing_class=tokenizer, callbacks=[times])


def build_trl(cfg, runtime, data, tokenizer, times):
    """TRL's ``DPOTrainer`` on the same 4-bit base (loaded and prepared as ``load_model`` does, before the
    adapter), given ``peft_config``: TRL adds the adapter, and the reference is the adapter disabled."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    class PreTokenizedDPOTrainer(DPOTrainer):
        """The pairs are token ids already (``prompt_ids``, ``chosen_ids``, ``rejected_ids``, what TRL's own
        tokenization produces): skip it, so that TRL trains on exactly our tokens."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    t = cfg.train
    args = DPOConfig(**trl_arguments(cfg, runtime), beta=t.beta, loss_type=[t.dpo_loss], max_length=None,
                     pad_to_multiple_of=None)
    rows = Dataset.from_list([{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in data])
    return PreTokenizedDPOTrainer(model=trl_base(cfg, runtime), args=args, train_dataset=rows,
                                  processing_class=tokenizer, peft_config=lora_config(cfg), callbacks=[times])


def trl_base(cfg, runtime):
    """The base a TRL trainer is given: loaded as ``load_model`` loads it (4-bit), prepared for k-bit training
    with the same gradient checkpointing, no adapter (TRL adds it from ``peft_config``)."""
    from peft import prepare_model_for_kbit_training

    from qlora_train.train.model import load_base_model

    base = load_base_model(cfg.model, runtime)
    return prepare_model_for_kbit_training(base, use_gradient_checkpointing=cfg.train.gradient_checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def trl_arguments(cfg, runtime) -> dict:
    """The training arguments a TRL trainer shares with ours (``run.training_arguments``): optimizer, learning rate,
    schedule, precision, seed, gradient checkpointing; no checkpoints, no loggers."""
    t = cfg.train
    return dict(
        output_dir=t.output_dir, max_steps=t.max_steps, per_device_train_batch_size=t.per_device_train_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps, learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, optim=runtime.optim, bf16=runtime.bf16, fp16=runtime.fp16,
        use_cpu=runtime.device == "cpu", logging_steps=t.logging_steps, save_strategy="no", seed=t.seed,
        data_seed=t.seed, report_to=[], gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )


def run_once(args, side: int, batch: int, method: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--side", str(side), "--batch", str(batch), "--method", method,
           "--steps", str(args.steps), "--model", args.model]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} {side}x{batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def measure(args) -> dict:
    """{(side, batch): {method: best result or {"skipped": GiB needed}}}, runs interleaved."""
    configs = [(s, b) for s in args.sides for b in args.batches]
    if TARGET not in configs:
        configs.append(TARGET)
    limit, note = memory_limit_gib(args.max_gib)
    print(f"memory limit per run: {limit:.1f} GiB ({note})", flush=True)
    results: dict = {c: {} for c in configs}
    for repeat in range(args.repeats):
        for i, (side, batch) in enumerate(configs):
            order = METHODS if (i + repeat) % 2 == 0 else METHODS[::-1]
            for method in order:
                need = estimate_gib(method, 2 * side * batch)
                if need > limit:
                    results[(side, batch)][method] = {"skipped": need}
                    continue
                r = run_once(args, side, batch, method)
                print(f"  {method:>4} side {side} x batch {batch}: peak {r['peak_gib']:.2f} GiB "
                      f"(+{r['peak_gib'] - r['before_gib']:.2f}), step {r['step_wall']:.2f} s wall / "
                      f"{r['step_cpu']:.2f} s cpu, loss {r['losses'][0]:.6f}", flush=True)
                keep_best(results[(side, batch)], method, r)
    return results


def added(r: dict) -> float:
    return r["peak_gib"] - r["before_gib"]


def print_table(results: dict, args) -> None:
    from qlora_train.train.loss import CHUNK_TOKENS

    any_run = next(r for c in results.values() for r in c.values() if "skipped" not in r)
    device = any_run["device"]
    cpu = device == "cpu"
    what = "CUDA max_memory_allocated" if not cpu else "peak RSS of the run's process (ru_maxrss)"
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, device {device}, python "
          f"{platform.python_version()}, trl {version('trl')}; tiny Qwen3, vocabulary {VOCAB:,}, 4-bit nf4 + LoRA "
          f"r=16, DPO sigmoid beta {BETA}, {args.steps} steps, our chunk {CHUNK_TOKENS} tokens, best of {args.repeats}")
    print(f"memory: {what}, GiB; 'added' = peak - RSS after loading; step: fastest step after the first, seconds "
          "(wall / process CPU); loss: first logged loss; 'ours/trl': ours as a share of TRL's")
    head = (f"{'side':>5} {'batch':>5} {'method':>6} {'peak':>24} {'added':>6} {'ours/trl':>17} "
            f"{'step wall':>9} {'step cpu':>8} {'ours/trl':>8} {'first loss':>11}  lora dtype")
    print(head)
    print("-" * len(head))
    for (side, batch), by_method in results.items():
        t = by_method.get("trl", {})
        for method in METHODS:
            r = by_method[method]
            if "skipped" in r:
                skipped = f"skipped (needs ~{r['skipped']:.0f} GiB)"
                print(f"{side:>5} {batch:>5} {method:>6} {skipped:>24}")
                continue
            vs_mem = vs_time = ""
            if method == "ours" and "skipped" not in t:
                vs_mem = f"{peak(r) / peak(t):.1%}" + (f" (+{added(r) / added(t):.1%})" if cpu else "")
                vs_time = f"{r['step_cpu'] / t['step_cpu']:.2f}x"
            add = f"{added(r):.2f}" if cpu else ""
            print(f"{side:>5} {batch:>5} {method:>6} {peak(r):>24.2f} {add:>6} {vs_mem:>17} {r['step_wall']:>9.2f} "
                  f"{r['step_cpu']:>8.2f} {vs_time:>8} {r['losses'][0]:>11.6f}  {r.get('lora_dtype', '')}")
    if TARGET not in results:
        return
    o, t = results[TARGET]["ours"], results[TARGET]["trl"]
    if "skipped" in o or "skipped" in t:
        print(f"\ntarget {TARGET[0]}-token sides x batch {TARGET[1]}: not measured (skipped for memory)")
        return
    mem, wall, cpu_time = peak(o) / peak(t), o["step_wall"] / t["step_wall"], o["step_cpu"] / t["step_cpu"]
    log2 = max(abs(r["losses"][0] - math.log(2)) for r in (o, t))
    over = f" ({added(o):.2f} vs {added(t):.2f} GiB over load: {added(o) / added(t):.1%})" if cpu else ""
    print(f"\ntarget {TARGET[0]}-token sides x batch {TARGET[1]}: our peak {mem:.1%} of TRL's{over}; step time "
          f"ours / TRL {wall:.2f} wall, {cpu_time:.2f} cpu; first losses within {log2:.1e} of log 2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", default="1024,2048", help="comma-separated tokens per side (prompt + response)")
    ap.add_argument("--batches", default="2", help="comma-separated batch sizes (pairs per step)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per point and trainer, interleaved")
    ap.add_argument("--max-gib", type=float, help="skip runs estimated to need more memory than this")
    ap.add_argument("--model", default=str(REPO / ".cache" / "tiny-qwen3"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    args.sides = [int(s) for s in args.sides.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.model = ensure_model(args.model)
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
