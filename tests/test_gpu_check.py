"""scripts/gpu_check.sh and its parts: the CPU rehearsal end to end (slow), the result files, the shapes."""

from __future__ import annotations

import doctest
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


check = load(REPO / "scripts" / "gpu_check.py")
shapes = load(REPO / "benchmarks" / "bench_shapes.py")


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_on_a_cpu_and_writes_the_results(tmp_path):
    out = tmp_path / "results"
    env = {**os.environ, "PYTHON": sys.executable, "QLORA_GPU_SITE": str(tmp_path / "site"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--rehearse", "--work", str(tmp_path / "work"), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "gpu_results.json", "gpu_results.md"]
    summary = json.loads((out / "gpu_results.json").read_text())
    assert summary["rehearse"] is True and summary["passed"] is True
    steps = {s["step"]: s for s in summary["steps"]}
    assert list(steps) == ["install", "versions", "tests", "demos", "bench"]
    assert all(s["status"] == "passed" for s in steps.values())

    assert summary["install"]["problems"] == []
    facts = steps["versions"]["facts"]
    assert facts["cuda"] is False and facts["import_errors"] == {} and 0.05 < facts["nf4_relative_error"] < 0.2
    assert facts["packages"]["bitsandbytes"] == "0.50.2" and facts["packages"]["trl"] == "1.16.0"

    tests = steps["tests"]
    assert tests["passed"] == tests["failed"] == []
    assert "test_gpu::test_cuda_bf16_paged_8bit" in tests["skipped"]

    demos = steps["demos"]["demos"]
    assert [d["name"] for d in demos] == ["sft", "dpo", "kto", "vl"]
    for d in demos:
        assert d["status"] == "passed" and d["steps"] == 1, d
        assert d["runtime"].startswith("no CUDA device: training on CPU in float32 with adamw_torch"), d
    assert abs(demos[1]["first_loss"] - math.log(2)) < 1e-4 and abs(demos[2]["first_loss"] - 0.5) < 1e-4
    assert demos[0]["loss_line"].startswith(check.FUSED_LOSS) and demos[3]["loss_line"].startswith(check.FUSED_LOSS)

    runs = steps["bench"]["runs"]
    assert [(r["shape"], r["label"]) for r in runs] == [(r.shape, r.label) for r in shapes.PLAN]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in runs), runs
    by = {(r["shape"], r["label"]): r for r in runs}
    for shape in ("qwen3-1.7b", "qwen3-8b"):  # the same model and rows: the same first loss, ours and TRL's
        assert abs(by[shape, "sft ours"]["first_loss"] - by[shape, "sft TRL"]["first_loss"]) < 1e-4
        assert abs(by[shape, "dpo ours"]["first_loss"] - math.log(2)) < 1e-4
        assert abs(by[shape, "dpo TRL"]["first_loss"] - math.log(2)) < 1e-4
    assert by["qwen3-1.7b", "sft ours"]["tokens_per_step"] == 256
    assert by["qwen3-1.7b", "dpo ours"]["tokens_per_step"] == 512
    assert by["qwen3-1.7b", "sft ours, packed"]["tokens_per_step"] <= 256

    text = (out / "gpu_results.md").read_text()
    assert text.startswith("# GPU check: a CPU rehearsal (tiny sizes: the numbers say nothing of a GPU)\n")
    assert "| shape | run | tokens/step | tokens/s | peak GiB | step s | first loss | status |" in text
    assert "qwen3-8b sft: ours " in text and "=== demos: vision-language: exit 0" in (out / "gpu_check.log").read_text()


def test_a_gpu_run_without_cuda_fails_its_versions_step(tmp_path, monkeypatch):
    """No CUDA device and no --rehearse: the versions step fails and says what to run instead (``main`` stops)."""
    facts = {"cuda": False, "import_errors": {}, "packages": {}, "nf4_relative_error": 0.1}
    monkeypatch.setattr(check.Check, "run", lambda self, title, cmd, timeout_s: (0, "PROBE " + json.dumps(facts)))
    record = check.step_versions(check.Check(tmp_path / "out", tmp_path / "work", rehearse=False, budget_s=None))
    assert record["status"] == "failed"
    assert record["detail"].startswith("no CUDA device: on a machine without one, run scripts/gpu_check.sh "
                                       "--rehearse")


def test_the_markdown_names_the_card_the_driver_and_the_versions():
    packages = dict.fromkeys(check.PACKAGES, "1.0")
    facts = {"cuda": True, "card": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "driver": "580.159.04",
             "torch_cuda": "13.0", "python": "3.12.3", "packages": packages}
    run = {"shape": "qwen3-1.7b", "label": "sft ours", "status": "ok", "tokens_per_step": 4096, "tokens_per_s":
           20480.4, "peak_gib": 5.123, "step_s": 0.2, "first_loss": 11.93}
    trl = {**run, "label": "sft TRL", "tokens_per_s": 10240.2, "peak_gib": 10.246}
    skipped = {"shape": "qwen3-8b", "label": "dpo TRL", "status": "skipped", "error": "the check's time budget was "
                                                                                       "spent"}
    summary = {"rehearse": False, "date": "2026-11-27 12:00:00 +0000", "seconds": 431.0, "facts": facts,
               "steps": [{"step": "versions", "status": "passed", "seconds": 9.6, "detail": "ok"},
                         {"step": "bench", "status": "passed", "seconds": 300, "detail": "2 of 3 runs measured",
                          "runs": [run, trl, skipped]}]}
    lines = check.markdown(summary).splitlines()
    assert lines[:3] == [
        "# GPU check: NVIDIA H100 80GB HBM3, driver 580.159.04, CUDA 13.0", "",
        "2026-11-27 12:00:00 +0000, 431 s in all; NVIDIA H100 80GB HBM3 (79.2 GiB), driver 580.159.04, CUDA 13.0; "
        "Python 3.12.3, torch 1.0, transformers 1.0, peft 1.0, accelerate 1.0, bitsandbytes 1.0, trl 1.0, "
        "datasets 1.0."]
    assert "| versions | passed | 10 | ok |" in lines
    assert "## Benchmarks: rows of 2,048 tokens, 2 rows (DPO: pairs) a step, 4 steps" in lines
    assert "| qwen3-1.7b | sft ours | 4,096 | 20,480 | 5.12 | 0.200 | 11.9300 | ok |" in lines
    assert "| qwen3-8b | dpo TRL |  |  |  |  |  | skipped: the check's time budget was spent |" in lines
    assert lines[-1] == "qwen3-1.7b sft: ours 2.00x TRL's tokens/s, peak memory 50% of TRL's"


def test_junit_outcomes_and_summary_lines(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.train.test_gpu" name="test_a"/>'
                   '<testcase classname="tests.train.test_gpu" name="test_b"><skipped message="needs a CUDA GPU"/>'
                   '</testcase><testcase classname="tests.x" name="test_c"><failure message="boom"/></testcase>'
                   '</testsuite></testsuites>')
    assert check.junit_cases(xml) == [
        {"name": "test_gpu::test_a", "outcome": "passed", "reason": ""},
        {"name": "test_gpu::test_b", "outcome": "skipped", "reason": "needs a CUDA GPU"},
        {"name": "x::test_c", "outcome": "failed", "reason": "boom"}]
    output = "noise\nruntime    CUDA: compute dtype torch.bfloat16, optimizer paged_adamw_8bit\n" \
             "12:00:01 INFO qlora_train: loss: fused LM head + cross-entropy over trained tokens only, 1024\n"
    assert check.summary_line(output, "runtime ") == check.CUDA_RUNTIME
    assert check.summary_line(output, "loss: ").startswith(check.FUSED_LOSS)
    assert check.summary_line(output, "method ") is None


def test_unknown_steps_and_a_missing_results_folder_are_refused(capsys):
    with pytest.raises(SystemExit):
        check.main(["out", "--only", "bench,demo"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "--only: unknown step 'demo' (steps: versions, tests, demos, bench)")
    with pytest.raises(SystemExit):
        check.main([])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "give the folder the results go to: scripts/gpu_check.sh [--rehearse] RESULTS_DIR")


@pytest.mark.slow
def test_the_shapes_have_the_published_sizes():
    """Each shape's parameters, counted on the meta device (a tied head once), are its model card's: Qwen3-1.7B
    1.7B (1.4B without the embedding), Qwen3-8B 8.2B (6.95B without the embedding), Qwen2.5-VL-3B 3.75B."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM

    counts = {}
    for name in shapes.SHAPES:
        config = shapes.shape_config(name, tiny=False)
        with torch.device("meta"):
            model = (Qwen3ForCausalLM if name.startswith("qwen3") else Qwen2_5_VLForConditionalGeneration)(config)
        total = sum(p.numel() for p in model.parameters())
        counts[name] = (round(total / 1e9, 2), round((total - model.get_input_embeddings().weight.numel()) / 1e9, 2))
    assert counts == {"qwen3-1.7b": (1.72, 1.41), "qwen3-8b": (8.19, 7.57), "qwen2.5-vl-3b": (3.75, 3.44)}
    assert shapes.shape_config("qwen3-8b", tiny=False).tie_word_embeddings is False
    tiny = shapes.shape_config("qwen2.5-vl-3b", tiny=True)
    assert tiny.text_config.hidden_size == tiny.vision_config.out_hidden_size == 64
    assert tiny.text_config.vocab_size == 151936


def test_the_plan_groups_and_the_comparisons():
    assert [[r.shape for r in g] for g in shapes.groups(shapes.PLAN, tiny=True)] == [
        ["qwen3-1.7b"] * 6 + ["qwen3-8b"] * 4 + ["qwen2.5-vl-3b"]]
    assert shapes.groups(shapes.PLAN, tiny=False) == [[r] for r in shapes.PLAN]
    runs = [{"shape": "s", "label": "dpo ours", "status": "ok", "tokens_per_s": 300.0, "peak_gib": None},
            {"shape": "s", "label": "dpo TRL", "status": "ok", "tokens_per_s": 200.0, "peak_gib": None},
            {"shape": "s", "label": "sft ours", "status": "failed", "error": "x"}]
    assert shapes.comparisons(runs) == ["s dpo: ours 1.50x TRL's tokens/s"]
    assert doctest.testmod(shapes).failed == 0


def test_the_memory_table_in_the_docs_is_the_computed_one():
    memory = load(REPO / "benchmarks" / "fsdp_memory.py")
    assert memory.one_gpu_table(2048, 16) in (REPO / "docs" / "gpu.md").read_text()


def test_runs_past_the_budget_are_skipped_and_say_so(tmp_path):
    import time

    results = shapes.measure(shapes.PLAN[:2], tmp_path, tiny=False, sizes=shapes.GPU_SIZES,
                             deadline=time.monotonic() - 1)
    assert [(r["label"], r["status"], r["error"]) for r in results] == [
        ("sft ours", "skipped", "the check's time budget was spent"),
        ("sft TRL", "skipped", "the check's time budget was spent")]
