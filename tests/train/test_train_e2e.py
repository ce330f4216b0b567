"""End to end on CPU: real 4-bit nf4 + LoRA on a tiny random Qwen3 with the real Qwen tokenizer."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import TrainerCallback

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.data import DataConfig, process_rows
from qlora_train.masking.tokenize import IGNORE_INDEX
from qlora_train.train import run
from qlora_train.train.run import train

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "configs" / "data" / "quickstart.jsonl"
pytestmark = pytest.mark.slow


def write_config(tmp_path, model_dir, **train):
    cfg = {
        "model": {"name_or_path": str(model_dir), "chat_template": "qwen3"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        "data": {"datasets": [{"path": str(SAMPLE), "max_samples": 16}], "max_length": 128},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 4, "per_device_train_batch_size": 2,
                  "learning_rate": 5e-3, "save_steps": 2, "logging_steps": 1, "report_to": "none",
                  "lr_scheduler": "constant", "warmup_ratio": 0.0, **train},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Snapshot(TrainerCallback):
    """Copies every parameter at train begin and end."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_train_end(self, args, state, control, model=None, **kw):
        self.after = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_cli_trains_and_writes_outputs(tmp_path, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="qlora_train")
    cfg_path = write_config(tmp_path, tiny_model_dir)
    assert main(["--config", str(cfg_path)]) == 0
    assert any(r.getMessage().startswith("loss: fused LM head") for r in caplog.records)  # the default
    out = tmp_path / "out"
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "chat_template.jinja",
                 "config.yaml", "dataset_report.json", "trainer_state.json", "loss_history.json",
                 "training_complete.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "training_complete.json").read_text())["global_step"] == 4
    assert not (out / ".final.tmp").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    report = json.loads((out / "dataset_report.json").read_text())
    assert report["rows_in"] == 16 == report["rows_kept"] + sum(report["dropped"].values())
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["lora"]["r"] == 4 and saved["model"]["load_in_4bit"] is True
    assert len(json.loads((out / "loss_history.json").read_text())) == 4

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == (REPO / "qlora_train/templates/qwen3.jinja").read_text()
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == prompt["input_ids"].shape[1] + 3


def test_only_lora_changes_and_labels_are_the_dataset_modules(tmp_path, tiny_model_dir):
    cfg = load_config(write_config(tmp_path, tiny_model_dir, max_steps=3))
    snap = Snapshot()
    trainer = train(cfg, callbacks=[snap])
    changed = {n for n in snap.before if not torch.equal(snap.before[n], snap.after[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in snap.before if "lora_B" in n} <= changed  # every adapter learned something
    # 4-bit base: the quantised linear weights are bitsandbytes Params4bit
    assert any(type(p).__name__ == "Params4bit" for p in trainer.model.parameters())

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:16]]
    expected = process_rows(rows, trainer.processing_class, DataConfig(max_length=128))
    expected_by_ids = {tuple(i): lab for i, lab in zip(expected["input_ids"], expected["labels"])}
    seen = 0
    for batch in trainer.get_train_dataloader():
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            n = int(mask.sum())
            assert labels[n:].eq(IGNORE_INDEX).all()
            assert labels[:n].tolist() == expected_by_ids[tuple(ids[:n].tolist())]
            seen += 1
    assert seen == 16
    assert json.loads((Path(cfg.train.output_dir) / "dataset_report.json").read_text())["packing"] == {}


class CrashAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise RuntimeError("simulated crash")


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir):
    """An uninterrupted 6-step run that the resumed runs are compared with."""
    return train(load_config(write_config(tmp_path_factory.mktemp("ref"), tiny_model_dir, max_steps=6)))


