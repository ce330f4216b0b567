"""Shared fixtures: the real Qwen vocabulary tokenizer (built offline once per session)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# CI (CI=true) runs every property test on the same derandomized examples, so a red build has a reason that
# reproduces; a local run explores new examples each time. A failure found locally is kept as an @example.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# special tokens each family's template writes; added to the Qwen vocabulary so that
# they tokenize as single tokens, as they do with the family's own tokenizer
FAMILY_SPECIAL_TOKENS = {
    "qwen3": [], "qwen3.5": [], "qwen2.5": [], "chatml": [],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gemma": ["<bos>", "<start_of_turn>", "<end_of_turn>"],
}


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory):
    from qlora_train.tiny import build_qwen_tokenizer

    path = tmp_path_factory.mktemp("qwen-tokenizer")
    build_qwen_tokenizer("qwen3").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def family_tokenizers(qwen_tokenizer_dir):
    """name -> Qwen-vocabulary tokenizer with that family's template and special tokens."""
    from transformers import AutoTokenizer

    from qlora_train.data import get_chat_template

    out = {}
    for name, specials in FAMILY_SPECIAL_TOKENS.items():
        tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
        if specials:
            tok.add_special_tokens({"additional_special_tokens": specials})
        out[name] = get_chat_template(tok, name)
    return out


@pytest.fixture(scope="session")
def qwen3_tok(family_tokenizers):
    return family_tokenizers["qwen3"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from qlora_train.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
