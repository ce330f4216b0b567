"""A tiny Mistral 3 (``tiny --vision mistral3``: the Llama 3 vocabulary with Mistral 3's tokens, a Pixtral tower
merged 2x2) trains the demo's image rows: its tower not quantised and frozen, ``pixel_values`` padded to the
batch's largest image with ``image_sizes`` beside them, the loss falling; and a DPO step on image pairs feeds both
sides the prompt's images (``image_sizes`` through the pair forward)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vision_rows import write_vl_config

DEMO_ROWS = Path(__file__).resolve().parents[2] / "configs" / "data" / "quickstart-vl.jsonl"
DEMO_PAIRS = DEMO_ROWS.with_name("quickstart-vl-dpo.jsonl")


@pytest.fixture(scope="module")
def tiny_mistral3_dir(tmp_path_factory, real_vocab_dir):
    from qlora_train.tiny import build_tiny_vl

    real_vocab_dir("llama3")
    return build_tiny_vl("mistral3", tmp_path_factory.mktemp("tiny-mistral3"), hidden_size=32)


@pytest.mark.slow
def test_mistral3_trains_the_bundled_image_rows(tiny_mistral3_dir, tmp_path):
    from qlora_train.cli import main

    path = write_vl_config(tmp_path, tiny_mistral3_dir, data_path=DEMO_ROWS, max_samples=8, max_steps=4)
    assert main(["--config", str(path), "--set", "model.chat_template=mistral3"]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "dataset_report.json").read_text())["rows_kept"] == 8
    losses = [h["loss"] for h in json.loads((out / "loss_history.json").read_text())]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert json.loads((out / "adapter_config.json").read_text())["exclude_modules"] == r"model\.vision_tower\..*"


@pytest.mark.slow
def test_mistral3_dpo_on_image_pairs_starts_at_log_2(tiny_mistral3_dir, tmp_path):
    import math

    from qlora_train.cli import main

    path = write_vl_config(tmp_path, tiny_mistral3_dir, data_path=DEMO_PAIRS, max_samples=8, max_steps=2,
                           method="dpo")
    assert main(["--config", str(path), "--set", "model.chat_template=mistral3"]) == 0
    losses = [h["loss"] for h in json.loads((tmp_path / "out" / "loss_history.json").read_text())]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)
