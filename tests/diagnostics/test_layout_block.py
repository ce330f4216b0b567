"""Through the CLI: --stats-only and --debug-samples print the template's layout as YAML and write it to
template_layout.yaml; pasted into the config (or given with --set) it is the layout the rows are verified
against; a wrong one is refused row by row, a misspelt part is a config error (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qlora_train.cli import main

# runs --stats-only twice through the CLI: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def quickstart(tmp_path, qwen_tokenizer_dir):
    """configs/quickstart.yaml on the Qwen tokenizer alone (its tiny model is what `make demo` builds)."""
    tree = yaml.safe_load((REPO / "configs/quickstart.yaml").read_text())
    tree["model"]["name_or_path"] = str(qwen_tokenizer_dir)
    tree["data"]["datasets"][0]["path"] = str(REPO / "configs/data/quickstart.jsonl")
    tree["data"]["cache_dir"] = str(tmp_path / "cache")
    tree["train"]["output_dir"] = str(tmp_path / "out")
    return tree


def write(tmp_path: Path, tree: dict, name: str) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree, sort_keys=False, allow_unicode=True))
    return str(path)


def block(printed: str) -> str:
    """The layout block of the CLI's output: from its heading to the line saying where it was written."""
    text = printed.split("== template layout\n", 1)[1]
    return text[:text.index("wrote ")]


def test_stats_only_prints_the_layout_and_the_pasted_block_gives_the_same_rows(quickstart, tmp_path, capsys):
    plain = write(tmp_path, quickstart, "plain.yaml")
    assert main(["--config", plain, "--stats-only", "--stats-dir", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    shown = block(printed)
    assert shown == (tmp_path / "a" / "template_layout.yaml").read_text()
    assert '    end_markers: ["<|im_end|>"]' in shown and "# declared" not in shown
    layout = yaml.safe_load(shown)["model"]["template_layout"]

    quickstart["model"].update(template_layout=layout)  # pasted under model:
    declared = write(tmp_path, quickstart, "declared.yaml")
    assert main(["--config", declared, "--stats-only", "--stats-dir", str(tmp_path / "b")]) == 0
    again = block(capsys.readouterr().out)
    assert yaml.safe_load(again) == yaml.safe_load(shown)
    assert all(line.endswith("# declared") for line in again.splitlines() if line.startswith("    "))
    stats = [json.loads((tmp_path / d / "stats.json").read_text()) for d in ("a", "b")]
    assert stats[0] == stats[1] and stats[0]["overall"]["rows_kept"] > 40


def test_a_wrong_declaration_with_set_is_refused_row_by_row(quickstart, tmp_path, capsys):
    config = write(tmp_path, quickstart, "c.yaml")
    code = main(["--config", config, "--debug-samples", "1", "--debug-refused", "--stats-dir", str(tmp_path / "d"),
                 "--set", "model.template_layout={end_markers: ['<|wrong|>']}"])
    printed = capsys.readouterr().out
    assert code == 0
    assert '    end_markers: ["<|wrong|>"]' in block(printed)
    assert '# declared; the probe found ["<|im_end|>"]' in block(printed)
    assert "refused: mask_unverified:" in printed and "end-of-turn marker ['<|wrong|>'] not found" in printed
    assert (tmp_path / "d" / "template_layout.yaml").read_text() == block(printed)


def test_a_misspelt_part_is_a_config_error(quickstart, tmp_path, capsys):
    config = write(tmp_path, quickstart, "c.yaml")
    code = main(["--config", config, "--stats-only", "--set", "model.template_layout={end_marker: ['<|im_end|>']}"])
    assert code == 2
    assert "model.template_layout.end_marker: unknown key (did you mean 'end_markers'?)" in capsys.readouterr().err
