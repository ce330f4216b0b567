"""The eos list a merged model is served with: the template's end-of-turn token(s) first, then the tokenizer's eos
and the base's own, for the shipped templates and the 20 family stand-ins."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import GenerationConfig

from qlora_train.export.generate import Answer, ChatModel, answer, greedy
from qlora_train.export.stop_tokens import eos_ids, serving_generation_config, stop_tokens
from tests.masking.families import FAMILIES, family_tokenizer

# every family's tokenizer on two vocabularies (~35 s on 2 cores): make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

SHIPPED_END_OF_TURN = {"qwen3": "<|im_end|>", "qwen3.5": "<|im_end|>", "qwen2.5": "<|im_end|>",
                       "chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}


@pytest.mark.parametrize("name", SHIPPED_END_OF_TURN)
def test_shipped_templates_stop_at_their_end_of_turn_token(family_tokenizers, name):
    tok = family_tokenizers[name]
    marker = tok.convert_tokens_to_ids(SHIPPED_END_OF_TURN[name])
    base_eos = tok.convert_tokens_to_ids("<|endoftext|>")
    gen = serving_generation_config(GenerationConfig(eos_token_id=base_eos, temperature=0.7, do_sample=True), tok)
    assert gen.eos_token_id[0] == marker
    assert set(gen.eos_token_id) == {marker, tok.eos_token_id, base_eos}
    assert gen.temperature == 0.7 and gen.do_sample  # sampling settings stay the base's
    assert gen.pad_token_id == tok.pad_token_id


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_end_marker_ends_with_a_stop_token(qwen_tokenizer_dir, name):
    """A marker of several tokens (Command R7B's ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``) stops at its last."""
    tok = family_tokenizer(qwen_tokenizer_dir, name)
    stops = stop_tokens(tok)
    family = FAMILIES[name]
    markers = family.end_markers if family.supports_tools else family.end_markers[:1]  # a call turn's: with tools
    expected = [tok.encode(m, add_special_tokens=False)[-1] for m in markers]
    assert stops == (tuple(dict.fromkeys([*expected, tok.eos_token_id])), ())


def test_an_end_marker_of_plain_text_is_a_stop_string(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}### {{ m.role }}: {{ m.content }} ###END\n{% endfor %}"
                         "{% if add_generation_prompt %}### assistant: {% endif %}")
    assert stop_tokens(tok) == ((tok.eos_token_id,), ("###END",))


def test_eos_ids_reads_an_id_a_list_or_none():
    assert eos_ids(GenerationConfig(eos_token_id=3)) == [3]
    assert eos_ids(GenerationConfig(eos_token_id=[3, 4])) == [3, 4]
    assert eos_ids(GenerationConfig()) == []


def test_greedy_clears_sampling():
    gen = greedy(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, eos_token_id=[1]))
    assert not gen.do_sample and gen.temperature is None and gen.top_p is None and gen.top_k is None
    assert gen.eos_token_id == [1]


@dataclass
class ScriptedModel:
    """Generates the given ids after any prompt (at most max_new_tokens), like a model would."""

    new_ids: list[int]
    device: str = "cpu"

    def generate(self, input_ids, attention_mask, generation_config, tokenizer=None):
        assert not generation_config.do_sample
        new = self.new_ids[:generation_config.max_new_tokens]
        return torch.cat([input_ids, torch.tensor([new])], dim=1)


def test_answer_drops_the_stop_token_or_string_and_says_whether_it_stopped(qwen3_tok):
    from qlora_train.tiny import build_qwen_tokenizer

    ids = qwen3_tok.encode("Hello!", add_special_tokens=False)
    im_end, gen = qwen3_tok.convert_tokens_to_ids("<|im_end|>"), greedy(GenerationConfig(eos_token_id=[151645]))
    model = ChatModel(ScriptedModel([*ids, im_end]), qwen3_tok, gen, "scripted")
    assert answer(model, [{"role": "user", "content": "hi"}]) == Answer("Hello!", (*ids, im_end), True)
    assert answer(model, [{"role": "user", "content": "hi"}], max_new_tokens=2) == Answer("Hello!", tuple(ids), False)

    plain = build_qwen_tokenizer()
    plain.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }} ###END\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant: {% endif %}")
    end = plain.encode(" ###END", add_special_tokens=False)
    model = ChatModel(ScriptedModel([*ids, *end]), plain, gen, "scripted")
    assert answer(model, [{"role": "user", "content": "hi"}]) == Answer("Hello! ", (*ids, *end), True)


def test_a_new_end_marker_token_is_stopped_at_by_id(qwen_tokenizer_dir, foreign_template):
    """With its markers plain text the foreign template's end marker is a stop string; once model.new_tokens
    adds it, a stop id, first in the list."""
    from qlora_train.config import ModelConfig
    from qlora_train.tokenizer import load_tokenizer

    cfg = ModelConfig(name_or_path=str(qwen_tokenizer_dir), chat_template=str(foreign_template))
    plain = load_tokenizer(cfg)
    assert stop_tokens(plain) == ((plain.eos_token_id,), ("<|turn_close|>",))
    tok = load_tokenizer(cfg.model_copy(update={"new_tokens": "auto"}))
    assert stop_tokens(tok) == ((tok.convert_tokens_to_ids("<|turn_close|>"), tok.eos_token_id), ())
