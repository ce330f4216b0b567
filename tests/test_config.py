"""The config schema: shipped configs validate, bad configs name every problem, docs stay in sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qlora_train.chat_templates import resolve_chat_template
from qlora_train.config import config_reference_markdown, load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the quickstart's local model dir is built by `make demo`: stand one in
    (tmp_path / ".cache/tiny-qwen3").mkdir(parents=True)
    (tmp_path / ".cache/tiny-qwen2.5-vl").mkdir(parents=True)  # make demo-vl's
    (tmp_path / ".cache/tiny-qwen3-agent").mkdir(parents=True)  # make demo-agent's
    cfg = load_config(path)
    if cfg.model.chat_template is not None:  # None: the model's own template
        assert resolve_chat_template(cfg.model.chat_template)
    for src in cfg.data.datasets:
        assert Path(src.path).exists(), src.path


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_say_which_template_and_why(path):
    """Real models keep their own template; the offline quickstart names ours (its tiny model ships it)."""
    text = path.read_text()
    model = yaml.safe_load(text)["model"]
    if path.name.startswith("quickstart"):  # the SFT, DPO, KTO and vision-language demos
        ours = "qwen2.5-vl" if path.name.startswith("quickstart-vl") else "qwen3"
        assert model["chat_template"] == ours and "keeps the demo the same everywhere" in text
    else:
        assert "chat_template" not in model and "the model's own template is used" in text


def test_template_key_defaults_to_the_tokenizers_own_and_old_values_still_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("{}\n")
    base = {"data": {"datasets": [{"path": "d.jsonl"}]}}
    for model, expected in [({}, None), ({"chat_template": "tokenizer"}, "tokenizer"),
                            ({"chat_template": "llama3.1"}, "llama3.1")]:
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({**base, "model": {"name_or_path": "org/m", **model}}))
        cfg = load_config(tmp_path / "c.yaml", ["model.chat_template_kwargs={enable_thinking: false}"])
        assert cfg.model.chat_template == expected
        assert cfg.model.chat_template_kwargs == {"enable_thinking": False}


def test_overrides_apply_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".cache/tiny-qwen3").mkdir(parents=True)
    (tmp_path / ".cache/tiny-qwen2.5-vl").mkdir(parents=True)  # make demo-vl's
    (tmp_path / ".cache/tiny-qwen3-agent").mkdir(parents=True)  # make demo-agent's
    cfg = load_config(REPO / "configs/quickstart.yaml", ["train.max_steps=7", "data.think_loss=answer_only"])
    assert cfg.train.max_steps == 7 and cfg.data.think_loss == "answer_only"


def test_docs_config_reference_is_generated_from_schema():
    assert (REPO / "docs/config.md").read_text() == config_reference_markdown() + "\n"