def test_a_killed_run_resumes_with_the_same_command_and_a_finished_one_is_refused(tmp_path, tiny_model_dir,
                                                                                 reference_run, monkeypatch, capsys,
                                                                                 caplog):
    """No resume key (the default): killed in step 3 after its step-2 checkpoint, with a checkpoint-4 cut short
    (no trainer_state.json, as a kill while saving leaves it), the same command again resumes at step 2, says so in
    one line, trains 4 steps and logs the uninterrupted run's losses. Then the same command is refused (a finished
    run), and --overwrite trains again from step 0. Another config's checkpoints are refused too."""
    caplog.set_level(logging.INFO, logger="qlora_train")
    cfg_path, out = str(write_config(tmp_path, tiny_model_dir, max_steps=6)), tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(load_config(cfg_path), callbacks=[CrashAt(3)])
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-4", ignore=shutil.ignore_patterns("trainer_state.json"))
    capsys.readouterr()
    assert main(["--config", cfg_path, "--set", "train.learning_rate=0.001"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {out} holds checkpoints (up to checkpoint-2) of another config (train.learning_rate: 0.005 there, "
        "0.001 now): train into another train.output_dir, run that config to resume them, or add --overwrite to "
        "start over (removes them)"]

    steps, real_train = CountSteps(), run.train
    monkeypatch.setattr(run, "train", lambda cfg, **kw: real_train(cfg, callbacks=[steps], **kw))
    assert main(["--config", cfg_path]) == 0  # the same command
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming from")]
    fingerprint = json.loads((out / "run_fingerprint.json").read_text())["fingerprint"]
    assert said == [f"resuming from checkpoint-2 (step 2) in {out}: the same config as its checkpoints "
                    f"(fingerprint {fingerprint[:12]})"]
    assert steps.count == 4  # steps 3 to 6, not started over
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    resumed = {h["step"]: h["loss"] for h in history if "loss" in h}
    assert resumed == pytest.approx(losses(reference_run), rel=1e-3)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()  # the cut-short one was removed, then saved

    capsys.readouterr()
    assert main(["--config", cfg_path]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {out} holds a finished run (step 6): train into another train.output_dir, or add --overwrite to "
        "train again from step 0 (removes its checkpoints and adapter)"]
    assert main(["--config", cfg_path, "--overwrite", "--set", "train.max_steps=2"]) == 0
    assert steps.count == 4 + 2
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.loads((out / "training_complete.json").read_text())["global_step"] == 2


def test_a_checkpoint_file_planted_with_a_pickle_is_refused_in_one_line_and_never_run(tmp_path, tiny_model_dir,
                                                                                     capsys):
    """A killed run's checkpoint whose rng_state.pth was replaced by a pickle that would run a command: the same
    command again stops in one line (exit 2) naming the file, without torch's advice to load it unsafely."""
    import pickle

    from tests.train.test_resume import Planted

    cfg_path, out, flag = str(write_config(tmp_path, tiny_model_dir, max_steps=4)), tmp_path / "out", tmp_path / "ran"
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(load_config(cfg_path), callbacks=[CrashAt(3)])
    planted = out / "checkpoint-2" / "rng_state.pth"
    planted.write_bytes(pickle.dumps(Planted(flag), protocol=2))
    capsys.readouterr()
    assert main(["--config", cfg_path]) == 2
    err = capsys.readouterr().err  # (the model's loading and the trainer's progress bars before it)
    assert "Traceback" not in err and "weights_only" not in err and err.count("error:") == 1
    assert err.endswith(f"error: resuming from {out / 'checkpoint-2'}: {planted} is not a tensor file (Trying to "
                        "load unsupported GLOBAL posix.system whose module posix is blocked): it was refused unread "
                        "(checkpoints are read as tensors only, never as code); remove it, or use another "
                        "checkpoint\n")
    assert not flag.exists()


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def assert_losses_continue(ref, resumed, steps):
    """The resumed run's loss curve continues the uninterrupted one with the same seed."""
    ref_loss, new_loss = losses(ref), losses(resumed)
    for step in steps:
        assert new_loss[step] == pytest.approx(ref_loss[step], rel=1e-3), step


# Runs the CLI in a child process; says when a checkpoint is saved and pauses after step 3, so that a
# SIGTERM sent on "saved 2" lands during step 3.
CHILD = """
import sys, time
from transformers import TrainerCallback
import qlora_train.train.run as run
from qlora_train.cli import main

class Pace(TrainerCallback):
    def on_save(self, args, state, control, **kw):
        print(f"saved {state.global_step}", flush=True)
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 3:
            time.sleep(3)

real_train = run.train
run.train = lambda cfg, **kw: real_train(cfg, callbacks=[Pace()], **kw)
sys.exit(main(["--config", sys.argv[1]]))
"""


def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path, tiny_model_dir, reference_run):
    ref = reference_run
    cfg_path = write_config(tmp_path / "run", tiny_model_dir, max_steps=6, resume_from_checkpoint="auto")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stderr.txt", "w") as err:  # a file: a full stderr pipe could block the child
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(cfg_path)], cwd=REPO, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=err)
        for line in child.stdout:
            if line.strip() == "saved 2":
                child.send_signal(signal.SIGTERM)
                break
        stdout, _ = child.communicate(timeout=300)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert child.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    out = tmp_path / "run" / "out"
    assert ("interrupted: stopped by SIGTERM at step 3; checkpoint saved to "
            f"{out / 'checkpoint-3'}; run the same command again to continue") in stderr
    assert "Traceback" not in stderr and "saved 3" in stdout
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not (out / "training_complete.json").exists() and not (out / "adapter_model.safetensors").exists()

    resumed = train(load_config(cfg_path))  # resume_from_checkpoint: auto -> checkpoint-3
    assert resumed.state.global_step == 6 and (out / "training_complete.json").is_file()
    assert_losses_continue(ref, resumed, steps=(4, 5, 6))


