"""What a run does with its output directory: resume its own checkpoints, start, or refuse (train/resume.py).

The decision is pure (a directory's state and a fingerprint in, a decision out); ``read_output_dir`` and the
fingerprint are checked on small hand-made directories and configs. The end-to-end run (killed, run again with the
same command) is in test_train_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qlora_train.cli import main
from qlora_train.config import Config
from qlora_train.train.resume import (
    FINGERPRINT_FILE,
    Decision,
    OutputDirState,
    decide,
    last_checkpoint,
    prepare_output_dir,
    read_output_dir,
    run_fingerprint,
)

REPO = Path(__file__).resolve().parents[2]
OUT = "runs/a"
NOW = {"format": 1, "fingerprint": "f" * 32, "config": {"train": {"learning_rate": 0.001, "max_steps": 6}}}
OTHER = {"format": 1, "fingerprint": "0" * 32, "config": {"train": {"learning_rate": 0.0002, "max_steps": 6}}}
REFUSE_FINISHED = (f"{OUT} holds a finished run (step 6): train into another train.output_dir, or add --overwrite "
                   "to train again from step 0 (removes its checkpoints and adapter)")


def state(**kw) -> OutputDirState:
    return OutputDirState(OUT, **kw)


def auto(s: OutputDirState, *, overwrite: bool = False, now: dict = NOW) -> Decision:
    return decide(s, now, resume="auto", overwrite=overwrite)


# --- the decision: one case each ---


def test_nothing_to_resume_starts():
    assert auto(state()) == Decision("start", "starting at step 0")
    # a run stopped before its first checkpoint (another config's fingerprint, nothing lost): starts too
    assert auto(state(saved=OTHER)) == Decision("start", "starting at step 0")


def test_checkpoints_of_the_same_config_resume_from_the_newest_complete_one():
    got = auto(state(checkpoints=(2, 4), incomplete=("checkpoint-1", "checkpoint-6"), saved=NOW))
    assert got == Decision("resume", f"resuming from checkpoint-4 (step 4) in {OUT}: the same config as its "
                           "checkpoints (fingerprint ffffffffffff)", f"{OUT}/checkpoint-4",
                           remove=("checkpoint-6",))  # cut short after the one resumed: its step is saved again


def test_only_checkpoints_cut_short_start_and_are_removed():
    assert auto(state(incomplete=("checkpoint-2",), saved=NOW)) == Decision(
        "start", "starting at step 0 (checkpoint-2 cut short, removed)", remove=("checkpoint-2",))


def test_a_finished_run_is_refused_whatever_its_config():
    for saved in (NOW, OTHER, None):
        assert auto(state(checkpoints=(2, 4, 6), finished_step=6, adapter=True, saved=saved)) == Decision(
            "refuse", REFUSE_FINISHED)
    # a final adapter with no checkpoint beside it (published, the marker not yet written; an older run)
    assert auto(state(adapter=True, saved=NOW)).line == REFUSE_FINISHED.replace(" (step 6)", "")


def test_an_earlier_runs_adapter_beside_checkpoints_is_not_a_finished_run():
    """A later run into a finished directory (resumed from a named checkpoint) started and was killed: its own
    checkpoints are resumed."""
    assert auto(state(checkpoints=(2,), adapter=True, saved=NOW)).checkpoint == f"{OUT}/checkpoint-2"


def test_another_configs_checkpoints_are_refused_naming_the_difference():
    assert auto(state(checkpoints=(2, 4), saved=OTHER)) == Decision(
        "refuse", f"{OUT} holds checkpoints (up to checkpoint-4) of another config (train.learning_rate: 0.0002 "
        "there, 0.001 now): train into another train.output_dir, run that config to resume them, or add "
        "--overwrite to start over (removes them)")
    two = {**OTHER, "config": {"train": {"learning_rate": 0.0002, "max_steps": 8}}}
    assert "(train.learning_rate: 0.0002 there, 0.001 now; 1 more)" in auto(state(checkpoints=(2,), saved=two)).line
    assert "another config (its fingerprint differs)" in auto(state(checkpoints=(2,), saved={"x": 1})).line


def test_checkpoints_without_a_recorded_config_are_refused():
    assert auto(state(checkpoints=(2, 4))) == Decision(
        "refuse", f"{OUT} holds checkpoints (up to checkpoint-4) of a run whose config was not recorded (no "
        f"{FINGERPRINT_FILE}): resume one with train.resume_from_checkpoint: {OUT}/checkpoint-4, or add "
        "--overwrite to start over (removes them)")


def test_overwrite_starts_after_removing_what_is_there():
    finished = state(checkpoints=(2, 4), incomplete=("checkpoint-6",), finished_step=6, adapter=True, saved=NOW)
    assert auto(finished, overwrite=True) == Decision(
        "start", f"--overwrite: removing a finished run and checkpoint-2, checkpoint-4, checkpoint-6 in {OUT}; "
        "starting at step 0", clear=True)
    assert auto(state(checkpoints=(2,), saved=OTHER), overwrite=True).action == "start"
    assert auto(state(), overwrite=True) == Decision("start", "starting at step 0", clear=True)


def test_a_named_checkpoint_is_resumed_as_asked():
    """No check: the way to continue with a changed config (more max_steps) or from another directory."""
    named = "elsewhere/checkpoint-30"
    for s in (state(), state(checkpoints=(2,), saved=OTHER), state(finished_step=6, adapter=True)):
        assert decide(s, NOW, resume=named, overwrite=False) == Decision(
            "resume", f"resuming from {named} (train.resume_from_checkpoint)", named)
    assert decide(state(finished_step=6), NOW, resume=named, overwrite=True).clear
    inside = f"{OUT}/checkpoint-2"
    assert decide(state(checkpoints=(2,)), NOW, resume=inside, overwrite=True) == Decision(
        "refuse", f"--overwrite would remove {inside}, the checkpoint train.resume_from_checkpoint names: drop one "
        "of the two")


# --- reading the directory, acting on it ---


def write_checkpoint(out, step, state_text: str | None = "{}"):
    (out / f"checkpoint-{step}").mkdir(parents=True)
    (out / f"checkpoint-{step}" / "adapter_model.safetensors").write_text("w")
    if state_text is not None:
        (out / f"checkpoint-{step}" / "trainer_state.json").write_text(state_text)


def test_read_output_dir_skips_checkpoints_cut_short(tmp_path, caplog):
    out = tmp_path / "out"
    for step, text in ((2, "{}"), (10, "{}"), (12, '{"global_st'), (14, None)):  # 12: truncated, 14: none yet
        write_checkpoint(out, step, text)
    (out / "checkpoint-x").mkdir()
    (out / "stats.json").write_text("{}")  # --stats-only's: not a run
    (out / FINGERPRINT_FILE).write_text(json.dumps(NOW))
    assert read_output_dir(out) == OutputDirState(str(out), (2, 10), ("checkpoint-12", "checkpoint-14"), saved=NOW)
    assert last_checkpoint(out) == str(out / "checkpoint-10")
    assert sum("skipping incomplete checkpoint" in r.getMessage() for r in caplog.records) == 2
    assert read_output_dir(tmp_path / "none") == OutputDirState(str(tmp_path / "none"))
    assert last_checkpoint(tmp_path / "none") is None

    (out / "training_complete.json").write_text(json.dumps({"global_step": 10}))
    (out / "adapter_config.json").write_text("{}")
    (out / FINGERPRINT_FILE).write_text('{"fingerpr')  # unreadable: no recorded config
    got = read_output_dir(out)
    assert (got.finished_step, got.adapter, got.saved, got.finished) == (10, True, None, True)


def test_prepare_output_dir_removes_the_run_and_records_the_fingerprint(tmp_path):
    out = tmp_path / "out"
    for step in (2, 4):
        write_checkpoint(out, step)
    write_checkpoint(out, 6, None)
    for name in ("training_complete.json", "adapter_config.json", "adapter_model.safetensors", "loss_history.json",
                 "trainer_state.json", "stats.json", "tokenizer.json"):
        (out / name).write_text("{}")
    (out / "prepared").mkdir()  # --preprocess's default place: kept, a run may be reading it
    prepare_output_dir(decide(read_output_dir(out), NOW, resume="auto", overwrite=True), NOW, out)
    assert sorted(p.name for p in out.iterdir()) == ["prepared", FINGERPRINT_FILE, "stats.json", "tokenizer.json"]
    assert json.loads((out / FINGERPRINT_FILE).read_text()) == NOW

    write_checkpoint(out, 2)
    write_checkpoint(out, 4, None)
    (out / "training_complete.json").write_text("{}")
    prepare_output_dir(Decision("resume", "", str(out / "checkpoint-2"), remove=("checkpoint-4",)), NOW, out)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "training_complete.json").exists()


# --- the fingerprint ---


def config(data_path: str, **train) -> Config:
    return Config(model={"name_or_path": "org/m"}, data={"datasets": [{"path": data_path}], "max_length": 64},
                  train={"output_dir": "outputs/a", **train})


@pytest.mark.parametrize("change", [
    {"output_dir": "outputs/b"}, {"logging_steps": 1}, {"save_steps": 7}, {"save_total_limit": 1},
    {"eval_steps": 3}, {"report_to": "wandb"}, {"resume_from_checkpoint": "outputs/a/checkpoint-2"},
    {"gradient_checkpointing": False}, {"fused_loss": False}, {"dataloader_num_workers": 2},
])
def test_what_does_not_change_the_trained_weights_keeps_the_fingerprint(tmp_path, monkeypatch, change):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("")
    base = run_fingerprint(config("d.jsonl"))
    assert run_fingerprint(config(str(tmp_path / "d.jsonl"), **change)) == base  # an absolute path is the same
    assert base["config"]["data"]["datasets"][0]["path"] == "d.jsonl"


@pytest.mark.parametrize("change", [
    {"learning_rate": 1e-3}, {"max_steps": 8}, {"seed": 1}, {"per_device_train_batch_size": 2},
    {"gradient_accumulation_steps": 2}, {"method": "orpo"},
])
def test_what_changes_the_run_changes_the_fingerprint(change):
    assert run_fingerprint(config("d.jsonl", **change))["fingerprint"] != run_fingerprint(config("d.jsonl"))[
        "fingerprint"]


def test_model_lora_and_data_keys_are_in_the_fingerprint():
    base = config("d.jsonl")
    for section, change in (("model", {"chat_template": "chatml"}), ("lora", {"r": 8}), ("data", {"max_length": 32})):
        other = base.model_copy(update={section: getattr(base, section).model_copy(update=change)})
        assert run_fingerprint(other)["fingerprint"] != run_fingerprint(base)["fingerprint"], section
    other = base.model_copy(update={"data": base.data.model_copy(update={"num_proc": 4})})
    assert run_fingerprint(other) == run_fingerprint(base)  # how rows are computed, not what they are


def test_grpos_rl_section_is_in_its_fingerprint_and_not_in_other_methods():
    def grpo(**rl) -> Config:
        return Config(model={"name_or_path": "org/m"}, data={"datasets": [{"path": "d.jsonl"}], "max_length": 64},
                      train={"output_dir": "outputs/a", "method": "grpo"},
                      rl={"rewards": [{"function": "a.b:c"}], "max_completion_length": 16, **rl})

    base = run_fingerprint(grpo())
    assert base["config"]["rl"]["num_generations"] == 8
    assert run_fingerprint(grpo(num_generations=4))["fingerprint"] != base["fingerprint"]
    assert "rl" not in run_fingerprint(config("d.jsonl"))["config"]  # SFT's fingerprint as it was


# --- through the CLI: a refusal is one line, exit 2, before anything loads ---


def cli_config(tmp_path, **train) -> str:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps({"model": {"name_or_path": "org/none-such"},  # never fetched: refused before
                                "data": {"datasets": [{"path": str(data)}]},
                                "train": {"output_dir": str(tmp_path / "out"), "report_to": "none", **train}}))
    return str(path)


@pytest.mark.slow  # imports the training stack (torch, transformers) in the test process
def test_the_cli_refuses_a_finished_run_and_another_configs_checkpoints(tmp_path, capsys):
    path, out = cli_config(tmp_path), tmp_path / "out"
    write_checkpoint(out, 2)
    (out / FINGERPRINT_FILE).write_text(json.dumps(run_fingerprint(_load(path))))
    assert main(["--config", path, "--set", "train.learning_rate=0.001"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {out} holds checkpoints (up to checkpoint-2) of another config (train.learning_rate: 0.0002 there, "
        "0.001 now): train into another train.output_dir, run that config to resume them, or add --overwrite to "
        "start over (removes them)"]
    (out / "training_complete.json").write_text(json.dumps({"global_step": 2}))
    assert main(["--config", path]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {out} holds a finished run (step 2): train into another train.output_dir, or add --overwrite to "
        "train again from step 0 (removes its checkpoints and adapter)"]
    # the run found there left as it was (the folder marked ours, and its lock file: a run written before the mark)
    assert sorted(p.name for p in out.iterdir()) == [".qlora-train", ".qlora-train.lock", "checkpoint-2",
                                                     FINGERPRINT_FILE, "training_complete.json"]
    # the diagnostics and --preprocess do not train: a finished run is no reason to refuse them (this tokenizer
    # cannot be loaded: they get that far)
    for flags in (["--stats-only"], ["--preprocess"]):
        assert main(["--config", path, *flags]) == 1
        assert "error: cannot load the tokenizer org/none-such" in capsys.readouterr().err


def _load(path: str) -> Config:
    from qlora_train.config import load_config

    return load_config(path)


@pytest.mark.parametrize("flag", ["--stats-only", "--preprocess", "--merge"])
def test_overwrite_is_for_training_only(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exc:
        main(["--config", cli_config(tmp_path), "--overwrite", flag])
    assert exc.value.code == 2
    assert "--overwrite applies to training only" in capsys.readouterr().err


# --- several processes: every rank takes rank 0's decision ---


AGREE = """
import os, sys
import torch.distributed as dist
from qlora_train.train.resume import Decision, agree

dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2])
seen = Decision("resume", "rank 0's", "out/checkpoint-4") if dist.get_rank() == 0 else Decision("refuse", "rank 1's")
print(repr(agree(seen)), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two processes that import torch
def test_every_rank_takes_rank_0s_decision(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, "-c", AGREE, str(rank), "29561"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    outs = [rank.communicate(timeout=120) for rank in ranks]
    assert [r.returncode for r in ranks] == [0, 0], [o[1][-2000:] for o in outs]
    want = repr(Decision("resume", "rank 0's", "out/checkpoint-4"))
    assert [o[0].strip() for o in outs] == [want, want]


# --- a checkpoint file that is not tensors: one line, nothing of it run ---


class Planted:
    """A pickle that would run a command when loaded the unsafe way."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_a_checkpoint_file_that_is_not_tensors_is_one_line_without_torchs_unsafe_hint(tmp_path):
    import pickle

    import torch
    from safetensors.torch import load_file

    from qlora_train.errors import UsageError
    from qlora_train.train.resume import refusing_unsafe_files

    ckpt, flag = tmp_path / "checkpoint-2", tmp_path / "ran"
    ckpt.mkdir()
    (ckpt / "rng_state.pth").write_bytes(pickle.dumps(Planted(flag), protocol=2))  # torch.save's protocol
    (ckpt / "adapter_model.safetensors").write_bytes(b"\x80\x04not tensors")
    with pytest.raises(UsageError) as err, refusing_unsafe_files(ckpt, f"resuming from {ckpt}"):
        torch.load(ckpt / "rng_state.pth", weights_only=True)
    assert str(err.value) == (f"resuming from {ckpt}: {ckpt / 'rng_state.pth'} is not a tensor file (Trying to load "
                              "unsupported GLOBAL posix.system whose module posix is blocked): it was refused unread "
                              "(checkpoints are read as tensors only, never as code); remove it, or use another "
                              "checkpoint")
    assert not flag.exists() and "weights_only" not in str(err.value) and "safe_globals" not in str(err.value)
    with pytest.raises(UsageError) as err, refusing_unsafe_files(ckpt, "--merge"):
        load_file(str(ckpt / "adapter_model.safetensors"))
    assert str(err.value).startswith(f"--merge: {ckpt / 'adapter_model.safetensors'} is not a tensor file "
                                     "(safetensors: Error while deserializing header: ")
    with pytest.raises(ValueError, match="not ours"), refusing_unsafe_files(ckpt, "x"):  # anything else: as it is
        raise ValueError("not ours")
