"""Whose folder ``train.output_dir`` is and which run writes into it (issue 46): a run writes only into a folder
that is missing, empty or ours (its marker), never ``/``, the home folder, the working folder or a folder of its
inputs; one training run at a time (a lock a killed run does not leave stuck); ``--overwrite`` removes only what our
runs wrote and nothing through a link; ``~`` expanded and ``$`` refused in the path."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qlora_train.cli import main
from qlora_train.config import ConfigError, load_config
from qlora_train.output_dir import MARKER_FILE, RunLock, mark, output_dir_problem, run_inputs
from qlora_train.train.resume import FINGERPRINT_FILE, decide, prepare_output_dir, read_output_dir

REPO = Path(__file__).resolve().parents[2]
NOW = {"format": 1, "fingerprint": "f" * 32, "config": {}}
OWN = "name a folder of its own for the run"


def write_config(tmp_path, output_dir, **data) -> str:
    rows = tmp_path / "data" / "d.jsonl"
    rows.parent.mkdir(exist_ok=True)
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}) + "\n")
    (rows.parent / "README.md").write_text("the data's own readme")
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps({"model": {"name_or_path": "org/none-such"},  # refused before it loads
                                "data": {"datasets": [{"path": str(rows)}], **data},
                                "train": {"output_dir": str(output_dir), "report_to": "none"}}))
    return str(path)


def test_the_folders_a_run_never_writes_into(tmp_path, monkeypatch):
    data = tmp_path / "data"
    cfg = load_config(write_config(tmp_path, tmp_path / "out"))
    inputs = run_inputs(cfg)
    assert inputs == {"data.datasets[0].path": str(data / "d.jsonl")}
    monkeypatch.chdir(tmp_path / "data")
    assert output_dir_problem("/", inputs) == f"train.output_dir: / is the root folder: {OWN}"
    assert output_dir_problem(Path.home(), inputs) == f"train.output_dir: {Path.home()} is the home folder: {OWN}"
    assert output_dir_problem(".", inputs) == (f"train.output_dir: . is the working folder: {OWN} "
                                               "(e.g. outputs/run)")
    monkeypatch.chdir(REPO)
    for folder in (data, tmp_path):  # the data file's folder, and a folder above it
        assert output_dir_problem(folder, inputs) == (
            f"train.output_dir: {folder} holds data.datasets[0].path ({data / 'd.jsonl'}): a run would write its "
            f"files among the run's inputs; {OWN}")
    (data / MARKER_FILE).write_text("{}")  # ours or not: never among the inputs
    assert "holds data.datasets[0].path" in output_dir_problem(data, inputs)


def test_a_folder_must_be_missing_empty_or_ours(tmp_path):
    assert output_dir_problem(tmp_path / "new" / "run", {}) is None
    (tmp_path / "empty").mkdir()
    assert output_dir_problem(tmp_path / "empty", {}) is None
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    assert output_dir_problem(theirs, {}) == (
        f"train.output_dir: {theirs} is a folder that qlora-train did not write (no {MARKER_FILE} in it) and not "
        "empty: a run writes only into a new or empty folder, or one of its own; name another folder")
    mark(theirs)
    assert output_dir_problem(theirs, {}) is None
    legacy = tmp_path / "legacy"  # written before the marker: a file only our runs write
    legacy.mkdir()
    (legacy / FINGERPRINT_FILE).write_text("{}")
    assert output_dir_problem(legacy, {}) is None
    (tmp_path / "file").write_text("x")
    assert output_dir_problem(tmp_path / "file", {}) == f"train.output_dir: {tmp_path / 'file'} is a file, not a folder"


@pytest.mark.parametrize("flags", [["--stats-only"], ["--preprocess"]])
def test_the_data_folder_as_output_dir_is_refused_before_anything_is_written(tmp_path, capsys, flags):
    data = tmp_path / "data"
    path = write_config(tmp_path, data)
    assert main(["--config", path, *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: train.output_dir: {data} holds data.datasets[0].path ({data / 'd.jsonl'}): a run would write its "
        f"files among the run's inputs; {OWN}"]
    assert sorted(p.name for p in data.iterdir()) == ["README.md", "d.jsonl"]
    assert (data / "README.md").read_text() == "the data's own readme"


@pytest.mark.slow  # imports the training stack
def test_training_into_the_data_folder_or_a_folder_in_use_is_refused(tmp_path, capsys):
    data = tmp_path / "data"
    assert main(["--config", write_config(tmp_path, data)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: train.output_dir: {data} holds data.datasets[0].path ({data / 'd.jsonl'}): a run would write its "
        f"files among the run's inputs; {OWN}"]
    assert sorted(p.name for p in data.iterdir()) == ["README.md", "d.jsonl"]
    out = tmp_path / "out"
    mark(out)
    with RunLock(out) as held:
        assert held.take() is None
        assert main(["--config", write_config(tmp_path, out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: train.output_dir: {out} is in use by another run (pid "
                                               f"{os.getpid()} on ")
    assert err[0].endswith("): wait for it to end, or train into another folder")


HOLDER = """
import sys, time
from qlora_train.output_dir import RunLock
lock = RunLock(sys.argv[1])
print(lock.take(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX")
def test_one_run_at_a_time_and_a_killed_run_leaves_no_lock(tmp_path):
    out = mark(tmp_path / "out")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "None"  # it holds the lock
        refusal = RunLock(out).take()
        assert refusal.startswith(f"train.output_dir: {out} is in use by another run (pid {holder.pid} on ")
    finally:
        holder.kill()  # SIGKILL: no clean-up runs
        holder.wait()
    deadline = time.monotonic() + 5
    lock = RunLock(out)
    while (refusal := lock.take()) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refusal is None
    assert RunLock(out).take() is not None  # held now by this process's first lock
    lock.release()
    with RunLock(out) as again:
        assert again.take() is None


def write_checkpoint(out: Path, step: int) -> Path:
    (out / f"checkpoint-{step}").mkdir(parents=True)
    (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    return out / f"checkpoint-{step}"


def test_overwrite_over_a_checkpoint_link_refuses_and_deletes_nothing(tmp_path):
    out = mark(tmp_path / "out")
    write_checkpoint(out, 2)
    elsewhere = write_checkpoint(tmp_path / "precious", 7)
    (out / "checkpoint-9").symlink_to(elsewhere)
    state = read_output_dir(out)
    assert state.checkpoints == (2,) and state.links == ("checkpoint-9",)
    for overwrite in (True, False):
        decision = decide(state, NOW, resume="auto", overwrite=overwrite)
        assert (decision.action, decision.line) == ("refuse", (
            f"{out / 'checkpoint-9'} is a symbolic link: a run neither resumes from nor deletes anything through a "
            "link; remove the link (its target is left as it is), or name the checkpoint it points to in "
            "train.resume_from_checkpoint"))
    assert (elsewhere / "trainer_state.json").is_file()


def test_overwrite_removes_only_what_our_runs_wrote(tmp_path):
    out = mark(tmp_path / "out", published=["README.md", "preprocessor_config.json", "../escape", MARKER_FILE])
    write_checkpoint(out, 2)
    for name in ("README.md", "preprocessor_config.json", "adapter_config.json", "notes.txt"):
        (out / name).write_text("x")
    (tmp_path / "escape").write_text("not ours")
    (out / "training_complete.json").write_text(json.dumps({"global_step": 2}))
    prepare_output_dir(decide(read_output_dir(out), NOW, resume="auto", overwrite=True), NOW, out)
    assert sorted(p.name for p in out.iterdir()) == [MARKER_FILE, "notes.txt", FINGERPRINT_FILE]
    assert (tmp_path / "escape").read_text() == "not ours"


def test_a_tilde_is_expanded_and_a_dollar_refused_in_output_dir(tmp_path):
    assert load_config(write_config(tmp_path, "~/runs/a")).train.output_dir == str(Path.home() / "runs" / "a")
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, "$HOME/runs/a"))
    assert err.value.problems == ["train.output_dir: '$HOME/runs/a' holds '$': environment variables are not "
                                  "expanded (a folder named '$HOME' would be made); write the path itself (a leading "
                                  "~ is expanded)"]
