"""train.packing / train.group_by_length wiring, without training."""

from __future__ import annotations

import datasets
import pytest
import torch

from qlora_train.config import Config, ConfigError
from qlora_train.data.prepared import pack_or_group
from qlora_train.train.collator import PackedCollator, PadCollator
from qlora_train.train.model import resolve_runtime
from qlora_train.train.run import make_collator, training_arguments


def small_split():
    return datasets.Dataset.from_dict({
        "input_ids": [[1] * 5, [2] * 3, [3] * 4], "attention_mask": [[1] * 5, [1] * 3, [1] * 4],
        "labels": [[1] * 5, [2] * 3, [3] * 4]})


def config(**train):
    return Config.model_validate({"model": {"name_or_path": "x"}, "data": {"max_length": 8},
                                  "train": {"report_to": "none", **train}})


def test_group_by_length_adds_lengths_and_picks_the_sampler(tmp_path):
    cfg = config(group_by_length=True, output_dir=str(tmp_path))
    train_ds, eval_ds, stats = pack_or_group(cfg, small_split(), None)
    assert train_ds["length"] == [5, 3, 4] and eval_ds is None and stats is None
    assert training_arguments(cfg, resolve_runtime(cfg), False).train_sampling_strategy == "group_by_length"
    assert training_arguments(config(output_dir=str(tmp_path)), resolve_runtime(cfg),
                              False).train_sampling_strategy == "random"


def test_packing_packs_both_splits_into_max_length_by_default():
    cfg = config(packing=True)
    train_ds, eval_ds, stats = pack_or_group(cfg, small_split(), small_split())
    assert train_ds["seq_lens"] == [[5, 3], [4]] == eval_ds["seq_lens"]
    assert (stats.sequences, stats.capacity, stats.tokens) == (2, 8, 12)


def test_an_example_over_packing_length_is_a_config_error_unless_split_long():
    with pytest.raises(ConfigError, match="train.packing_length: example 0 has 5 tokens, more than the packing "
                                          "capacity 4"):
        pack_or_group(config(packing=True, packing_length=4), small_split(), None)
    train_ds, _, stats = pack_or_group(config(packing=True, packing_length=4, split_long=True), small_split(), None)
    assert train_ds["seq_lens"] == [[4], [4], [3, 1]] and stats.tokens == 12


class FakeModel:
    def __init__(self, attn, **config):
        self.config = type("C", (), {"_attn_implementation": attn, **config})()


def test_packing_refuses_models_whose_layers_would_mix_examples():
    from transformers import Qwen3Config

    from qlora_train.train.run import check_packing_support

    check_packing_support(Qwen3Config(num_hidden_layers=2), 4096)  # full attention only: fine
    with pytest.raises(ConfigError, match="linear_attention layers"):
        check_packing_support(Qwen3Config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
                              4096)
    sliding = Qwen3Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=1024, max_window_layers=1)
    assert "sliding_attention" in sliding.layer_types
    check_packing_support(sliding, 1024)
    with pytest.raises(ConfigError, match="packing_length <= 1024"):
        check_packing_support(sliding, 2048)


def test_packing_support_is_checked_from_the_model_config_before_the_data_or_any_weight(tmp_path, monkeypatch):
    """A model directory holding only config.json: train() refuses packing before it reads data or weights."""
    from transformers import Qwen3Config

    from qlora_train.train import run

    Qwen3Config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]).save_pretrained(tmp_path)
    loaded = []
    for name in ("load_tokenizer_with_new_tokens", "training_data", "load_model"):
        monkeypatch.setattr(run, name, lambda *a, name=name, **k: loaded.append(name))
    cfg = Config.model_validate({"model": {"name_or_path": str(tmp_path)}, "data": {"max_length": 64},
                                 "train": {"report_to": "none", "packing": True, "output_dir": str(tmp_path / "o")}})
    with pytest.raises(ConfigError, match="linear_attention layers"):
        run.train(cfg)
    assert loaded == []


def test_collator_follows_the_attention_implementation():
    runtime = resolve_runtime(config())
    tok = type("T", (), {"pad_token_id": 0})()
    assert isinstance(make_collator(config(), tok, FakeModel("sdpa"), runtime), PadCollator)
    sdpa = make_collator(config(packing=True), tok, FakeModel("sdpa"), runtime)
    eager = make_collator(config(packing=True), tok, FakeModel("eager"), runtime)
    assert (sdpa.attention, sdpa.mask_dtype) == ("mask", torch.bool)
    assert (eager.attention, eager.mask_dtype) == ("mask", torch.float32)
    # flash-attention needs CUDA; on CPU the collator falls back to a mask
    flash = make_collator(config(packing=True), tok, FakeModel("flash_attention_2"), runtime)
    assert isinstance(flash, PackedCollator) and flash.attention == ("position_ids" if runtime.device == "cuda"
                                                                      else "mask")
