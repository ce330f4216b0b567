"""model.chat_template_kwargs baked into the template as defaults; the tokenizer's own template by default."""

from __future__ import annotations

import copy
import datetime
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qlora_train.chat_templates import jinja_literal, split_template_kwargs, with_template_kwargs
from qlora_train.config import ConfigError
from qlora_train.data import get_chat_template, shipped_templates
from qlora_train.masking import template_layout
from qlora_train.masking.render import build_text_and_masks

# bakes templates into saved tokenizers and reloads them: make test (CI) runs it, make test-fast does not
pytestmark = pytest.mark.slow

USER = [{"role": "user", "content": "hi"}]
CHAT = USER + [{"role": "assistant", "content": "yo", "reasoning_content": "think"},
               {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def baked_value(value):
    """What a template sees for ``x`` when ``{x: value}`` is baked in (the jinja settings transformers uses)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(with_template_kwargs("", {"x": value})).module.x


@given(JSONISH)
def test_every_yaml_value_reaches_the_template_unchanged(value):
    assert baked_value(value) == value
    template = with_template_kwargs("{{ x }}", {"x": value})
    assert split_template_kwargs(template) == ({"x": value}, "{{ x }}")


def test_literals_are_jinja_literals():
    assert jinja_literal(False, "k") == "false" and jinja_literal(None, "k") == "none"
    assert jinja_literal([1, 2.5, True, {"a": "b"}], "k") == '[1, 2.5, true, {"a": "b"}]'
    tricky = "it's \"q\" \\ {% raw %} %} }} #} {# \n\té😀"
    assert jinja_literal(tricky, "k") == r'"it' + "'" + r's \"q\" \\ {% raw %} %} }} #} {# \n\té😀"'
    assert baked_value(tricky) == tricky


@pytest.mark.parametrize("key, value, why", [
    ("enable-thinking", False, "model.chat_template_kwargs.enable-thinking: is not a template variable name"),
    ("1st", 1, "model.chat_template_kwargs.1st: is not a template variable name"),
    ("true", 1, "model.chat_template_kwargs.true: is not a template variable name"),
    ("add_generation_prompt", True, "model.chat_template_kwargs.add_generation_prompt: is set by every render"),
    ("effort", math.nan, "model.chat_template_kwargs.effort: nan cannot be written into a template"),
    ("day", datetime.date(2025, 1, 1), "model.chat_template_kwargs.day: datetime.date(2025, 1, 1) cannot"),
    ("nested", {"a": {1: 2}}, "model.chat_template_kwargs.nested: {1: 2} cannot"),
])
def test_bad_kwargs_are_config_errors_naming_the_key(qwen3_tok, key, value, why):
    with pytest.raises(ConfigError) as err:
        get_chat_template(copy.deepcopy(qwen3_tok), "qwen3", {key: value})
    assert err.value.problems[0].startswith(why), err.value.problems


def test_a_top_level_default_is_seen_in_loops_and_macros_and_a_caller_overrides_it(qwen3_tok):
    tok = copy.deepcopy(qwen3_tok)
    tok.chat_template = ("{%- macro show() %}[{{ effort }}]{%- endmacro %}"
                         "{%- for m in messages %}{{ m.content }}:{{ effort }}{{ show() }}{%- endfor %}")
    get_chat_template(tok, None, {"effort": "low"})
    assert tok.apply_chat_template(USER, tokenize=False) == "hi:low[low]"
    assert tok.apply_chat_template(USER, tokenize=False, effort="high") == "hi:high[high]"


def test_qwen3_enable_thinking_false_gives_the_empty_think_block(qwen3_tok):
    tok = get_chat_template(copy.deepcopy(qwen3_tok), "qwen3", {"enable_thinking": False})
    prompt = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    served = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert served.endswith("<|im_start|>assistant\n")  # a server's own value still wins
    # the probe and the masks read the same render (the kwarg changes only the generation prompt here)
    assert template_layout(tok).end_of_turn == "<|im_end|>"
    text, mask = build_text_and_masks(CHAT, tok)
    assert text == qwen3_tok.apply_chat_template(CHAT, tokenize=False)
    trained = "".join(c for c, m in zip(text, mask) if m)
    assert trained.startswith("yo<|im_end|>") and trained.endswith("ok<|im_end|>")


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5", "qwen2.5", "chatml", "llama3", "gemma"])
def test_the_prelude_writes_nothing(family_tokenizers, name):
    plain = family_tokenizers[name]
    tok = get_chat_template(copy.deepcopy(plain), name, {"unused_flag": True, "note": "x\n"})
    for gen in (False, True):
        assert (tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
                == plain.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen))
    src = "\n\nplain text first {{ messages | length }}\n"
    assert (with_template_kwargs(src, {"a": 1}) != src
            and _render(with_template_kwargs(src, {"a": 1})) == _render(src) == "\n\nplain text first 1")


def _render(template: str) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=USER)


def test_baking_twice_or_after_a_save_does_not_stack(qwen3_tok, tmp_path):
    from transformers import AutoTokenizer

    tok = get_chat_template(copy.deepcopy(qwen3_tok), "qwen3", {"enable_thinking": False})
    once = tok.chat_template
    assert get_chat_template(tok, None, {"enable_thinking": False}).chat_template == once
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").read_text() == once
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert get_chat_template(loaded, None, {"enable_thinking": False}).chat_template == once
    assert get_chat_template(loaded, "tokenizer").chat_template == once  # no kwargs: the baked ones stay
    # new kwargs replace the prelude: the baked ones are kept unless named again
    both = get_chat_template(loaded, None, {"enable_thinking": True, "effort": "low"}).chat_template
    assert both.count("qlora-train chat_template_kwargs") == 1
    assert split_template_kwargs(both) == ({"enable_thinking": True, "effort": "low"},
                                           split_template_kwargs(once)[1])


def test_a_templates_own_default_line_is_not_taken_for_ours():
    own = "{%- if x is not defined %}{%- set x = 1 %}{%- endif %}\n{{ x }}"
    assert split_template_kwargs(own) == ({}, own)
    baked = with_template_kwargs(own, {"x": 1})
    assert split_template_kwargs(baked) == ({"x": 1}, own)
    assert with_template_kwargs(baked, {"x": 1}) == baked
    edited = baked.replace("set x = 1 %}", "set x = 2 %}", 1)  # a hand-edited prelude is left alone
    assert split_template_kwargs(edited) == ({}, edited)


def test_several_named_templates_each_get_the_defaults(qwen3_tok):
    tok = copy.deepcopy(qwen3_tok)
    tok.chat_template = {"default": "{{ effort }}", "tool_use": "tools {{ effort }}"}
    get_chat_template(tok, None, {"effort": "low"})
    assert tok.apply_chat_template(USER, tokenize=False) == "low"


def test_a_tokenizer_without_a_template_needs_one_named(qwen3_tok):
    tok = copy.deepcopy(qwen3_tok)
    tok.chat_template = None
    for asked in (None, "tokenizer"):
        with pytest.raises(ConfigError) as err:
            get_chat_template(tok, asked)
        assert err.value.problems == [f"model.chat_template: the tokenizer has no chat template: name one of "
                                      f"{shipped_templates()} or a .jinja path"]
    assert get_chat_template(tok, "llama3").chat_template.startswith("{#- Llama 3 layout")