def test_a_one_row_dataset_trains_without_eval_saying_each_thing_once(tmp_path, tiny_model_dir, caplog, capsys):
    """data.eval_fraction on one row: no eval split, said in one line, and the run trains without evaluation (no
    transformers traceback); the CPU runtime is said once (in the summary); a run whose rows are all dropped stops
    before it says where it starts."""
    caplog.set_level(logging.INFO, logger="qlora_train")
    cfg = yaml.safe_load(write_config(tmp_path, tiny_model_dir, max_steps=1, save_steps=1).read_text())
    cfg["data"].update(datasets=[{"path": str(SAMPLE), "max_samples": 1}], eval_fraction=0.1)
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "one.yaml")]) == 0
    said = [r.getMessage() for r in caplog.records] + capsys.readouterr().out.splitlines()
    assert [m for m in said if "eval" in m] == [
        "no eval split: data.eval_fraction 0.1 of 1 kept row leaves no row for one side of the split; training "
        "without evaluation", "data       rows in 1, kept 1 (train 1, eval 0)"]
    assert len([m for m in said if "no CUDA device" in m]) == (0 if torch.cuda.is_available() else 1)
    assert json.loads((tmp_path / "out" / "training_complete.json").read_text())["global_step"] == 1

    caplog.clear()
    (tmp_path / "none.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    cfg["data"]["datasets"] = [{"path": str(tmp_path / "none.jsonl")}]
    cfg["train"]["output_dir"] = str(tmp_path / "none")
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "none.yaml")]) == 1
    assert "\nerror: all 1 rows were dropped (no_assistant_turn: 1)" in capsys.readouterr().err
    assert not [r for r in caplog.records if "starting at step" in r.getMessage()]


