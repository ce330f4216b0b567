"""load_tokenizer: the class tokenizer_config.json names, loaded without importing torch, equal to AutoTokenizer's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qlora_train.tokenizer import tokenizer_class

TEXT = "user: 2+2? <think>add</think> 4<|im_end|>\n naïve 東京 \t done"


def test_the_named_class_is_the_one_auto_tokenizer_picks_and_encodes_the_same(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    direct = tokenizer_class(str(qwen_tokenizer_dir)).from_pretrained(qwen_tokenizer_dir)
    assert type(direct) is type(auto) and len(direct) == len(auto)
    assert direct(TEXT, return_offsets_mapping=True) == auto(TEXT, return_offsets_mapping=True)
    assert direct.special_tokens_map == auto.special_tokens_map


@pytest.mark.parametrize("config, expected", [
    ({"tokenizer_class": "NoSuchTokenizer"}, "AutoTokenizer"),
    ({"tokenizer_class": "TokenizersBackend", "auto_map": {"AutoTokenizer": ["x.Tok", None]}}, "AutoTokenizer"),
    ({"tokenizer_class": "PreTrainedConfig"}, "AutoTokenizer"),  # a transformers class that is no tokenizer
    ({"tokenizer_class": "TokenizersBackend"}, "TokenizersBackend"),
])
def test_auto_tokenizer_is_the_fallback(tmp_path, config, expected):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_class(str(tmp_path)).__name__ == expected
    assert tokenizer_class(str(tmp_path), trust_remote_code=True).__name__ == "AutoTokenizer"
    assert tokenizer_class("Qwen/Qwen3-1.7B").__name__ == "AutoTokenizer"  # a hub id


def test_loading_a_local_tokenizer_imports_no_torch(qwen_tokenizer_dir):
    probe = ("import sys\nfrom qlora_train.config import ModelConfig\n"
             "from qlora_train.tokenizer import load_tokenizer\n"
             f"tok = load_tokenizer(ModelConfig(name_or_path={str(qwen_tokenizer_dir)!r}, chat_template='qwen3'))\n"
             "print(type(tok).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["TokenizersBackend", "False"]


def test_the_tiny_tokenizer_is_saved_as_real_qwen_repositories_ship_it(tmp_path):
    """added_tokens_decoder in tokenizer_config.json (transformers then need not re-read tokenizer.json in
    Python); the tokenizer loads back the same."""
    from transformers import AutoTokenizer

    from qlora_train.tiny import build_qwen_tokenizer, save_tokenizer

    tok = build_qwen_tokenizer("qwen3")
    save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["151645"]["content"] == "<|im_end|>"
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.added_tokens_decoder == tok.added_tokens_decoder and loaded(TEXT) == tok(TEXT)
