"""The data section of the YAML: per-source keys, aliases, relative paths, per-source overrides."""

from __future__ import annotations

import pytest

from qlora_train.config import ConfigError, DataConfig, DatasetSource, load_config


def test_yaml_sources_with_lists_aliases_and_relative_paths(tmp_path):
    (tmp_path / "data").mkdir()
    for name in ("a.jsonl", "b.jsonl", "e.jsonl"):
        (tmp_path / "data" / name).write_text("{}\n")
    (tmp_path / "run.yaml").write_text(
        "model: {name_or_path: x}\n"
        "data:\n"
        "  schema: alpaca\n"
        "  mixing: {seed: 3, stopping_strategy: first_exhausted}\n"
        "  datasets:\n"
        "    - {path: [data/a.jsonl, data/b.jsonl], weight: 2, schema: sharegpt, max_items: 5}\n"
        "    - {path: 'data/*.jsonl', weight: 1, roles: {assistant: [bot]}}\n"
        "    - {path: org/hub-set, weight: 1, name: main, split: 'train[:10]'}\n"
        "  eval_datasets: [{path: data/e.jsonl}]\n"
    )
    cfg = load_config(tmp_path / "run.yaml").data
    a, glob, hub = cfg.datasets
    assert a.path == [str(tmp_path / "data/a.jsonl"), str(tmp_path / "data/b.jsonl")] and a.max_samples == 5
    assert glob.path == str(tmp_path / "data/*.jsonl") and hub.path == "org/hub-set"  # not on disk: kept as written
    assert cfg.eval_datasets[0].path == str(tmp_path / "data/e.jsonl")
    assert cfg.dataset_schema == "alpaca" and cfg.mixing.stopping_strategy == "first_exhausted"
    assert cfg.for_source(a).dataset_schema == "sharegpt" and cfg.for_source(glob).dataset_schema == "alpaca"
    assert cfg.for_source(glob).roles == {"assistant": ["bot"]} and cfg.for_source(a).roles == {}


@pytest.mark.parametrize("text, problem", [
    ("data: {datasets: [{path: a, weight: 1}, {path: b}]}", "data.datasets: set `weight` on every source"),
    ("data: {eval_fraction: 0.1, eval_datasets: [{path: a}]}", "data.eval_datasets: set eval_fraction or"),
    ("data: {datasets: [{path: a, schema: chatml}]}", "data.datasets[0].schema: Input should be 'auto'"),
    ("data: {train_on_eos: sometimes}", "data.train_on_eos: Input should be 'turn'"),
    ("data: {mask: {user: maybe}}", "data.mask.user: Input should be 'train' or 'mask'"),
    ("data: {mixing: {stopping_strategy: never}}", "data.mixing.stopping_strategy: Input should be"),
    ("data: {datasets: [{path: a, handlers: [{nme: f}]}]}", "data.datasets[0].handlers[0].nme: unknown key"),
])
def test_bad_data_configs_name_the_key(tmp_path, text, problem):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {name_or_path: x}\n" + text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert any(p.startswith(problem) for p in err.value.problems), err.value.problems


def test_mask_rules_decide_roles():
    from qlora_train.masking.policy import LossPolicy

    default = LossPolicy.of(DataConfig())
    assert default.trains_role("assistant") and not default.trains_role("user")
    policy = LossPolicy.of(DataConfig(mask={"user": "train", "system": "mask"}, mask_default="train"))
    assert [policy.trains_role(r) for r in ("user", "system", "assistant", "knowledge")] == [True, False, True, True]
    assert DatasetSource(path="x").paths == ["x"] and DatasetSource(path=["x", "y"]).paths == ["x", "y"]
