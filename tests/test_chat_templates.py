"""get_chat_template: shipped names, the tokenizer's own, and .jinja paths."""

from __future__ import annotations

import copy

import pytest

from qlora_train.data import get_chat_template, shipped_templates


def test_shipped_names():
    assert {"chatml", "qwen2.5", "qwen3", "qwen3.5", "llama3", "gemma"} <= set(shipped_templates())


def test_path_tokenizer_and_unknown(qwen3_tok, tmp_path):
    tok = copy.deepcopy(qwen3_tok)
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert get_chat_template(tok, str(path)).chat_template == path.read_text()
    assert get_chat_template(tok, "tokenizer").chat_template == path.read_text()  # kept as is
    with pytest.raises(ValueError, match="unknown chat_template 'qwen9'"):
        get_chat_template(tok, "qwen9")
    with pytest.raises(FileNotFoundError, match="missing.jinja"):
        get_chat_template(tok, str(tmp_path / "missing.jinja"))
