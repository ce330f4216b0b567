"""The agent demo's config through the CLI, one step on the random tiny model (the demo's own, trained to write
calls, takes minutes to build: ``qlora_train.tiny_agent``): multi-turn rollouts with the calculator
(``rl.tools``), the guided first call (``rl.guided_first_call``, off in the demo, turned on here) parsed and run,
the rollout logged with its segments marked, the agent metrics logged."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from qlora_train.cli import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "quickstart-agent.yaml"
AGENT_LOGGED = {"agent/turns", "agent/calls", "agent/tool_errors", "agent/parse_errors", "agent/max_turns",
                "agent/render_differs"}


def test_the_agent_quickstart_through_the_cli(tmp_path, tiny_model_dir, monkeypatch, caplog):
    monkeypatch.chdir(REPO / "configs")  # its data path is relative to it
    args = ["--config", str(CONFIG), "--set", f"model.name_or_path={tiny_model_dir}", "--set",
            f"train.output_dir={tmp_path / 'run'}", "--set", "train.max_steps=1", "--set", "train.save_steps=1",
            "--set", "train.per_device_train_batch_size=1", "--set", "rl.guided_first_call=true",
            "--set", "rl.num_generations=2",
            # cheaper on CPU, what is asserted unchanged: no 4-bit dequantizing in each of the 4 generate calls, and
            # turns of at most 30 tokens (the guided call's longest: 15 forced, 12 drawn, 3 closing)
            "--set", "model.load_in_4bit=false", "--set", "rl.max_completion_length=30"]
    with caplog.at_level(logging.INFO, logger="qlora_train"):
        assert main(args) == 0
    [step] = [h for h in json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
              if "loss" in h]
    assert AGENT_LOGGED <= set(step) and step["agent/calls"] == 1.0 and step["agent/parse_errors"] == 0
    assert step["agent/turns"] == 2.0  # the guided call, its result, the model's next (unguided) turn
    logged = "\n".join(r.getMessage() for r in caplog.records if "agent rollout" in r.getMessage())
    assert '[generated]<tool_call>\n{"name": "calculate", "arguments": {"expression": "' in logged
    assert "</tool_call><|im_end|>[/generated][tool]\n<|im_start|>user\n<tool_response>\n" in logged
    assert "tool calls: read as json" in caplog.text
