"""Preference training: config keys refused with the fix named."""

from __future__ import annotations

import pytest

from qlora_train.config import ConfigError, load_config


@pytest.mark.parametrize("train, model, message", [
    ("{method: dpo, packing: true}", "", "train.packing: method: dpo trains each pair as two padded rows"),
    ("{method: orpo, group_by_length: true}", "", "train.group_by_length: not available with method: orpo"),
    ("{method: dpo, dpo_loss: ipo, label_smoothing: 0.1}", "",
     "train.label_smoothing: applies to method: dpo with dpo_loss: sigmoid only"),
    ("{method: kto}", "", "train.method: Input should be 'sft', 'dpo' or 'orpo'"),
    ("{method: sft}", ", adapter_path: ADAPTER", "model.adapter_path: starts preference training"),
], ids=["packing", "group-by-length", "label-smoothing-ipo", "unknown-method", "adapter-path-sft"])
def test_preference_config_errors_name_the_fix(tmp_path, train, model, message):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    (tmp_path / "adapter").mkdir()
    text = (f"model: {{name_or_path: Qwen/Qwen3-0.6B{model.replace('ADAPTER', str(tmp_path / 'adapter'))}}}\n"
            f"data: {{datasets: [{{path: {tmp_path / 'd.jsonl'}}}]}}\ntrain: {train}\n")
    (tmp_path / "cfg.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.yaml")
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems
