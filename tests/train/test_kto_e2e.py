"""KTO end to end on the tiny model: the shipped quickstart through the CLI (first loss 0.5: the policy is the
reference) and from its ``--preprocess``ed rows, and a run killed after a checkpoint that resumes to the
uninterrupted run's adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.train.run import train
from tests.train.test_train_e2e import CountSteps, CrashAt, assert_losses_continue

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "quickstart-kto.yaml"


def test_the_shipped_kto_quickstart_trains_through_the_cli_and_from_preprocessed_rows(tmp_path, tiny_model_dir,
                                                                                       monkeypatch, capsys):
    """From a fresh adapter (instead of the SFT demo's): the first loss is 0.5 (r = z = 0 for every row), the KL
    estimate and the rewards are logged, evaluation runs, every bundled row is kept, the adapter is written; and
    ``--preprocess`` then ``data.prepared_path`` trains the same run."""
    monkeypatch.chdir(REPO / "configs")  # its data path is relative to it
    prepared = tmp_path / "prepared"
    common = ["--config", str(CONFIG), "--set", f"model.name_or_path={tiny_model_dir}",
              "--set", "model.adapter_path=null", "--set", "train.max_steps=2", "--set", "train.save_steps=2",
              "--set", "train.eval_steps=2", "--set", "train.logging_steps=1"]
    assert main([*common, "--set", f"train.output_dir={tmp_path / 'raw'}"]) == 0
    assert "labels (kept): 18 desirable, 18 undesirable" in capsys.readouterr().out
    assert main([*common, "--set", f"train.output_dir={tmp_path / 'p'}", "--preprocess", "--preprocess-dir",
                 str(prepared)]) == 0
    assert main([*common, "--set", f"train.output_dir={tmp_path / 'prep'}", "--set",
                 f"data.prepared_path={prepared}"]) == 0
    out = tmp_path / "raw"
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    first = next(h for h in history if "loss" in h)
    assert first["loss"] == pytest.approx(0.5, abs=1e-4)
    assert first["kl"] == 0.0 and first["rewards/chosen"] == pytest.approx(0.0, abs=1e-4)
    assert any("eval_kl" in h for h in history)
    report = json.loads((out / "dataset_report.json").read_text())
    assert (report["rows_in"], report["rows_kept"], report["desirable_rows"]) == (36, 36, 18)
    assert (out / "adapter_model.safetensors").is_file()
    logs = [{(h["step"], k): h[k] for h in json.loads((tmp_path / run / "trainer_state.json").read_text())[
        "log_history"] for k in ("loss", "eval_loss", "kl") if k in h} for run in ("raw", "prep")]
    assert sorted(logs[0]) == [(1, "kl"), (1, "loss"), (2, "eval_loss"), (2, "kl"), (2, "loss")]
    assert logs[1] == pytest.approx(logs[0], rel=1e-6)


def kto_config(tmp_path, tiny_model_dir, *overrides: str):
    """The shipped KTO quickstart on the tiny model from a fresh adapter, 4 steps, a checkpoint every 2."""
    return load_config(CONFIG, [
        f"model.name_or_path={tiny_model_dir}", "model.adapter_path=null", f"train.output_dir={tmp_path / 'out'}",
        "train.max_steps=4", "train.save_steps=2", "train.eval_steps=100", "data.eval_fraction=0.0",
        "train.logging_steps=1", *overrides])


def test_a_kto_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_adapter(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.chdir(REPO / "configs")
    ref = train(kto_config(tmp_path / "ref", tiny_model_dir))
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(kto_config(tmp_path / "run", tiny_model_dir, "train.resume_from_checkpoint=auto"), callbacks=[CrashAt(3)])
    steps = CountSteps()
    resumed = train(kto_config(tmp_path / "run", tiny_model_dir, "train.resume_from_checkpoint=auto"),
                    callbacks=[steps])
    assert (resumed.state.global_step, steps.count) == (4, 2)  # resumed at step 2, not started again
    assert_losses_continue(ref, resumed, steps=(3, 4))
    a, b = (load_file(tmp_path / run / "out" / "adapter_model.safetensors") for run in ("ref", "run"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
