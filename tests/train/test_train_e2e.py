"""End to end on CPU: real 4-bit nf4 + LoRA on a tiny random Qwen3 with the real Qwen tokenizer."""

from __future__ import annotations

import json
import os
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
from qlora_train.data.tokenize import IGNORE_INDEX
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


def test_cli_trains_and_writes_outputs(tmp_path, tiny_model_dir):
    cfg_path = write_config(tmp_path, tiny_model_dir)
    assert main(["--config", str(cfg_path)]) == 0
    out = tmp_path / "out"
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "chat_template.jinja",
                 "config.yaml", "dataset_report.json", "trainer_state.json", "loss_history.json"):
        assert (out / name).is_file(), name
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
    assert tok.chat_template == (REPO / "qlora_train/data/templates/qwen3.jinja").read_text()
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


class CrashAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_resume_auto_continues_from_last_checkpoint(tmp_path, tiny_model_dir):
    ref = train(load_config(write_config(tmp_path / "ref", tiny_model_dir, max_steps=6)))
    cfg_path = write_config(tmp_path / "run", tiny_model_dir, max_steps=6, resume_from_checkpoint="auto")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(load_config(cfg_path), callbacks=[CrashAt(3)])
    out = tmp_path / "run" / "out"
    assert (out / "checkpoint-2").is_dir() and not (out / "adapter_model.safetensors").exists()
    resumed = train(load_config(cfg_path))
    assert resumed.state.global_step == 6
    ref_loss = {h["step"]: h["loss"] for h in ref.state.log_history if "loss" in h}
    new_loss = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    for step in (3, 4, 5, 6):  # the resumed curve continues the uninterrupted one
        assert new_loss[step] == pytest.approx(ref_loss[step], rel=1e-3), step


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
