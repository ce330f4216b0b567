"""A tiny base model, and a run trained on it until it answers "Say hi" with "Hello!" and stops."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

HELLO = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello!"}]}


@pytest.fixture(scope="session")
def base_like_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen3 shipped as a base (not instruct) model is: ``<|endoftext|>`` is the eos of its
    tokenizer, config and generation config. Training with the qwen3 template teaches ``<|im_end|>``, so a
    chat answer stops only where the export lists the end-of-turn token (the "never stops" failure)."""
    from transformers import AutoTokenizer, GenerationConfig

    out = tmp_path_factory.mktemp("tiny-qwen3-base")
    shutil.copy(tiny_model_dir / "model.safetensors", out)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": 151643}))
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    gen.eos_token_id = 151643
    gen.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.eos_token = "<|endoftext|>"
    tok.save_pretrained(out)
    return out


def hello_config(tmp_path, model_dir, model: dict | None = None, **train) -> str:
    """A config training ``model_dir`` on ``HELLO`` (qwen3 template, enable_thinking false; ``model`` keys
    replace those) into ``tmp_path/out``: 30 steps at a high learning rate, checkpoints at 15 and 30."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "hello.jsonl").write_text((json.dumps(HELLO) + "\n") * 4)
    model = {"chat_template": "qwen3", "chat_template_kwargs": {"enable_thinking": False}, **(model or {})}
    cfg = {
        "model": {"name_or_path": str(model_dir), **model},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0},
        "data": {"datasets": [{"path": str(tmp_path / "hello.jsonl")}], "max_length": 64},
        "train": {"output_dir": str(tmp_path / "out"), "max_steps": 30, "per_device_train_batch_size": 4,
                  "learning_rate": 2e-2, "lr_scheduler": "constant", "warmup_ratio": 0.0, "save_steps": 15,
                  "logging_steps": 5, "report_to": "none", **train},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return str(tmp_path / "cfg.yaml")


@pytest.fixture(scope="session")
def hello_run(tmp_path_factory, base_like_model_dir) -> str:
    """The config path of a finished ``hello_config`` run (its outputs are in ``train.output_dir``)."""
    from qlora_train.config import load_config
    from qlora_train.train.run import train

    path = hello_config(tmp_path_factory.mktemp("hello"), base_like_model_dir)
    train(load_config(path))
    return path


@pytest.fixture(scope="session")
def new_tokens_hello_run(tmp_path_factory, foreign_base_dir, foreign_template) -> str:
    """The config path of a finished ``hello_config`` run with a foreign template whose markers are not tokens of
    the vocabulary, added by ``model.new_tokens: auto`` (the untied base with no spare rows: its embeddings grow);
    20 steps teach it "Hello!" and the new end marker."""
    from qlora_train.config import load_config
    from qlora_train.train.run import train

    model = {"chat_template": str(foreign_template), "chat_template_kwargs": {}, "new_tokens": "auto"}
    path = hello_config(tmp_path_factory.mktemp("hello-new-tokens"), foreign_base_dir, model, max_steps=20,
                        save_steps=20, gradient_checkpointing=False)
    train(load_config(path))
    return path
