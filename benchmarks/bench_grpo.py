"""A GRPO training step, ours against TRL's ``GRPOTrainer`` + peft: peak memory and step time, same model and settings.

    python benchmarks/bench_grpo.py [--steps 3] [--repeats 1] [--model .cache/tiny-qwen3]

The tiny Qwen3 (2 layers, hidden 64, tied embeddings) with the real 151,936-token vocabulary, loaded as training
loads it for both sides (``load_base_model``: 4-bit nf4, then ``prepare_model_for_kbit_training`` with
non-reentrant gradient checkpointing) and given the same fresh LoRA adapter (r=16, alpha=32, dropout 0.05, every
linear layer). Each step: 2 prompts (chat messages, rendered by the qwen3 template with the generation prompt: the
same ids for both, asserted) x 8 completions sampled at temperature 1 (top_p 1) up to 128 tokens (the random model
never ends one: 16 x 128 tokens each step), one reward function (the completion opens with a Latin letter), the
``dapo`` loss, ``beta`` 0 (TRL's default, no reference pass), ``num_iterations`` 1, ``--steps`` optimizer steps.

- "ours": ``GRPOTrainer`` (``qlora_train.train.grpo``) with ``PromptCollator`` on prompt rows as the data pipeline
  makes them, the arguments ``qlora_train.train.run`` builds (``training_arguments``): what ``train.method: grpo``
  trains. Sampling: ``generate`` with the Gumbel-max draw; the loss's log-probs: the head at completion tokens only,
  256 tokens a chunk (``GRPO_CHUNK_TOKENS``).
- "trl": TRL's ``GRPOTrainer`` given the base and ``peft_config`` (TRL adds the adapter), on the same prompts as
  messages, ``per_device_train_batch_size`` 16 completions (2 prompts x 8), the same optimizer, learning rate,
  schedule, seed and gradient checkpointing. TRL samples with ``generate`` (``torch.multinomial``), casts the LoRA
  weights of a quantised model to bfloat16 (its QLoRA default) and computes log-probs (and entropies) with its own
  chunked LM head (``add_fused_lm_head``: on CPU every position of the batch, in float32 tiles of 4,096 x 32,768).

Each trainer runs in a fresh process, ours and TRL's one after the other (who goes first alternates), ``--repeats``
times. Printed per run: peak memory (CPU: the process's peak RSS, ``ru_maxrss``, and how much the steps added over
the RSS after loading and building the trainer; CUDA: ``torch.cuda.max_memory_allocated``), the fastest step after the
first (wall and process CPU seconds, from one step's end to the next: sampling, scoring and the update; best over
repeats), the tokens sampled per step and the first step's mean reward; then the ratios, ours / TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_dpo import lora_config  # noqa: E402
from bench_train import VOCAB, ensure_model, keep_best, peak, train_measured  # noqa: E402

METHODS = ("ours", "trl")
PROMPTS = 2  # per step
GENERATIONS = 8
COMPLETION_TOKENS = 128
TARGET_MEMORY = 0.5  # our peak at most half of TRL's
QUESTIONS = ["What is 2 + 2?", "Name a primary colour.", "What is the capital of Peru?", "How many legs has a spider?",
             "What is 7 times 6?", "Which planet is the largest?", "What is the opposite of hot?", "Say hello."]


def messages(n: int) -> list[list[dict]]:
    """``n`` prompts as chat messages (a system turn, then a question), the same for both trainers."""
    return [[{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def latin(prompts, completions, **kwargs) -> list[float]:
    """The reward: 1 where the completion's text opens with a Latin letter (a random model's does some of the time:
    groups whose rewards differ, so that the update is not zero)."""
    from qlora_train.rl.rewards import matches

    return matches(prompts, completions, pattern=r"^\s?[A-Za-z]")


def step_clock():
    """A ``TrainerCallback`` that keeps the wall and process CPU seconds from one step's end to the next (the first
    from the start of training): everything a GRPO step does, wherever the trainer samples."""
    import torch
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.wall, self.cpu = [], []

        def _now(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return time.perf_counter(), time.process_time()

        def on_train_begin(self, args, state, control, **kw):
            self._last = self._now()

        def on_step_end(self, args, state, control, **kw):
            now = self._now()
            self.wall.append(now[0] - self._last[0])
            self.cpu.append(now[1] - self._last[1])
            self._last = now

    return StepClock()


def child(args) -> None:
    """One run: load, build the trainer, train ``args.steps`` steps, print a JSON line of what was measured."""
    from transformers import AutoTokenizer, set_seed

    from qlora_train.config import Config
    from qlora_train.train.model import resolve_runtime

    with tempfile.TemporaryDirectory() as out:
        cfg = Config.model_validate({
            "model": {"name_or_path": args.model},
            "data": {"max_length": 512},
            "train": {"output_dir": out, "method": "grpo", "max_steps": args.steps,
                      "per_device_train_batch_size": PROMPTS, "learning_rate": 1e-3, "lr_scheduler": "constant",
                      "warmup_ratio": 0.0, "logging_steps": 1, "save_steps": 10**6, "report_to": "none"},
            "rl": {"rewards": [{"function": "bench_grpo:latin"}], "num_generations": GENERATIONS,
                   "max_completion_length": COMPLETION_TOKENS, "temperature": 1.0, "loss_type": "dapo", "beta": 0.0},
        })
        runtime = resolve_runtime(cfg)
        set_seed(cfg.train.seed)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        clock = step_clock()
        build = build_ours if args.method == "ours" else build_trl
        trainer = build(cfg, runtime, messages(PROMPTS * args.steps), tokenizer, clock)
        model = trainer.model
        measured = train_measured(trainer, clock, args.steps)
    trainable = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
    logs = [h for h in trainer.state.log_history if "reward" in h]
    lengths = [h.get("completions/mean_length") for h in logs]
    print("RESULT " + json.dumps({
        **measured,
        "tokens": PROMPTS * GENERATIONS * (lengths[0] or 0),
        "reward": logs[0]["reward"] if logs else None,
        "lora_dtype": ",".join(trainable),
    }), flush=True)


def build_ours(cfg, runtime, prompts, tokenizer, clock):
    """What ``run.train`` builds for ``train.method: grpo``: ``load_model`` (4-bit base, k-bit preparation with
    gradient checkpointing, a fresh LoRA adapter), ``GRPOTrainer`` with ``PromptCollator`` on prompt rows rendered
    by the engine (``masking.render_prompt``), the reward imported from ``rl.rewards`` (this module)."""
    from qlora_train.masking import render_prompt
    from qlora_train.rl.rewards import load_rewards
    from qlora_train.train.grpo import GRPOTrainer, PromptCollator, check_end_of_turn
    from qlora_train.train.model import load_model
    from qlora_train.train.preference import check_preference_head
    from qlora_train.train.run import training_arguments

    model = load_model(cfg, runtime)
    check_preference_head(model)
    rows = []
    for i, m in enumerate(prompts):
        ids = render_prompt(m, tokenizer).input_ids
        assert ids == tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]  # TRL's ids
        rows.append({"input_ids": ids, "prompt": json.dumps(m), "reward_columns": "{}", "location": f"prompt {i}"})
    return GRPOTrainer(model=model, args=training_arguments(cfg, runtime, has_eval=False), rl=cfg.rl,
                       rewards=load_rewards(cfg.rl.rewards), end_ids=check_end_of_turn(tokenizer),
                       data_collator=PromptCollator(), train_dataset=rows,
                       processing_class=tokenizer, callbacks=[clock])


def build_trl(cfg, runtime, prompts, tokenizer, clock):
    """TRL's ``GRPOTrainer`` on the same 4-bit base (loaded and prepared as ``load_model`` does, before the
    adapter), given ``peft_config``: TRL adds the adapter."""
    from datasets import Dataset
    from peft import prepare_model_for_kbit_training
    from trl import GRPOConfig, GRPOTrainer

    from qlora_train.train.model import load_base_model

    t, rl = cfg.train, cfg.rl
    base = load_base_model(cfg.model, runtime)
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=t.gradient_checkpointing,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})
    args = GRPOConfig(
        output_dir=t.output_dir, max_steps=t.max_steps, per_device_train_batch_size=PROMPTS * GENERATIONS,
        gradient_accumulation_steps=t.gradient_accumulation_steps, learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_ratio, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, optim=runtime.optim, bf16=runtime.bf16, fp16=runtime.fp16,
        use_cpu=runtime.device == "cpu", logging_steps=t.logging_steps, save_strategy="no", seed=t.seed,
        data_seed=t.seed, report_to=[], gradient_checkpointing=t.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, num_generations=rl.num_generations,
        max_completion_length=rl.max_completion_length, temperature=rl.temperature, top_p=rl.top_p,
        loss_type=rl.loss_type, beta=rl.beta, num_iterations=rl.num_iterations, shuffle_dataset=False,
    )
    rows = Dataset.from_list([{"prompt": m} for m in prompts])
    return GRPOTrainer(model=base, reward_funcs=[latin], args=args, train_dataset=rows, processing_class=tokenizer,
                       peft_config=lora_config(cfg), callbacks=[clock])


def run_once(args, method: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--method", method, "--steps", str(args.steps), "--model", args.model]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def measure(args) -> dict:
    """{method: best result}, the runs interleaved."""
    results: dict = {}
    for repeat in range(args.repeats):
        for method in (METHODS if repeat % 2 == 0 else METHODS[::-1]):
            r = run_once(args, method)
            print(f"  {method:>4}: peak {r['peak_gib']:.2f} GiB (+{r['peak_gib'] - r['before_gib']:.2f}), step "
                  f"{r['step_wall']:.2f} s wall / {r['step_cpu']:.2f} s cpu, {r['tokens']:.0f} tokens sampled, "
                  f"first reward {r['reward']}", flush=True)
            keep_best(results, method, r)
    return results


def print_table(results: dict, args) -> None:
    o, t = results["ours"], results["trl"]
    cpu = o["device"] == "cpu"
    what = "CUDA max_memory_allocated" if not cpu else "peak RSS of the run's process (ru_maxrss)"
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, device {o['device']}, python "
          f"{platform.python_version()}, trl {version('trl')}; tiny Qwen3, vocabulary {VOCAB:,}, 4-bit nf4 + LoRA "
          f"r=16; GRPO: {PROMPTS} prompts x {GENERATIONS} completions of {COMPLETION_TOKENS} tokens a step, dapo, "
          f"beta 0; {args.steps} steps, best of {args.repeats}")
    print(f"memory: {what}, GiB; 'added' = peak - RSS after loading; step: fastest step after the first, from one "
          "step's end to the next (sampling, rewards, update), seconds")
    head = f"{'method':>6} {'peak':>6} {'added':>6} {'step wall':>9} {'step cpu':>8} {'tokens':>6}  lora dtype"
    print(head)
    print("-" * len(head))
    for method in METHODS:
        r = results[method]
        added = f"{r['peak_gib'] - r['before_gib']:.2f}" if cpu else ""
        print(f"{method:>6} {peak(r):>6.2f} {added:>6} {r['step_wall']:>9.2f} {r['step_cpu']:>8.2f} "
              f"{r['tokens']:>6.0f}  {r['lora_dtype']}")
    mem, wall, cpu_time = peak(o) / peak(t), o["step_wall"] / t["step_wall"], o["step_cpu"] / t["step_cpu"]
    over = (f" ({o['peak_gib'] - o['before_gib']:.2f} vs {t['peak_gib'] - t['before_gib']:.2f} GiB over load: "
            f"{(o['peak_gib'] - o['before_gib']) / (t['peak_gib'] - t['before_gib']):.1%})") if cpu else ""
    verdict = "meets" if mem <= TARGET_MEMORY else "misses"
    print(f"\nours / TRL: peak memory {mem:.2f}x{over} ({verdict} the target <= {TARGET_MEMORY}x); step time "
          f"{wall:.2f}x wall, {cpu_time:.2f}x cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per trainer, interleaved")
    ap.add_argument("--model", default=str(REPO / ".cache" / "tiny-qwen3"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    args.model = ensure_model(args.model)
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
