"""Tool schema tokens read off the one render: the template's tool block, probed once, located in each render."""

from __future__ import annotations

import pytest

from qlora_train.data import DataConfig, process_rows
from qlora_train.masking.layout import probe_tool_block, tool_block
from tests.masking.families import FAMILIES, family_tokenizer

# every family template's tool block probed (~30 s on 2 cores): make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {}}}}]
ROW = {"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": "Sunny."}],
       "tools": TOOLS}


def test_the_qwen3_block_is_the_tools_section_of_the_system_turn(qwen3_tok):
    block = probe_tool_block(qwen3_tok)  # no system message: the template opens a system turn for the tools
    assert block.open.startswith("system\n# Tools\n") and block.open.endswith("<tools>\n")
    assert block.close.startswith("\n</tools>\n") and block.close.endswith("<|im_end|>\n<|im_start|>")
    block = probe_tool_block(qwen3_tok, with_system=True)  # appended to the system prompt
    assert block.open.startswith("\n\n# Tools\n") and block.close.endswith("</tool_call>")


def token_difference(tok, messages, tools) -> int:
    n = [len(tok(tok.apply_chat_template(messages, tools=t, tokenize=False), add_special_tokens=False)["input_ids"])
         for t in (tools, None)]
    return n[0] - n[1]


@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("name", [n for n in sorted(FAMILIES) if FAMILIES[n].supports_tools])
def test_the_column_is_the_token_difference_the_tools_make(name, system, qwen_tokenizer_dir):
    """For every family whose template writes tools: the count from the one render equals rendering the row
    again without its tools and subtracting (what --stats-only used to do), or the probe says it cannot place
    the block (-1, and the diagnostics measure that row the old way). Where the block's edges are plain text
    rather than special tokens (Falcon3's ``<|system|>`` here), a merge across an edge moves at most one token."""
    tok = family_tokenizer(qwen_tokenizer_dir, name)
    row = {**ROW, "messages": [{"role": "system", "content": "Be brief."}] * system + ROW["messages"]}
    out = process_rows([row], tok, DataConfig(max_length=4096))
    assert out["drop_reason"] == [""], out["drop_detail"]
    n = out["tool_schema_tokens"][0]
    if tool_block(tok, system) is None:
        assert n == -1
    else:
        difference = token_difference(tok, row["messages"], TOOLS)
        assert difference > 0 and abs(n - difference) <= (1 if name == "falcon3" else 0)


def test_rows_without_tools_count_zero(qwen3_tok):
    out = process_rows([{k: v for k, v in ROW.items() if k != "tools"}], qwen3_tok, DataConfig())
    assert out["tool_schema_tokens"] == [0]


def test_stats_render_no_row_twice(qwen3_tok, monkeypatch, tmp_path):
    """--stats-only takes the counts from the column: the second-render fallback is not called."""
    import datasets

    from qlora_train.config import Config
    from qlora_train.diagnostics import run

    monkeypatch.setattr(run, "tool_schema_tokens", lambda *a, **k: pytest.fail("rendered a row again"))
    processed = datasets.Dataset.from_dict(process_rows([ROW, ROW], qwen3_tok, DataConfig()))
    cols = processed.to_dict()
    cfg = Config.model_validate({"model": {"name_or_path": "x"}})
    assert run.tool_tokens_per_row(None, cols, qwen3_tok, cfg) == {0: cols["tool_schema_tokens"][0],
                                                                   1: cols["tool_schema_tokens"][1]}
