"""--generate / --chat on the tiny base-like model trained to answer "Say hi" with "Hello!": greedy, rendered
with the training template, and stopping at <|im_end|>, which its tokenizer does not call eos."""

from __future__ import annotations

import pytest

from qlora_train.cli import main
from qlora_train.config import load_config
from qlora_train.export.generate import answer, chat_loop, load_chat_model

pytestmark = pytest.mark.slow
IM_END, ENDOFTEXT = 151645, 151643
SAY_HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def chat_model(hello_run):
    return load_chat_model(load_config(hello_run))


def test_generate_prints_the_trained_answer(hello_run, capsys):
    assert main(["--config", hello_run, "--generate", "Say hi", "--max-new-tokens", "16"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "Hello!\n"
    assert "no end-of-turn token" not in captured.err


def test_the_answer_ends_at_the_end_of_turn_token(chat_model):
    assert chat_model.tokenizer.eos_token_id == ENDOFTEXT  # a base model's tokenizer: not the turn's end
    reply = answer(chat_model, SAY_HI, max_new_tokens=16)
    assert reply.stopped and reply.text == "Hello!"
    assert reply.token_ids[-1] == IM_END and len(reply.token_ids) < 16


def test_without_the_end_of_turn_token_in_eos_it_runs_past_it(chat_model):
    """What the export prevents: with the base's own generation config the same model writes <|im_end|> and
    goes on to max_new_tokens."""
    import copy
    from dataclasses import replace

    gen = copy.deepcopy(chat_model.generation_config)
    gen.eos_token_id = [ENDOFTEXT]
    reply = answer(replace(chat_model, generation_config=gen), SAY_HI, max_new_tokens=16)
    stop_at = answer(chat_model, SAY_HI, max_new_tokens=16).token_ids
    assert reply.token_ids[:len(stop_at)] == stop_at  # the same greedy answer, through <|im_end|>
    assert not reply.stopped and len(reply.token_ids) == 16


def test_generate_with_the_merged_model_gives_the_same_answer(hello_run, tmp_path, capsys):
    merged = str(tmp_path / "merged")
    assert main(["--config", hello_run, "--merge", "--merge-dir", merged, "--generate", "Say hi", "--merged",
                 "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == f"merged model written to {merged}\nHello!\n"


def test_plain_transformers_generate_on_the_merged_directory_stops_at_end_of_turn(hello_run, tmp_path):
    """What a server does with the directory: its own generation_config.json, no settings passed."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = tmp_path / "merged"
    assert main(["--config", hello_run, "--merge", "--merge-dir", str(merged)]) == 0
    assert json.loads((merged / "generation_config.json").read_text())["_from_model_config"] is False
    model, tok = AutoModelForCausalLM.from_pretrained(merged), AutoTokenizer.from_pretrained(merged)
    inputs = tok.apply_chat_template(SAY_HI, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16)
    new = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert tok.decode(new) == "Hello!<|im_end|>"


def test_generate_from_a_checkpoint(hello_run, capsys):
    assert main(["--config", hello_run, "--generate", "Say hi", "--checkpoint", "30", "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == "Hello!\n"


def test_chat_keeps_the_conversation_until_an_empty_line(chat_model, monkeypatch):
    lines, prompts, written, rendered = iter(["Say hi", "Say hi", ""]), [], [], []

    def read(prompt):
        prompts.append(prompt)
        return next(lines)

    real = chat_model.tokenizer.apply_chat_template
    monkeypatch.setattr(chat_model.tokenizer, "apply_chat_template",
                        lambda messages, **kw: rendered.append(list(messages)) or real(messages, **kw))
    chat_loop(chat_model, max_new_tokens=16, read=read, write=written.append)
    assert prompts == ["you> "] * 3 and len(written) == 2 and written[0] == "Hello!"
    assert rendered[1] == [*SAY_HI, {"role": "assistant", "content": "Hello!"}, *SAY_HI]


def test_generate_with_merged_before_merging_is_exit_2(hello_run, tmp_path, capsys):
    assert main(["--config", hello_run, "--generate", "hi", "--merged", "--merge-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"error: no merged model in {tmp_path / 'none'}: run --merge first (or drop --merged)")
