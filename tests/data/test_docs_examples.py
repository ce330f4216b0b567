"""Every format example in docs/datasets.md builds: its JSON row through its YAML, one kept row each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from qlora_train.config import DataConfig
from qlora_train.data.dataset import build_datasets

DOC = Path(__file__).resolve().parents[2] / "docs" / "datasets.md"


def format_examples() -> list[tuple[str, str, str]]:
    """(section title, JSON row, YAML) for each ``###`` section under "Dataset formats"."""
    text = DOC.read_text().split("## Dataset formats", 1)[1].split("\n## ", 1)[0]
    out = []
    for section in text.split("\n### ")[1:]:
        title = section.split("\n", 1)[0]
        row = re.search(r"```json\n(.*?)\n```", section, re.S).group(1)
        config = re.search(r"```yaml\n(.*?)\n```", section, re.S).group(1)
        out.append((title, row, config))
    return out


def test_every_format_has_an_example():
    titles = " ".join(t for t, _, _ in format_examples())
    for name in ("messages", "sharegpt", "prompt_response", "alpaca", "bare list", "segments", "pretokenized",
                 "text"):
        assert name in titles


@pytest.mark.parametrize("title, row, config", format_examples(), ids=[t for t, _, _ in format_examples()])
def test_doc_example_builds(tmp_path, qwen3_tok, title, row, config):
    path = tmp_path / "rows.jsonl"
    path.write_text(row + "\n")
    data = yaml.safe_load(config)["data"]
    assert len(data["datasets"]) == 1
    data["datasets"][0]["path"] = str(path)
    train, _, report = build_datasets(DataConfig.model_validate(data), qwen3_tok)
    assert report.rows_kept == 1 and report.dropped == {}, report.first_dropped
    assert any(lab != -100 for lab in train[0]["labels"])
