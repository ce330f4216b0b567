"""Faults around training, without training: signals, atomic outputs, OOM advice, data errors, safety flags."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch
import yaml
from transformers import TrainerControl, TrainerState, TrainingArguments

from qlora_train.cli import main
from qlora_train.config import Config, ModelConfig
from qlora_train.train import run
from qlora_train.train.signals import StopOnSignal, TrainingInterrupted, handle_stop_signals

# runs the CLI on broken inputs: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

GOOD_ROW = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def write_config(tmp_path, rows: list[dict], **model) -> str:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"name_or_path": "Qwen/Qwen3-0.6B", **model},
           "data": {"datasets": [{"path": str(data)}], "max_length": 64},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none", "gradient_checkpointing": False}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_stop_request_saves_and_stops_at_the_next_step_end():
    stopper = StopOnSignal()
    args, state, control = TrainingArguments(output_dir="unused", report_to=[]), TrainerState(), TrainerControl()
    state.global_step = 5
    stopper.on_step_end(args, state, control)
    assert not control.should_save and not control.should_training_stop and stopper.stopped_at is None
    stopper.request_stop(signal.SIGTERM)
    state.global_step = 6
    stopper.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop and stopper.stopped_at == 6
    with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
        stopper.request_stop(signal.SIGINT)


def test_handlers_are_installed_in_the_main_thread_and_restored():
    before = signal.getsignal(signal.SIGTERM)
    stopper = StopOnSignal()
    with handle_stop_signals(stopper):
        assert signal.getsignal(signal.SIGTERM) == stopper.request_stop
        assert signal.getsignal(signal.SIGINT) == stopper.request_stop
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal only sets the flag
        assert stopper.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before

    seen = []
    thread = threading.Thread(target=lambda: seen.append(_install_in_thread()))
    thread.start()
    thread.join()
    assert seen == [before]


def _install_in_thread():
    with handle_stop_signals(StopOnSignal()):
        return signal.getsignal(signal.SIGTERM)


def test_interrupted_exit_code_is_128_plus_signal():
    stop = TrainingInterrupted(signal.SIGTERM, 3, "out/checkpoint-3")
    assert stop.exit_code == 143
    assert str(stop) == ("stopped by SIGTERM at step 3; checkpoint saved to out/checkpoint-3; "
                         "run the same command again to continue")


def test_publish_moves_whole_files_adapter_config_last(tmp_path, monkeypatch):
    staging, out = tmp_path / "out" / run.STAGING_DIR, tmp_path / "out"
    staging.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "config.yaml"):
        (staging / name).write_text(name)
    (out / "adapter_model.safetensors").write_text("old")
    moved = []
    real_replace = os.replace
    monkeypatch.setattr(run.os, "replace", lambda a, b: (moved.append(os.path.basename(b)), real_replace(a, b)))
    run.publish(staging, out)
    assert moved[-1] == "adapter_config.json" and sorted(moved) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "config.yaml"])
    assert (out / "adapter_model.safetensors").read_text() == "adapter_model.safetensors"
    assert not staging.exists()


def test_cuda_oom_gives_advice_and_exit_3(tmp_path, capsys, monkeypatch):
    def oom(cfg, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(run, "train", oom)
    assert main(["--config", write_config(tmp_path, [GOOD_ROW])]) == 3
    err = capsys.readouterr().err
    assert err.splitlines()[:4] == [
        "error: CUDA ran out of memory. Try, in this order:",
        "  - lower data.max_length (now 64); `--set data.on_too_long=drop` skips the longest rows instead of "
        "cutting them",
        "  - lower train.per_device_train_batch_size (now 1) and raise train.gradient_accumulation_steps (now 1) "
        "to keep the effective batch",
        "  - set train.gradient_checkpointing: true (recomputes activations instead of storing them)",
    ]
    assert "(CUDA out of memory. Tried to allocate 2.00 GiB)" in err and "Traceback" not in err


def test_cuda_oom_advice_names_the_fused_loss_when_it_is_off(tmp_path, capsys, monkeypatch):
    def oom(cfg, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(run, "train", oom)
    path = write_config(tmp_path, [GOOD_ROW])
    assert main(["--config", path]) == 3
    assert "fused_loss" not in capsys.readouterr().err
    assert main(["--config", path, "--set", "train.fused_loss=false"]) == 3
    assert ("  - set train.fused_loss: true (logits only at trained positions, a chunk at a time)"
            in capsys.readouterr().err.splitlines())


def test_unknown_optimizer_is_a_config_error_before_loading(tmp_path, capsys):
    path = write_config(tmp_path, [GOOD_ROW])  # the hub model is never fetched: the optimizer check comes first
    assert main(["--config", path, "--set", "train.optim=adamw_tourch"]) == 2
    assert "  train.optim: unknown optimizer 'adamw_tourch' (did you mean 'adamw_torch'?)" in capsys.readouterr().err


def test_all_rows_dropped_stops_before_the_model_loads(tmp_path, qwen_tokenizer_dir, capsys):
    # the "model" is a tokenizer-only directory: loading weights would fail with another error
    rows = [{"foo": 1}, {"messages": [{"role": "user", "content": "q"}]}, {"foo": 2}]
    assert main(["--config", write_config(tmp_path, rows, name_or_path=str(qwen_tokenizer_dir))]) == 1
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert error == [f"error: all 3 rows were dropped (unknown_schema: 2, no_assistant_turn: 1); first: "
                     f"{tmp_path / 'd.jsonl'}:1: no known schema among keys ['foo']; "
                     f"{tmp_path / 'd.jsonl'}:2: no trained message (a role in ['assistant'])"]
    assert not (tmp_path / "out").exists()


def test_bad_row_with_on_bad_row_error_exits_1(tmp_path, qwen_tokenizer_dir, capsys):
    path = write_config(tmp_path, [GOOD_ROW, {"foo": 1}], name_or_path=str(qwen_tokenizer_dir))
    assert main(["--config", path, "--set", "data.on_bad_row=error"]) == 1
    assert f"error: bad row (unknown_schema) at {tmp_path / 'd.jsonl'}:2: " in capsys.readouterr().err


@pytest.mark.parametrize("trust", [False, True])
def test_trust_remote_code_is_passed_as_configured(monkeypatch, trust):
    import transformers

    calls = {}

    class Stop(Exception):
        pass

    def record(name):
        def from_pretrained(path, **kw):
            calls[name] = kw
            raise Stop

        return from_pretrained

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", record("tokenizer"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record("model"))
    from qlora_train.tokenizer import load_tokenizer
    from qlora_train.train.model import load_model, resolve_runtime

    cfg = Config(model=ModelConfig(name_or_path="org/m", trust_remote_code=trust))
    with pytest.raises(Stop):
        load_tokenizer(cfg.model)
    with pytest.raises(Stop):
        load_model(cfg, resolve_runtime(cfg))
    assert calls["tokenizer"]["trust_remote_code"] is trust and calls["model"]["trust_remote_code"] is trust
    assert ModelConfig(name_or_path="org/m").trust_remote_code is False


def test_unreachable_hub_model_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_config(tmp_path, [GOOD_ROW], name_or_path="org/none-such")
    assert main(["--config", path]) == 1
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and error[0].startswith("error: cannot load the tokenizer org/none-such: ")


def test_template_that_cannot_be_probed_does_not_stop_the_run(tmp_path, qwen_tokenizer_dir, capsys):
    """Issue 24: no generation prompt, nothing between a question and its answer: the probe leaves the layout's
    openers unknown and says so; the rows train by the rule (per-turn prefix renders), counted."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")  # no add_generation_prompt
    path = write_config(tmp_path, [GOOD_ROW], name_or_path=str(qwen_tokenizer_dir), chat_template=str(template))
    assert main(["--config", path, "--stats-only"]) == 0
    out = capsys.readouterr().out
    assert "# class: unknown; could not be probed: assistant_header, turn_openers" in out, out
    assert "1 rows were verified by per-turn prefix renders" in out, out
