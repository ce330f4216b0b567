"""A model repository's own code (``auto_map`` in its config) is never run with ``model.trust_remote_code: false``
(docs/trust.md): a model type transformers knows loads with its built-in classes, the shipped code ignored; an
unknown one is refused in one line that says why, not with a traceback."""

from __future__ import annotations

import json

import pytest

from qlora_train.config import Config
from qlora_train.errors import ModelLoadError
from qlora_train.train.model import load_base_model, load_model_config, resolve_runtime

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 128}


def repository(folder, model_type: str, flag):
    """A model folder whose config names its own code, which leaves ``flag`` behind when it is imported."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if model_type == "qwen3":
        Qwen3ForCausalLM(Qwen3Config(**SMALL)).save_pretrained(folder)
    folder.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text()) if model_type == "qwen3" else {}
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type, "auto_map": {
        "AutoConfig": "shipped.ShippedConfig", "AutoModelForCausalLM": "shipped.ShippedModel"}}))
    (folder / "shipped.py").write_text(f"open({str(flag)!r}, 'w').write('ran')\n"
                                       "from transformers import Qwen3Config as ShippedConfig\n"
                                       "from transformers import Qwen3ForCausalLM as ShippedModel\n")
    return folder


def config(folder) -> Config:
    return Config(model={"name_or_path": str(folder), "load_in_4bit": False}, data={"datasets": [{"path": "d"}]},
                  train={"output_dir": "unused"})


@pytest.mark.slow  # saves and loads a model (seconds)
def test_a_known_model_type_loads_with_the_built_in_classes_and_its_code_never_runs(tmp_path):
    flag = tmp_path / "ran"
    cfg = config(repository(tmp_path / "m", "qwen3", flag))
    assert type(load_model_config(cfg.model)).__name__ == "Qwen3Config"
    model = load_base_model(cfg.model, resolve_runtime(cfg), quantized=False)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not flag.exists()


def test_an_unknown_model_type_with_its_own_code_is_one_line(tmp_path):
    flag = tmp_path / "ran"
    cfg = config(repository(tmp_path / "m", "shippedmodel", flag))
    with pytest.raises(ModelLoadError) as err:
        load_model_config(cfg.model)
    assert str(err.value) == (
        f"cannot load the model config of {tmp_path / 'm'}: its config names its own code (auto_map) for a model "
        "type transformers does not know, and model.trust_remote_code is false, so that code is not run; set "
        "model.trust_remote_code: true only for a repository whose code you would run yourself (docs/trust.md)")
    assert not flag.exists()
