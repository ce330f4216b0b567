"""Training-step memory and time of the LM head and the loss: the model's own loss against the fused one.

    python benchmarks/bench_train.py [--seqs 1024,2048,4096] [--batches 1,4] [--steps 4] [--repeats 1]
                                     [--max-gib 9] [--no-target] [--model .cache/tiny-qwen3]

The tiny Qwen3 (2 layers, hidden 64, tied embeddings) with the real 151,936-token vocabulary, loaded
as training loads it (``load_model``: 4-bit nf4 + LoRA r=16 on all linear layers, gradient
checkpointing), trained ``--steps`` optimizer steps by the transformers Trainer with ``train.fused_loss``
off ("default") and on ("fused"). Rows are ``seq`` random token ids, a third of them trained, as in
chat data (the quickstart trains 32.5%): 171 masked tokens then 85 trained, repeated. Every sequence
length x batch size runs, and 2,048 x 2 (the issue's target point).

Each (configuration, loss) runs in a fresh process, default and fused one after the other (who goes
first alternates), ``--repeats`` times. Printed per run: peak memory (CPU: the process's peak RSS,
``ru_maxrss``, and how much of it the training steps added over the RSS after loading; CUDA:
``torch.cuda.max_memory_allocated`` during training), the fastest step after the first (wall and
process CPU seconds; best over repeats) and the first logged loss. Runs whose estimated peak exceeds
the memory available (CPU: 75% of MemAvailable, capped by ``--max-gib``; CUDA: 90% of free GPU
memory) are skipped and say how much they would need.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = 151936
TARGET = (2048, 2)  # the point: fused peak <= 35% of default, step time not worse, losses within 1e-4
MASKED_RUN, TRAINED_RUN = 171, 85
GIB = 2**30
# Peak estimates, fitted on CPU runs of this benchmark (default path: 2.35 GiB at 1,024 tokens, 4.11 at
# 2,048, 0.54 after loading): the process after loading, plus per token the default path's float32
# vocabulary-sized buffers alive at once (logits, log-softmax, their gradients: 3.1 measured, 3.25 counted)
# or the fused path's one chunk of logits (and its softmax gradient) and small per-token state.
BASE_GIB = 0.6
DEFAULT_BUFFERS = 3.25


def estimate_gib(loss: str, tokens: int) -> float:
    from qlora_train.train.loss import CHUNK_TOKENS

    if loss == "default":
        return BASE_GIB + DEFAULT_BUFFERS * tokens * VOCAB * 4 / GIB
    return BASE_GIB + 2 * CHUNK_TOKENS * VOCAB * 4 / GIB + tokens * 64 * 1024 / GIB


def rows(seq: int, n: int, seed: int = 0) -> list[dict]:
    """``n`` rows of ``seq`` random token ids; labels trained on 85 of every 256 positions."""
    return rows_of_lengths([seq] * n, seed)


def rows_of_lengths(lengths: list[int], seed: int = 0) -> list[dict]:
    """One row of random token ids (none special) per length; labels trained on 85 of every 256 positions."""
    import torch

    from qlora_train.masking.tokenize import IGNORE_INDEX

    gen = torch.Generator().manual_seed(seed)
    out = []
    for seq in lengths:
        ids = torch.randint(0, 151643, (seq,), generator=gen)
        trained = torch.arange(seq) % (MASKED_RUN + TRAINED_RUN) >= MASKED_RUN
        out.append({"input_ids": ids.tolist(), "attention_mask": [1] * seq,
                    "labels": torch.where(trained, ids, IGNORE_INDEX).tolist()})
    return out


def step_timer():
    """A ``TrainerCallback`` that keeps each step's wall and process CPU seconds (``.wall``, ``.cpu``)."""
    import torch
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.wall, self.cpu = [], []

        def on_step_begin(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._wall, self._cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.wall.append(time.perf_counter() - self._wall)
            self.cpu.append(time.process_time() - self._cpu)

    return StepTimes()


def keep_best(cell: dict, key, r: dict) -> None:
    """``cell[key]``: the first run's result, then memory the highest peak seen, times the fastest."""
    best = cell.get(key)
    if best is None:
        cell[key] = r
        return
    best["peak_gib"] = max(best["peak_gib"], r["peak_gib"])
    if "before_gib" in r:
        best["before_gib"] = min(best["before_gib"], r["before_gib"])
    for k in ("step_wall", "step_cpu"):
        best[k] = min(best[k], r[k])


def child(args) -> None:
    """One run: load, train ``args.steps`` steps, print a JSON line of what was measured."""
    from transformers import Trainer, set_seed

    from qlora_train.config import Config
    from qlora_train.train.collator import PadCollator
    from qlora_train.train.fused_loss import use_fused_loss, uses_fused_loss
    from qlora_train.train.model import load_model, resolve_runtime
    from qlora_train.train.run import training_arguments

    with tempfile.TemporaryDirectory() as out:
        cfg = Config.model_validate({
            "model": {"name_or_path": args.model},
            "train": {"output_dir": out, "max_steps": args.steps, "per_device_train_batch_size": args.batch,
                      "learning_rate": 1e-3, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
                      "save_steps": 10**6, "report_to": "none", "fused_loss": args.loss == "fused"},
        })
        runtime = resolve_runtime(cfg)
        set_seed(cfg.train.seed)
        model = load_model(cfg, runtime)
        use_fused_loss(model, cfg.train.fused_loss)
        assert uses_fused_loss(model) == (args.loss == "fused")
        times = step_timer()
        trainer = Trainer(model=model, args=training_arguments(cfg, runtime, has_eval=False),
                          data_collator=PadCollator(pad_token_id=0),
                          train_dataset=rows(args.seq, args.batch * args.steps), callbacks=[times])
        measured = train_measured(trainer, times, args.steps)
    print("RESULT " + json.dumps({
        **measured, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }), flush=True)


def train_measured(trainer, times, steps: int) -> dict:
    """``trainer.train()`` measured, as every training benchmark here reports it: the process's peak RSS and its RSS
    before training (GiB), CUDA's peak allocation, the device, and the fastest step after the first (``times``: a
    step timer's ``wall`` and ``cpu`` lists)."""
    import torch

    rss_before = resident_kib()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    timed = slice(1, None) if steps > 1 else slice(None)
    return {
        "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "before_gib": rss_before / 2**20,
        "cuda_peak_gib": torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "step_wall": min(times.wall[timed]), "step_cpu": min(times.cpu[timed]),
    }


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def memory_limit_gib(max_gib: float | None) -> tuple[float, str]:
    """What a run may use: (GiB, where the number comes from)."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return 0.9 * free / GIB, "90% of free GPU memory"
    available = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:")) / 2**20
    limit, note = 0.75 * available, f"75% of MemAvailable ({available:.1f} GiB)"
    if max_gib is not None and max_gib < limit:
        limit, note = max_gib, "--max-gib"
    return limit, note


def run_once(args, seq: int, batch: int, loss: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--seq", str(seq), "--batch", str(batch), "--loss", loss,
           "--steps", str(args.steps), "--model", args.model]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{loss} {seq}x{batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def ensure_model(path: str) -> str:
    if not (Path(path) / "config.json").is_file():
        from qlora_train.tiny import build_tiny_qwen3

        build_tiny_qwen3(path)
    return path


def measure(args) -> dict:
    """{(seq, batch): {loss: best result or {"skipped": GiB needed}}}, runs interleaved."""
    configs = [(s, b) for s in args.seqs for b in args.batches]
    if args.target and TARGET not in configs:
        configs.append(TARGET)
    limit, note = memory_limit_gib(args.max_gib)
    print(f"memory limit per run: {limit:.1f} GiB ({note})", flush=True)
    results: dict = {c: {} for c in configs}
    for repeat in range(args.repeats):
        for i, (seq, batch) in enumerate(configs):
            order = ("default", "fused") if (i + repeat) % 2 == 0 else ("fused", "default")
            for loss in order:
                need = estimate_gib(loss, seq * batch)
                if need > limit:
                    results[(seq, batch)][loss] = {"skipped": need}
                    continue
                r = run_once(args, seq, batch, loss)
                print(f"  {loss:>7} seq {seq} x batch {batch}: peak {r['peak_gib']:.2f} GiB, "
                      f"step {r['step_wall']:.2f} s wall / {r['step_cpu']:.2f} s cpu, loss {r['losses'][0]:.6f}",
                      flush=True)
                keep_best(results[(seq, batch)], loss, r)
    return results


def peak(r: dict) -> float:
    return r["cuda_peak_gib"] if r.get("cuda_peak_gib") is not None else r["peak_gib"]


def cell(r: dict, key: str, fmt: str) -> str:
    return f"skipped (needs ~{r['skipped']:.0f} GiB)" if "skipped" in r else format(r[key], fmt)


def print_table(results: dict, args) -> None:
    from qlora_train.train.loss import CHUNK_TOKENS

    any_run = next(r for c in results.values() for r in c.values() if "skipped" not in r)
    device = any_run["device"]
    what = "CUDA max_memory_allocated" if device != "cpu" else "peak RSS of the run's process (ru_maxrss)"
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, device {device}, python "
          f"{platform.python_version()}; tiny Qwen3, vocabulary {VOCAB:,}, 4-bit nf4 + LoRA, {args.steps} steps, "
          f"fused chunk {CHUNK_TOKENS} tokens, best of {args.repeats}")
    print(f"memory: {what}, GiB; 'added' = peak - RSS after loading; step: fastest step after the first, seconds "
          "(wall / process CPU); loss: first logged loss")
    head = (f"{'seq':>5} {'batch':>5} {'loss':>7} {'peak':>24} {'added':>6} {'vs default':>10} "
            f"{'step wall':>9} {'step cpu':>8} {'vs default':>10} {'first loss':>11}")
    print(head)
    print("-" * len(head))
    for (seq, batch), by_loss in results.items():
        d = by_loss.get("default", {})
        for loss in ("default", "fused"):
            r = by_loss[loss]
            if "skipped" in r:
                print(f"{seq:>5} {batch:>5} {loss:>7} {cell(r, '', ''):>24}")
                continue
            vs_mem = vs_time = ""
            if loss == "fused" and "skipped" not in d:
                vs_mem = f"{peak(r) / peak(d):.1%}"
                vs_time = f"{r['step_cpu'] / d['step_cpu']:.2f}x"
            added = "" if device != "cpu" else f"{r['peak_gib'] - r['before_gib']:.2f}"
            print(f"{seq:>5} {batch:>5} {loss:>7} {peak(r):>24.2f} {added:>6} {vs_mem:>10} {r['step_wall']:>9.2f} "
                  f"{r['step_cpu']:>8.2f} {vs_time:>10} {r['losses'][0]:>11.6f}")
    if TARGET not in results:
        return
    d, f = results[TARGET]["default"], results[TARGET]["fused"]
    if "skipped" in d or "skipped" in f:
        print(f"\ntarget {TARGET[0]} tokens x batch {TARGET[1]}: not measured (skipped for memory)")
        return
    mem, wall, cpu = peak(f) / peak(d), f["step_wall"] / d["step_wall"], f["step_cpu"] / d["step_cpu"]
    diff = abs(f["losses"][0] - d["losses"][0])
    print(f"\ntarget {TARGET[0]} tokens x batch {TARGET[1]}: fused peak {mem:.1%} of default (goal <= 35%: "
          f"{'met' if mem <= 0.35 else 'NOT met'}); step time fused / default {wall:.2f} wall, {cpu:.2f} cpu "
          f"(goal <= 1: {'met' if max(wall, cpu) <= 1 else 'NOT met'}); first losses differ by {diff:.1e} "
          f"(goal <= 1e-4: {'met' if diff <= 1e-4 else 'NOT met'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096", help="comma-separated sequence lengths")
    ap.add_argument("--batches", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration and loss, interleaved")
    ap.add_argument("--max-gib", type=float, help="skip runs estimated to need more memory than this")
    ap.add_argument("--no-target", dest="target", action="store_false",
                    help=f"leave out the issue's target point ({TARGET[0]} tokens x batch {TARGET[1]})")
    ap.add_argument("--model", default=str(REPO / ".cache" / "tiny-qwen3"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--loss", choices=["default", "fused"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    args.model = ensure_model(args.model)
    print_table(measure(args), args)


if __name__ == "__main__":
    main()
