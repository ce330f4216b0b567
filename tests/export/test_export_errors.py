"""What --merge / --generate refuse, each with one line and exit 2 (no traceback), before any weights load;
and the flags each mode needs."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest
import yaml

from qlora_train.cli import main, parse_args
from qlora_train.export.adapter import find_adapter
from qlora_train.export.merge import MERGE_INFO, OTHER_FILES_BYTES
from qlora_train.files import publish_dir


def write_config(tmp_path, model_dir) -> str:
    (tmp_path / "d.jsonl").write_text('{"prompt": "hi", "response": "hello"}\n')
    cfg = {"model": {"name_or_path": str(model_dir), "chat_template": "qwen3"},
           "data": {"datasets": [{"path": str(tmp_path / "d.jsonl")}]},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "cfg.yaml")


def fake_adapter(path: Path, step: int | None = None) -> Path:
    """The files that mark an adapter (never loaded by these tests)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"")
    if step is not None:
        (path / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return path


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err.strip().splitlines()[-1]


def test_no_adapter_is_exit_2(tmp_path, tiny_model_dir, capsys):
    cfg = write_config(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    assert run(capsys, "--config", cfg, "--merge") == (
        2, f"error: no trained adapter: train.output_dir {out} does not exist (train first)")
    out.mkdir()
    assert run(capsys, "--config", cfg, "--generate", "hi") == (
        2, f"error: no trained adapter in {out} (adapter_config.json and weights): train first")


def test_an_unfinished_run_names_its_checkpoints(tmp_path, tiny_model_dir, capsys):
    cfg = write_config(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    for step in (10, 20):
        fake_adapter(out / f"checkpoint-{step}", step)
    (out / "checkpoint-30").mkdir()  # cut short: no adapter in it
    assert run(capsys, "--config", cfg, "--merge") == (
        2, f"error: no final adapter in {out} (the run did not finish): export a checkpoint with --checkpoint "
        "(checkpoint-10, checkpoint-20, or last), or finish training: run the training command again")
    assert run(capsys, "--config", cfg, "--merge", "--checkpoint", "30") == (
        2, f"error: --checkpoint 30: no adapter (adapter_config.json and weights) in {out / 'checkpoint-30'} "
        f"(checkpoints in {out}: checkpoint-10, checkpoint-20)")


def test_checkpoint_names(tmp_path):
    out = tmp_path / "out"
    for step in (5, 10):
        fake_adapter(out / f"checkpoint-{step}", step)
    elsewhere = fake_adapter(tmp_path / "elsewhere")
    assert find_adapter(out, "5") == find_adapter(out, "checkpoint-5") == out / "checkpoint-5"
    assert find_adapter(out, "last") == out / "checkpoint-10"
    assert find_adapter(out, str(elsewhere)) == elsewhere
    fake_adapter(out)
    assert find_adapter(out) == out


def test_not_enough_disk_space_is_exit_2_and_writes_nothing(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    cfg = write_config(tmp_path, tiny_model_dir)
    fake_adapter(tmp_path / "out")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("qlora_train.export.merge.shutil.disk_usage", lambda path: usage(10 * 2**30, 0, 2**20))
    weights = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters()) * 4
    code, line = run(capsys, "--config", cfg, "--merge")
    assert code == 2
    assert line == (f"error: not enough disk space in {tmp_path / 'out'}: the merged model needs about "
                    f"{(weights + OTHER_FILES_BYTES) / 2**30:.2f} GiB, 0.00 GiB are free (free some, or pass "
                    "--merge-dir on another disk)")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter_config.json",
                                                                    "adapter_model.safetensors"]


def test_a_destination_that_holds_other_things_is_refused(tmp_path, tiny_model_dir, capsys):
    cfg = write_config(tmp_path, tiny_model_dir)
    out = fake_adapter(tmp_path / "out")
    for dest in (out, tmp_path):
        assert run(capsys, "--config", cfg, "--merge", "--merge-dir", str(dest)) == (
            2, f"error: --merge-dir {dest}: would replace {out.resolve()}, which holds the training outputs; "
            "choose another directory")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert run(capsys, "--config", cfg, "--merge", "--merge-dir", str(mine)) == (
        2, f"error: --merge-dir {mine}: exists and was not written by --merge (no {MERGE_INFO}); remove it or "
        "choose another directory")
    assert (mine / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("argv, message", [
    (["--generate", "hi", "--chat"], "--generate and --chat: pick one"),
    (["--merge", "--stats-only"], "cannot be combined with --stats-only"),
    (["--merge-base", "dequantized"], "--merge-base and --max-shard-size need --merge"),
    (["--merge", "--merged"], "--merged and --max-new-tokens need --generate or --chat"),
    (["--max-new-tokens", "5"], "--merged and --max-new-tokens need --generate or --chat"),
    (["--generate", "hi", "--merged", "--checkpoint", "3"], "--checkpoint needs --merge, or --generate"),
    (["--merge-dir", "m"], "--merge-dir needs --merge or --merged"),
    (["--generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_flags_that_need_another(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--config", "c.yaml", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_flags_that_go_together():
    args = parse_args(["--config", "c.yaml", "--merge", "--checkpoint", "last", "--merge-base", "dequantized",
                       "--generate", "hi", "--merged", "--merge-dir", "m", "--max-new-tokens", "8"])
    assert (args.merge, args.checkpoint, args.merge_base, args.generate, args.merged) == (
        True, "last", "dequantized", "hi", True)


def test_publish_dir_replaces_the_old_directory_whole(tmp_path):
    dest, staging = tmp_path / "merged", tmp_path / ".merged.tmp"
    for folder, files in ((dest, {"old.bin": "1", "shared.json": "old"}), (staging, {"shared.json": "new"})):
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
    publish_dir(staging, dest)
    assert {p.name: p.read_text() for p in dest.iterdir()} == {"shared.json": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]
