"""The examples in module docstrings run, with ``tok`` the Qwen3 tokenizer (real vocabulary, shipped template)."""

from __future__ import annotations

import copy
import doctest
import importlib

import pytest

MODULES = [
    "qlora_train.locations", "qlora_train.chat_templates",
    "qlora_train.masking", "qlora_train.masking.policy", "qlora_train.masking.layout",
    "qlora_train.masking.layout_declaration", "qlora_train.masking.apply_template", "qlora_train.masking.render",
    "qlora_train.masking.rendered", "qlora_train.masking.images", "qlora_train.masking.image_layouts",
    "qlora_train.masking.row_text", "qlora_train.masking.tokenize", "qlora_train.masking.count",
    "qlora_train.masking.fast_bpe",
    "qlora_train.masking.check", "qlora_train.masking.budget", "qlora_train.masking.example",
    "qlora_train.masking.pair", "qlora_train.masking.messages", "qlora_train.masking.generation",
    "qlora_train.data.batches", "qlora_train.data.drops", "qlora_train.data.parse", "qlora_train.data.formats",
    "qlora_train.data.handlers",
    "qlora_train.data.rows", "qlora_train.data.packing", "qlora_train.data.prepared", "qlora_train.data.pairs",
    "qlora_train.data.prepared_checks", "qlora_train.data.identity", "qlora_train.data.images",
    "qlora_train.output_dir",
    "qlora_train.data.unpaired", "qlora_train.data.prompts", "qlora_train.rl.rewards", "qlora_train.rl.loss",
    "qlora_train.rl.tool_calls", "qlora_train.rl.tools", "qlora_train.rl.calculator",
    "qlora_train.train.grpo",
    "qlora_train.data.truncate", "qlora_train.data.rule_check", "qlora_train.data.sources", "qlora_train.terminal",
    "qlora_train.train.collator", "qlora_train.train.preference_loss", "qlora_train.train.distributed",
    "qlora_train.train.global_batches",
    "qlora_train.tokenizer",
    "qlora_train.diagnostics.images", "qlora_train.diagnostics.stats", "qlora_train.diagnostics.rollouts",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, qwen3_tok):
    module = importlib.import_module(name)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    # a shallow copy: an example that sets a template on ``tok`` (get_chat_template) leaves the session's alone
    result = doctest.testmod(module, extraglobs={"tok": copy.copy(qwen3_tok)}, optionflags=flags, verbose=False)
    assert result.attempted > 0, f"{name} has no example: take it off the list"
    assert result.failed == 0
