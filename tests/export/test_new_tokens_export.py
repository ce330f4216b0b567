"""--merge and --generate of a run whose template markers model.new_tokens added: the base grown to the saved
tokenizer before the adapter is applied, the merged model with the grown vocabulary and the trained rows, and
answers that stop at the new end-of-turn token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.export.generate import answer, load_chat_model
from qlora_train.export.merge import MERGE_INFO

from ..conftest import FOREIGN_MARKERS

pytestmark = pytest.mark.slow
OLD_ROWS, ROWS = 151669, 151680  # the base's rows; grown for two tokens to a multiple of 64
TURN_OPEN, TURN_CLOSE = 151669, 151670
ENDOFTEXT = 151643
SAY_HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def merged(new_tokens_hello_run, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("merge-new-tokens") / "merged"
    assert main(["--config", new_tokens_hello_run, "--merge", "--merge-dir", str(dest)]) == 0
    return dest


def test_the_merged_model_has_the_grown_vocabulary_and_the_trained_rows(new_tokens_hello_run, merged,
                                                                          foreign_base_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(merged)
    assert model.config.vocab_size == ROWS and not model.config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(merged)
    assert [tok.convert_tokens_to_ids(t) for t in FOREIGN_MARKERS] == [TURN_OPEN, TURN_CLOSE] and len(tok) == 151671
    base = load_file(foreign_base_dir / "model.safetensors")
    rows = load_file(Path(load_config(new_tokens_hello_run).train.output_dir) / "adapter_model.safetensors")
    for matrix, base_key, module in ((model.get_input_embeddings().weight, "model.embed_tokens.weight",
                                      "model.embed_tokens"), (model.get_output_embeddings().weight,
                                                              "lm_head.weight", "lm_head")):
        assert matrix.shape == (ROWS, 64)
        assert torch.equal(matrix[:OLD_ROWS], base[base_key])  # the base's rows, untouched
        trained = rows[f"base_model.model.{module}.token_adapter.trainable_tokens_delta"]
        assert torch.equal(matrix[TURN_OPEN:TURN_CLOSE + 1], trained)  # the trained rows
        padding = base[base_key].mean(dim=0).expand(ROWS - TURN_CLOSE - 1, -1)
        torch.testing.assert_close(matrix[TURN_CLOSE + 1:], padding, rtol=0, atol=1e-6)
    info = json.loads((merged / MERGE_INFO).read_text())
    assert info["eos_tokens"][0] == "<|turn_close|>" and info["stop_strings"] == []


def test_merged_logits_equal_base_plus_adapter(new_tokens_hello_run, merged):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qlora_train.export.adapter import fit_base_to_adapter
    from qlora_train.train.model import load_base_model, resolve_runtime

    cfg = load_config(new_tokens_hello_run)
    out = Path(cfg.train.output_dir)
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template(SAY_HI + [{"role": "assistant", "content": "Hello!"}], tokenize=False)
    inputs = tok(text, add_special_tokens=False, return_tensors="pt")
    assert inputs["input_ids"][0].tolist().count(TURN_CLOSE) == 2
    base = load_base_model(cfg.model, resolve_runtime(cfg), quantized=False).eval()
    fit_base_to_adapter(base, out, tok)
    with torch.no_grad():
        reference = PeftModel.from_pretrained(base, out).eval()(**inputs).logits
        got = AutoModelForCausalLM.from_pretrained(merged).eval()(**inputs).logits
    assert got.shape[-1] == ROWS
    assert (got - reference).abs().max().item() < 1e-4


def test_generate_answers_and_stops_at_the_new_end_marker(new_tokens_hello_run, capsys):
    chat = load_chat_model(load_config(new_tokens_hello_run))
    assert chat.generation_config.eos_token_id[0] == TURN_CLOSE
    reply = answer(chat, SAY_HI, max_new_tokens=16)
    assert reply.stopped and reply.text == "Hello!" and reply.token_ids[-1] == TURN_CLOSE
    assert main(["--config", new_tokens_hello_run, "--generate", "Say hi", "--max-new-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello!\n" and "no end-of-turn token" not in captured.err


def test_the_merged_directory_answers_and_stops_as_served(new_tokens_hello_run, merged, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["--config", new_tokens_hello_run, "--generate", "Say hi", "--merged", "--merge-dir", str(merged),
                 "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == "Hello!\n"
    model, tok = AutoModelForCausalLM.from_pretrained(merged), AutoTokenizer.from_pretrained(merged)
    inputs = tok.apply_chat_template(SAY_HI, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16)  # its own generation_config.json: eos first the marker
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert new[-1] == TURN_CLOSE and tok.decode(new) == "Hello!<|turn_close|>"
    assert tok.decode(new, skip_special_tokens=True) == "Hello!"
