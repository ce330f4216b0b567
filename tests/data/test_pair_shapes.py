"""Preference rows in the shapes users download (tests/data/pair_shapes/: UltraFeedback-binarized, Anthropic HH,
orca pairs, TRL standard and conversational with tools, argilla with field_mappings), each read with
configs/quickstart-dpo.yaml changed only in its data path and mapping: every row kept, and each side trains its
response and nothing of the prompt (the shared prompt, its tool schemas, tool results). One shape through the CLI
(--stats-only --debug-samples). Real Qwen vocabulary, the qwen3 template (the quickstart's)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.data.pairs import SIDES, canonicalize_pair
from qlora_train.data.pipeline import process_rows
from qlora_train.masking.tokenize import IGNORE_INDEX

REPO = Path(__file__).resolve().parents[2]
SHAPES = REPO / "tests" / "data" / "pair_shapes"
QUICKSTART = REPO / "configs" / "quickstart-dpo.yaml"
# shape -> (file, the data.field_mappings it needs, CanonicalPair.format of its rows)
ARGILLA = {"chosen": "chosen_response", "rejected": "rejected_response", "score_chosen": "chosen_rating",
           "score_rejected": "rejected_rating"}
CASES = {
    "ultrafeedback": ("ultrafeedback.jsonl", {}, "implicit_prompt"),
    "hh": ("hh.jsonl", {}, "hh_rlhf"),
    "orca": ("orca.jsonl", {}, "prompt_chosen_rejected"),
    "trl_standard": ("trl_standard.jsonl", {}, "prompt_chosen_rejected"),
    "trl_conversational": ("trl_conversational.jsonl", {}, "prompt_chosen_rejected"),
    "argilla": ("argilla.jsonl", ARGILLA, "instruction"),
}


def quickstart_overrides(data_file: Path, mapping: dict, tmp: Path) -> list[str]:
    """What differs from configs/quickstart-dpo.yaml: the data path and the mapping (and, for a test, the datasets
    cache in a temporary directory)."""
    out = [f"data.datasets=[{{path: {data_file}}}]", f"data.cache_dir={tmp / 'hf-cache'}"]
    return out + ([f"data.field_mappings={json.dumps(mapping)}"] if mapping else [])


def runs(labels: list[int]) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of trained positions."""
    out, start = [], None
    for i, t in enumerate([*labels, IGNORE_INDEX]):
        if t != IGNORE_INDEX and start is None:
            start = i
        elif t == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


def expected_trained_text(response: list[dict]) -> list[str]:
    """Each trained run of a response on Qwen3's template, by hand: an assistant turn's reasoning block (written
    in the last turn, empty without reasoning, and in a turn with reasoning), its content, its tool calls (a
    newline between them, and after content) and ``<|im_end|>``; a tool result is not trained."""
    out = []
    for k, m in enumerate(response):
        if m["role"] != "assistant":
            continue
        reasoning = m.get("reasoning_content", "")
        text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning or k == len(response) - 1 else ""
        text += m["content"]
        for j, call in enumerate(m.get("tool_calls", [])):
            text += ("\n" if j or m["content"] else "") + "<tool_call>\n" + json.dumps(
                {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
                ensure_ascii=False) + "\n</tool_call>"
        out.append(text + "<|im_end|>")
    return out


@pytest.mark.parametrize("shape", sorted(CASES))
def test_each_shape_keeps_every_row_and_trains_only_the_responses(shape, tmp_path, qwen_tokenizer_dir, qwen3_tok):
    name, mapping, fmt = CASES[shape]
    cfg = load_config(QUICKSTART, [f"model.name_or_path={qwen_tokenizer_dir}", "model.adapter_path=null",
                                   *quickstart_overrides(SHAPES / name, mapping, tmp_path)])
    rows = [json.loads(line) for line in (SHAPES / name).read_text().splitlines()]
    out = process_rows(rows, qwen3_tok, cfg.data)
    assert out["drop_reason"] == [""] * len(rows), out["drop_detail"]
    for i, row in enumerate(rows):
        pair = canonicalize_pair(row, cfg.data)
        assert pair.format == fmt
        n = out["prompt_length"][i]
        for side, response in zip(SIDES, (pair.chosen, pair.rejected)):
            ids, labels = out[f"{side}_input_ids"][i], out[f"{side}_labels"][i]
            assert len(ids) == len(labels) <= cfg.data.max_length
            trained = runs(labels)
            assert trained and trained[0][0] >= n  # nothing of the shared prompt
            texts = [qwen3_tok.decode(ids[a:b]) for a, b in trained]
            assert texts == expected_trained_text(response), (shape, i, side)


def test_an_ultrafeedback_row_whose_prompt_column_disagrees_is_refused_with_its_reason(tmp_path, qwen_tokenizer_dir,
                                                                                    qwen3_tok):
    row = json.loads((SHAPES / "ultrafeedback.jsonl").read_text().splitlines()[0])
    row["prompt"] = "Another question?"
    cfg = load_config(QUICKSTART, [f"model.name_or_path={qwen_tokenizer_dir}", "model.adapter_path=null"])
    out = process_rows([row], qwen3_tok, cfg.data, locations=["uf:1"])
    assert out["drop_reason"] == ["pair_prompt_differs"]
    assert out["drop_detail"] == ["uf:1: chosen is a whole conversation that does not open with the row's prompt: "
                                  "its first user turn is 'How many legs does a spider have?', the prompt "
                                  "'Another question?'"]


def test_the_tool_shape_through_the_cli_every_pair_kept_only_responses_marked(tmp_path, qwen_tokenizer_dir, capsys):
    tree = yaml.safe_load(QUICKSTART.read_text())
    tree["model"].update(name_or_path=str(qwen_tokenizer_dir), adapter_path=None)
    tree["data"]["datasets"] = [{"path": str(SHAPES / "trl_conversational.jsonl")}]
    tree["data"]["cache_dir"] = str(tmp_path / "hf-cache")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    argv = ["--config", str(cfg), "--stats-only", "--debug-samples", "3", "--stats-dir", str(tmp_path / "stats")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "rows in 3, kept 3, dropped 0" in printed and "refused pairs by reason: none" in printed
    samples = printed[printed.index(f"--- {SHAPES / 'trl_conversational.jsonl'}:1 chosen"):]
    marked = re.findall("\u27e6(.*?)\u27e7", samples, flags=re.S)
    rows = [canonicalize_pair(json.loads(line)) for line in (SHAPES / "trl_conversational.jsonl").read_text()
            .splitlines()]
    assert marked == [t for p in rows for response in (p.chosen, p.rejected) for t in expected_trained_text(response)]
