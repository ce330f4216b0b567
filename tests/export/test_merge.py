"""--merge on the tiny model: a loadable directory whose logits are base + adapter, whose tokenizer renders what
training rendered and whose generation config stops at the end-of-turn token; atomic; resumable runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.export.merge import MERGE_INFO
from qlora_train.tokenizer import load_tokenizer
from qlora_train.train.model import load_base_model, resolve_runtime

from .conftest import HELLO, hello_config

pytestmark = pytest.mark.slow
IM_END, ENDOFTEXT = 151645, 151643
CONVERSATION = [  # system, two exchanges, reasoning on the first answer
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


def rendered_ids(tokenizer, messages=CONVERSATION) -> dict:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def merged_cli(cfg_path, merge_dir, *extra) -> Path:
    assert main(["--config", cfg_path, "--merge", "--merge-dir", str(merge_dir), *extra]) == 0
    return Path(merge_dir)


@pytest.fixture(scope="module")
def merged(hello_run, tmp_path_factory) -> Path:
    """The hello run merged onto the original weights, in two shards."""
    return merged_cli(hello_run, tmp_path_factory.mktemp("merge") / "merged", "--max-shard-size", "30MB")


def test_merge_writes_a_standard_model_directory(hello_run, merged):
    from transformers import AutoModelForCausalLM

    names = {p.name for p in merged.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", MERGE_INFO} <= names
    assert sorted(n for n in names if n.endswith(".safetensors")) == ["model-00001-of-00002.safetensors",
                                                                     "model-00002-of-00002.safetensors"]
    assert not any(n.startswith("adapter") for n in names)
    assert not list(merged.parent.glob(".merged.*"))  # no staging or old directory left beside it
    config = json.loads((merged / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in n for n, _ in model.named_parameters())
    info = json.loads((merged / MERGE_INFO).read_text())
    out = load_config(hello_run).train.output_dir
    assert info["adapter"] == out and info["global_step"] == 30 and info["merge_base"] == "original"
    assert info["eos_tokens"] == ["<|im_end|>", "<|endoftext|>"]
    assert info["chat_template_kwargs"] == {"enable_thinking": False}


def test_generation_config_stops_at_the_end_of_turn_token_first(merged):
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(merged)
    assert gen.eos_token_id == [IM_END, ENDOFTEXT]  # the template's <|im_end|>, then the base's own eos
    assert gen.pad_token_id == ENDOFTEXT


def test_merged_logits_equal_base_plus_adapter(hello_run, merged):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_config(hello_run)
    inputs = rendered_ids(load_tokenizer(cfg.model))
    base = load_base_model(cfg.model, resolve_runtime(cfg), quantized=False).eval()
    base_logits = logits(base, inputs)
    with_adapter = PeftModel.from_pretrained(base, cfg.train.output_dir).eval()
    reference = logits(with_adapter, inputs)
    got = logits(AutoModelForCausalLM.from_pretrained(merged).eval(), inputs)
    assert got.dtype == torch.float32
    assert (got - reference).abs().max().item() < 1e-4
    assert (got - base_logits).abs().max().item() > 1e-2  # the adapter is not a no-op


def test_dequantized_merge_reproduces_the_4bit_forward_of_training(hello_run, merged, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_config(hello_run)
    path = merged_cli(hello_run, tmp_path / "deq", "--merge-base", "dequantized")
    assert json.loads((path / MERGE_INFO).read_text())["merge_base"] == "dequantized"
    inputs = rendered_ids(load_tokenizer(cfg.model))
    training = PeftModel.from_pretrained(load_base_model(cfg.model, resolve_runtime(cfg)), cfg.train.output_dir)
    # train mode (dropout is 0): bitsandbytes dequantises to float32 as in training; in eval mode its CPU
    # kernel computes in bfloat16
    training.train()
    reference = logits(training, inputs)
    got = logits(AutoModelForCausalLM.from_pretrained(path).eval(), inputs)
    assert (got - reference).abs().max().item() < 1e-4
    onto_original = logits(AutoModelForCausalLM.from_pretrained(merged).eval(), inputs)
    assert (got - onto_original).abs().max().item() > 1e-3  # the 4-bit rounding is in it


def test_saved_tokenizer_renders_what_training_rendered(hello_run, merged):
    from transformers import AutoTokenizer

    from qlora_train.data import process_rows

    cfg = load_config(hello_run)
    training_tok, saved = load_tokenizer(cfg.model), AutoTokenizer.from_pretrained(merged)
    assert saved.chat_template == training_tok.chat_template
    for messages, gen in ((CONVERSATION, False), (CONVERSATION[:4], True), (HELLO["messages"][:1], True)):
        kw = dict(tokenize=False, add_generation_prompt=gen)
        assert saved.apply_chat_template(messages, **kw) == training_tok.apply_chat_template(messages, **kw)
    prompt = saved.apply_chat_template(HELLO["messages"][:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking: false is baked in
    rows = [HELLO, {"messages": CONVERSATION}]
    assert process_rows(rows, saved, cfg.data) == process_rows(rows, training_tok, cfg.data)


def test_a_resumed_run_merges_to_the_uninterrupted_model(hello_run, merged, tmp_path, base_like_model_dir):
    from transformers import TrainerCallback

    from qlora_train.train.run import train

    class CrashAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 17:
                raise RuntimeError("simulated crash")

    path = hello_config(tmp_path / "run", base_like_model_dir, resume_from_checkpoint="auto")
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(load_config(path), callbacks=[CrashAt()])
    train(load_config(path))  # resumes from checkpoint-15
    final = merged_cli(path, tmp_path / "final")
    last = merged_cli(path, tmp_path / "last", "--checkpoint", "last")  # checkpoint-30, saved after the resume
    final_w, last_w = load_file(final / "model.safetensors"), load_file(last / "model.safetensors")
    assert final_w.keys() == last_w.keys() and all(torch.equal(final_w[k], last_w[k]) for k in final_w)
    reference = {}
    for shard in sorted(merged.glob("model-*.safetensors")):
        reference.update(load_file(shard))
    assert reference.keys() == final_w.keys()
    for name, weight in final_w.items():
        torch.testing.assert_close(weight, reference[name], rtol=0, atol=1e-6, msg=name)


def test_a_failed_write_keeps_the_previous_merge_whole(hello_run, tmp_path, monkeypatch, capsys):
    from transformers import PreTrainedModel

    dest = merged_cli(hello_run, tmp_path / "merged")
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    real_save = PreTrainedModel.save_pretrained

    def save_then_fail(self, directory, **kw):
        real_save(self, directory, **kw)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_fail)
    capsys.readouterr()
    assert main(["--config", hello_run, "--merge", "--merge-dir", str(dest)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write the merged model to {dest}: [Errno 28] No space left on device ({dest} was left " \
           "as it was)" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # the staging directory is gone
