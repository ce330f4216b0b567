"""The config schema: shipped configs validate, bad configs name every problem, docs stay in sync."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlora_train.config import config_reference_markdown, load_config
from qlora_train.data.chat_templates import resolve_chat_template

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the quickstart's local model dir is built by `make demo`: stand one in
    (tmp_path / ".cache/tiny-qwen3").mkdir(parents=True)
    cfg = load_config(path)
    assert resolve_chat_template(cfg.model.chat_template)
    for src in cfg.data.datasets:
        assert Path(src.path).exists(), src.path


def test_overrides_apply_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".cache/tiny-qwen3").mkdir(parents=True)
    cfg = load_config(REPO / "configs/quickstart.yaml", ["train.max_steps=7", "data.think_loss=answer_only"])
    assert cfg.train.max_steps == 7 and cfg.data.think_loss == "answer_only"


def test_docs_config_reference_is_generated_from_schema():
    assert (REPO / "docs/config.md").read_text() == config_reference_markdown() + "\n"