def test_cuda_oom_in_training_exits_3_with_advice(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from transformers import Trainer

    def oom(self, *a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(Trainer, "train", oom)
    assert main(["--config", str(write_config(tmp_path, tiny_model_dir))]) == 3
    err = capsys.readouterr().err
    assert "error: CUDA ran out of memory. Try, in this order:\n  - lower data.max_length (now 128)" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "training_complete.json").exists()


def test_two_processes_with_torchrun(tmp_path, tiny_model_dir):
    cfg_path = write_config(tmp_path, tiny_model_dir, max_steps=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29531",
         "-m", "qlora_train.cli", "--config", str(cfg_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    # two ranks each saw half of each global batch: 2 steps x 2 ranks x 2 rows = 8 of 16 rows = epoch 0.5
    assert state["epoch"] == pytest.approx(0.5)
    assert proc.stdout.count("trainable") == 1  # the summary is printed by rank 0 only


def test_packing_trains_on_the_dataset_modules_segments(tmp_path, tiny_model_dir, capsys):
    cfg = load_config(write_config(tmp_path, tiny_model_dir, max_steps=2, packing=True, packing_length=256))
    trainer = train(cfg)
    assert trainer.state.global_step == 2
    summary = capsys.readouterr().out
    assert "packing 16 examples into " in summary and "sequences of <= 256 tokens" in summary

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:16]]
    expected = process_rows(rows, trainer.processing_class, DataConfig(max_length=128))
    expected_by_ids = {tuple(i): [IGNORE_INDEX] + lab[1:] for i, lab in zip(expected["input_ids"], expected["labels"])}
    seen = 0
    for batch in trainer.get_train_dataloader():
        assert batch["attention_mask"].dim() == 4 and batch["attention_mask"].dtype == torch.bool  # SDPA
        for ids, labels, pos in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
            starts = (pos == 0).nonzero().flatten().tolist()
            for a, b in zip(starts, starts[1:] + [len(pos)]):
                key = tuple(ids[a:b].tolist())
                if key in expected_by_ids:  # a real example (not padding)
                    assert labels[a:b].tolist() == expected_by_ids[key]
                    seen += 1
    assert seen == 16
    packing = json.loads((Path(cfg.train.output_dir) / "dataset_report.json").read_text())["packing"]
    assert packing["examples"] == 16 and packing["capacity"] == 256
    assert packing["tokens"] == sum(len(i) for i in expected["input_ids"])
    assert packing["efficiency"] == packing["tokens"] / (packing["sequences"] * 256)


def test_fused_loss_gives_the_models_own_losses_in_a_qlora_run(tmp_path, tiny_model_dir, caplog):
    """4-bit nf4 + LoRA through train(), with gradient accumulation and eval: the fused loss (the default)
    logs the losses and eval loss of the model's own loss."""
    caplog.set_level(logging.INFO, logger="qlora_train")
    runs = {}
    for fused in (True, False):
        cfg = load_config(write_config(tmp_path / f"fused-{fused}", tiny_model_dir, max_steps=2, save_steps=2,
                                       gradient_accumulation_steps=2, fused_loss=fused))
        cfg.data.eval_fraction = 0.25
        runs[fused] = train(cfg).state.log_history
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loss: ")]
    assert lines == ["loss: fused LM head + cross-entropy over trained tokens only, 1024 per chunk (train.fused_loss)",
                     "loss: the model's own, over all logits (fused loss off: train.fused_loss: false)"]
    for key in ("loss", "eval_loss"):
        fused_log, own_log = ({h["step"]: h[key] for h in runs[f] if key in h} for f in (True, False))
        assert fused_log.keys() == own_log.keys() == ({1, 2} if key == "loss" else {2})
        for step, loss in own_log.items():
            assert fused_log[step] == pytest.approx(loss, rel=1e-5), (key, step)


def test_training_from_a_prepared_directory_gives_the_raw_files_run(tmp_path, tiny_model_dir, capsys):
    """--preprocess (tokenizer only), the raw file removed, then training through the CLI from data.prepared_path
    (packing and an eval split): the same report and the same train and eval losses as training from the file."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(SAMPLE.read_text().splitlines(keepends=True)[:20]))
    cfg_path = write_config(tmp_path, tiny_model_dir, max_steps=3, save_steps=3, packing=True, packing_length=256)
    tree = yaml.safe_load(cfg_path.read_text())
    tree["data"].update({"datasets": [{"path": str(data)}], "eval_fraction": 0.2})
    cfg_path.write_text(yaml.safe_dump(tree))

    raw_out, prepared = tmp_path / "raw", tmp_path / "prepared"
    assert main(["--config", str(cfg_path), "--set", f"train.output_dir={raw_out}"]) == 0
    assert main(["--config", str(cfg_path), "--preprocess", "--preprocess-dir", str(prepared)]) == 0
    assert "prepared data written to" in capsys.readouterr().out
    data.unlink()
    out = tmp_path / "from-prepared"
    assert main(["--config", str(cfg_path), "--set", f"data.prepared_path={prepared}",
                 "--set", f"train.output_dir={out}"]) == 0
    assert "packing 16 examples into " in capsys.readouterr().out  # the summary, from the saved report

    read = lambda d, name: json.loads((d / name).read_text())
    assert read(out, "dataset_report.json") == read(raw_out, "dataset_report.json") == read(
        prepared, "dataset_report.json")
    assert read(out, "training_complete.json")["global_step"] == 3
    logs = [{(h["step"], k): h[k] for h in read(d, "trainer_state.json")["log_history"] for k in ("loss", "eval_loss")
             if k in h} for d in (raw_out, out)]
    assert sorted(logs[0]) == [(1, "loss"), (2, "loss"), (3, "eval_loss"), (3, "loss")]
    assert logs[1] == pytest.approx(logs[0], rel=1e-6)


def test_the_shipped_dpo_quickstart_trains_through_the_cli(tmp_path, tiny_model_dir, monkeypatch):
    """configs/quickstart-dpo.yaml on the bundled pairs (a fresh adapter here, instead of the SFT demo's): the first
    DPO loss is log 2 (policy == reference), reward accuracy is logged, the adapter is written."""
    monkeypatch.chdir(REPO / "configs")  # its data path is relative to it
    out = tmp_path / "dpo"
    assert main(["--config", str(REPO / "configs/quickstart-dpo.yaml"), "--set", f"model.name_or_path={tiny_model_dir}",
                 "--set", "model.adapter_path=null", "--set", f"train.output_dir={out}", "--set", "train.max_steps=4",
                 "--set", "train.eval_steps=4", "--set", "train.save_steps=4"]) == 0
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    first = next(h for h in history if "loss" in h)
    assert first["loss"] == pytest.approx(0.693147, abs=1e-4)
    assert "rewards/accuracies" in first and any("eval_rewards/accuracies" in h for h in history)
    assert (out / "adapter_model.safetensors").is_file()


class CountSteps(TrainerCallback):
    count = 0

    def on_step_end(self, args, state, control, **kw):
        self.count += 1


def dpo_config(tmp_path, tiny_model_dir, *overrides: str):
    """The shipped DPO quickstart on the tiny model from a fresh adapter, 6 steps, a checkpoint every 2."""
    return load_config(REPO / "configs/quickstart-dpo.yaml", [
        f"model.name_or_path={tiny_model_dir}", "model.adapter_path=null", f"train.output_dir={tmp_path / 'out'}",
        "train.max_steps=6", "train.save_steps=2", "train.eval_steps=100", "data.eval_fraction=0.0", *overrides])


def test_a_dpo_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_adapter(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.chdir(REPO / "configs")
    ref = train(dpo_config(tmp_path / "ref", tiny_model_dir))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(dpo_config(tmp_path / "run", tiny_model_dir, "train.resume_from_checkpoint=auto"), callbacks=[CrashAt(3)])
    assert sorted(p.name for p in (tmp_path / "run" / "out").glob("checkpoint-*")) == ["checkpoint-2"]
    steps = CountSteps()
    resumed = train(dpo_config(tmp_path / "run", tiny_model_dir, "train.resume_from_checkpoint=auto"),
                    callbacks=[steps])
    assert (resumed.state.global_step, steps.count) == (6, 4)  # resumed at step 2, not started again
    assert_losses_continue(ref, resumed, steps=(3, 4, 5, 6))
    a, b = (load_file(tmp_path / run / "out" / "adapter_model.safetensors") for run in ("ref", "run"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("method", "port"), [("dpo", 29533), ("orpo", 29534)])
def test_preference_on_two_processes_equals_one_process_with_their_global_batch(tmp_path, tiny_model_dir, method,
                                                                                port):
    """torchrun, 2 ranks x 1 pair (gloo, float32 on CPU) vs 1 process x 2 pairs: the policy pass goes through the
    DDP model, so the ranks' gradients are averaged (and ORPO's NLL divides by the ranks' mean chosen-token count),
    and the runs are the same run: the same losses and metrics at every step and the same adapter, also across the
    epoch's ragged last step, where rank 1's pair is blank (the loss divides by the ranks' mean count of real
    pairs)."""
    from safetensors.torch import load_file

    # run in configs/ (the config's data path is relative to it), importing this checkout
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    common = [str(REPO / "configs/quickstart-dpo.yaml"), "--set", f"model.name_or_path={tiny_model_dir}",
              "--set", "model.adapter_path=null", "--set", "train.max_steps=11", "--set", "train.save_steps=11",
              "--set", "train.eval_steps=11",
              "--set", "data.eval_fraction=0.15",  # 4 held-out pairs: 2 per rank
              # 19 of the other 20: 9 steps of 2 pairs, a 10th of 1 (rank 1's pair blank), one into the next epoch
              "--set", "data.max_samples=19",
              "--set", f"train.method={method}"]
    runs = {"one": ([sys.executable, "-m", "qlora_train.cli"], 2),
            "two": ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                     "-m", "qlora_train.cli"], 1)}
    procs = {name: subprocess.Popen(
        [*launch, "--config", *common, "--set", f"train.output_dir={tmp_path / name}",
         "--set", f"train.per_device_train_batch_size={batch}"],
        cwd=REPO / "configs", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (launch, batch) in runs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
    history = {name: json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
               for name in runs}
    one, two = ({(h["step"], k): v for h in history[name] for k, v in h.items() if isinstance(v, float)
                 and k not in ("epoch", "total_flos") and not k.endswith(("runtime", "per_second"))}
                for name in runs)
    assert one.keys() == two.keys()
    assert {k for k in one if k[1] == "loss"} == {(s, "loss") for s in range(1, 12)}
    for key in one:  # rewards and log odds: differences of summed log-probs of ~ -500, which float32 holds to ~1e-5
        near_zero = "rewards/" in key[1] or "log_odds" in key[1]
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=3e-5 if near_zero else 1e-7), key
    a, b = (load_file(tmp_path / name / "adapter_model.safetensors") for name in runs)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5)
