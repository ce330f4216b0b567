"""The config schema: shipped configs validate, bad configs name every problem, docs stay in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlora_train.cli import main
from qlora_train.config import ConfigError, config_reference_markdown, load_config
from qlora_train.data.chat_templates import resolve_chat_template

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert resolve_chat_template(cfg.model.chat_template)
    for src in cfg.data.datasets:
        assert Path(src.path).exists(), src.path


def test_overrides_apply_last(tmp_path):
    cfg = load_config(REPO / "configs/quickstart.yaml", ["train.max_steps=7", "data.think_loss=answer_only"])
    assert cfg.train.max_steps == 7 and cfg.data.think_loss == "answer_only"


BAD = [
    ("model: {name_or_path: x, load_in_4bit: true, load_in_8bit: true}", "model: load_in_4bit and load_in_8bit"),
    ("model: {name_or_path: x}\ndata: {max_lenght: 5}", "data.max_lenght: unknown key (did you mean 'max_length'?)"),
    ("model: {name_or_path: x}\ndata: {max_length: 0}", "data.max_length: Input should be greater than or equal to 1"),
    ("model: {name_or_path: x}\ndata: {think_loss: most}", "data.think_loss: Input should be 'all'"),
    ("model: {name_or_path: x}\ndata: {think_mode: drop, think_loss: answer_plus_think}", "data: think_mode: drop"),
    ("model: {name_or_path: x}\ntrain: {learning_rate: fast}", "train.learning_rate: Input should be a valid number"),
    ("lora: {r: 8}", "model: Field required"),
    ("model: {name_or_path: x}\ntrain: {packing: true, group_by_length: true}", "train: packing and group_by_length"),
    ("model: {name_or_path: x}\ntrain: {split_long: true}", "train: split_long and packing_length need packing"),
]


@pytest.mark.parametrize("text, problem", BAD)
def test_bad_configs_name_the_key(tmp_path, text, problem, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems
    assert main(["--config", str(path)]) == 2
    assert problem in capsys.readouterr().err


def test_docs_config_reference_is_generated_from_schema():
    assert (REPO / "docs/config.md").read_text() == config_reference_markdown() + "\n"
