"""The model's own chat template by default: a Llama 3 model with no chat_template key trains with its own
template, and the tokenizer saved with the adapter serves what training rendered."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from qlora_train.chat_templates import resolve_chat_template, shipped_templates, with_template_kwargs
from qlora_train.cli import main
from qlora_train.config import Config, ModelConfig
from qlora_train.tokenizer import load_tokenizer
from qlora_train.train.run import save_final_outputs, template_note

# loads models with their templates: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "configs" / "data" / "quickstart.jsonl"
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama3_style_tokenizer():
    """The Qwen vocabulary with Llama 3's special tokens and the shipped llama3 template as its own."""
    from qlora_train.tiny import build_qwen_tokenizer

    tok = build_qwen_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = resolve_chat_template("llama3")
    return tok


@pytest.fixture(scope="module")
def llama3_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3-tokenizer")
    llama3_style_tokenizer().save_pretrained(path)
    return path


def test_a_llama3_tokenizer_keeps_its_own_template(llama3_tokenizer_dir):
    tok = load_tokenizer(ModelConfig(name_or_path=str(llama3_tokenizer_dir)))
    assert tok.chat_template == resolve_chat_template("llama3") != resolve_chat_template("qwen3")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>" \
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"
    named = load_tokenizer(ModelConfig(name_or_path=str(llama3_tokenizer_dir), chat_template="chatml"))
    assert named.chat_template == resolve_chat_template("chatml")  # a named template replaces it


def test_a_tokenizer_without_a_template_is_a_config_error_naming_the_choices(tmp_path, capsys):
    tok = llama3_style_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_text(SAMPLE.read_text().splitlines()[0] + "\n")
    cfg = {"model": {"name_or_path": str(tmp_path / "tok")},
           "data": {"datasets": [{"path": str(tmp_path / "d.jsonl")}]},
           "train": {"output_dir": str(tmp_path / "out"), "report_to": "none"}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "cfg.yaml")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "invalid config:",
        f"  model.chat_template: the tokenizer has no chat template: name one of {shipped_templates()} "
        "or a .jinja path"]


def test_the_summary_names_the_template():
    assert template_note(ModelConfig(name_or_path="m")) == "tokenizer's own"
    assert template_note(ModelConfig(name_or_path="m", chat_template="qwen3", chat_template_kwargs={
        "enable_thinking": False, "reasoning_effort": "low"})) == 'qwen3, enable_thinking=false, reasoning_effort="low"'


class StubTrainer:
    """What save_final_outputs reads of a Trainer (the adapter itself is not under test here)."""

    def __init__(self):
        self.state = SimpleNamespace(log_history=[], global_step=1,
                                     save_to_json=lambda path: Path(path).write_text("{}"))

    def save_model(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)


def test_the_saved_tokenizer_serves_the_template_training_used(llama3_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    kwargs = {"enable_thinking": False, "date_string": "26 Jul 2024"}
    model = ModelConfig(name_or_path=str(llama3_tokenizer_dir), chat_template_kwargs=kwargs)
    cfg = Config(model=model, train={"output_dir": str(tmp_path / "out")})
    tok = load_tokenizer(cfg.model)
    assert tok.chat_template == with_template_kwargs(resolve_chat_template("llama3"), kwargs)
    save_final_outputs(StubTrainer(), tok, cfg, tmp_path / "out", main=True)
    out = tmp_path / "out"
    assert (out / "chat_template.jinja").read_text() == tok.chat_template
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template
    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert saved["chat_template"] is None and saved["chat_template_kwargs"] == kwargs


@pytest.mark.slow
def test_a_llama3_model_with_no_chat_template_key_trains_with_its_own_template(tmp_path, llama3_tokenizer_dir):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(llama3_tokenizer_dir)
    model_dir = tmp_path / "tiny-llama3"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    cfg = {"model": {"name_or_path": str(model_dir)},  # no chat_template key
           "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
           "data": {"datasets": [{"path": str(SAMPLE), "max_samples": 8}], "max_length": 128},
           "train": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "per_device_train_batch_size": 2,
                     "save_steps": 2, "logging_steps": 1, "report_to": "none", "gradient_checkpointing": False}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "cfg.yaml")]) == 0
    out = tmp_path / "out"
    assert (out / "chat_template.jinja").read_text() == resolve_chat_template("llama3")
    assert AutoTokenizer.from_pretrained(out).chat_template == resolve_chat_template("llama3")
    report = json.loads((out / "dataset_report.json").read_text())
    assert report["rows_in"] == report["rows_kept"] == 8, report
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["chat_template"] is None
