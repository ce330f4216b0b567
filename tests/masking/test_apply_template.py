"""``apply_template`` is ``apply_chat_template(..., tokenize=False)``, the text exactly: on every family template, and
it falls back to it on any difference."""

from __future__ import annotations

import copy
import logging
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2 import pass_context, pass_environment, pass_eval_context
from jinja2.sandbox import ImmutableSandboxedEnvironment, unsafe

from qlora_train.masking import apply_template as at
from tests.masking.conversations import conversation
from tests.masking.families import FAMILIES


def reference(messages, tok, tools=None, gen=False):
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)
    except Exception as exc:  # noqa: BLE001 - a template's own error is an outcome too
        return ("raised", type(exc).__name__)


def direct(messages, tok, tools=None, gen=False):
    """The direct render alone, never checked against the reference (what renders after the first ones do)."""
    try:
        return at._DirectRender(tok, tok.special_tokens_map).render(tok, messages, tools, gen)
    except at.TemplateRaised as exc:  # the template's own exception, of the type it names
        return ("raised", exc.kind)
    except Exception as exc:  # noqa: BLE001
        return ("raised", type(exc).__name__)


EDGES = [  # keys transformers treats specially: None values dropped, reasoning under any of its names aliased
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "tool_calls": None}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning": "hmm"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "thinking": "hmm"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "reasoning_content": "a",
                                         "tool_calls": [{"type": "function", "function": {
                                             "name": "add", "arguments": {"a": 1, "b": None}}}]}],
]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_direct_render_is_apply_chat_template_on_every_family(name, family_vocab_tokenizer):
    """40 seeded conversations (tools, reasoning, unicode and whitespace edges; every prefix of each, with and
    without the generation prompt) and the edge cases above: the same text, or the same exception type."""
    tok = family_vocab_tokenizer(name)
    rng = random.Random(name)
    cases = [(msgs, None) for msgs in EDGES]
    for _ in range(40):
        msgs, tools = conversation(rng, system=FAMILIES[name].supports_system,
                                   arguments_as_string=FAMILIES[name].tool_arguments_as_string)
        cases += [(msgs[:k], tools) for k in range(1, len(msgs) + 1)]
    rendered = 0
    for msgs, tools in cases:
        for gen in (False, True):
            want = reference(copy.deepcopy(msgs), tok, tools, gen)
            assert direct(msgs, tok, tools, gen) == want, (msgs, tools, gen)
            rendered += isinstance(want, str)
    assert rendered > len(cases) // 2  # mostly texts, not errors: the comparison is not between two exceptions


def test_renders_are_checked_then_direct(qwen3_tok, monkeypatch):
    tok = copy.copy(qwen3_tok)
    calls = []
    real = at._reference
    monkeypatch.setattr(at, "_reference", lambda *a: calls.append(1) or real(*a))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    want = tok.apply_chat_template(msgs, tokenize=False)
    assert all(at.apply_template(msgs, tok) == want for _ in range(at.CHECKED_RENDERS + 5))
    assert len(calls) == at.CHECKED_RENDERS  # checked this many times, then rendered directly
    tok.chat_template = tok.chat_template + "{{ '!' }}"  # a new template: checked again
    assert at.apply_template(msgs, tok) == want + "!" and len(calls) == at.CHECKED_RENDERS + 1


def test_a_difference_falls_back_to_apply_chat_template_for_good(qwen3_tok, monkeypatch, caplog):
    tok = copy.copy(qwen3_tok)
    monkeypatch.setattr(at._DirectRender, "render", lambda self, *a: "not the text")
    msgs = [{"role": "user", "content": "hi"}]
    want = tok.apply_chat_template(msgs, tokenize=False)
    with caplog.at_level(logging.WARNING):
        assert at.apply_template(msgs, tok) == want
    assert "gave another text than apply_chat_template" in caplog.text
    monkeypatch.setattr(at, "CHECKED_RENDERS", 0)  # even past the checked renders: apply_chat_template
    assert at.apply_template(msgs, tok) == want


def test_other_special_tokens_make_a_new_direct_render(qwen3_tok):
    tok = copy.deepcopy(qwen3_tok)  # a shallow copy shares its special tokens with the session's tokenizer
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}]
    for _ in range(at.CHECKED_RENDERS + 1):
        at.apply_template(msgs, tok)
    tok.bos_token = "<|im_start|>"
    assert at.apply_template(msgs, tok) == tok.apply_chat_template(msgs, tokenize=False) == "<|im_start|>hi"


# --- the sandbox that decides once per type and name: the same values and refusals as jinja's own ---

NAMES = ["role", "content", "items", "keys", "get", "append", "pop", "update", "clear", "strip", "split", "upper",
         "format", "format_map", "mro", "first", "last", "index0", "depth0", "previtem", "cycle", "found", "_x",
         "__class__", "__init__", "__globals__", "real", "imag", "count", "index"]
OBJECTS = {
    "message": "{'role': 'user', 'content': 'hi', 'items': 3}",  # a key that is also a dict method's name
    "words": "['a', 'b']",
    "pair": "('a', 1)",
    "text": "'some text {0}'",
    "number": "7",
    "real": "2.5",
    "flag": "true",
    "nothing": "none",
    "ns": "namespace(found=1)",
}
USES = ["{{{{ {x}.{name} }}}}", "{{{{ {x}.{name}() }}}}", "{{{{ {x}.{name}('a') }}}}",
        "{{{{ {x}.{name} is defined }}}}", "{{% for i in [1, 2] %}}{{{{ loop.{name} }}}}{{% endfor %}}"]


def outcome(template, env, variables=None) -> str:
    try:
        text = env.from_string(template).render(**(variables or {}))
    except Exception as exc:  # noqa: BLE001 - refusals and errors are outcomes too
        text = f"{type(exc).__name__}: {exc}"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # a method's repr: the same method, another object


@pytest.fixture(scope="module")
def environments(qwen3_tok):
    """(jinja's sandbox as transformers makes it, ours made from it) for the Qwen3 template."""
    theirs = at._compile_jinja_template(qwen3_tok.chat_template).environment
    ours = at._compile(qwen3_tok.chat_template).environment
    assert type(ours) is at._DecidedOnceSandbox and type(theirs) is ImmutableSandboxedEnvironment
    return theirs, ours


@given(name=st.sampled_from(NAMES), x=st.sampled_from(sorted(OBJECTS)), use=st.sampled_from(USES))
@settings(max_examples=300, deadline=None)
def test_the_decided_once_sandbox_reads_and_refuses_what_jinjas_does(environments, name, x, use):
    """Each read, first and later (the decisions are kept across examples), gives jinja's sandbox's text or its
    error, refusals of private, internal and mutating names and the wrapped ``str.format`` included; in
    transformers' environment (its namespace, its dict) as a template sees it."""
    theirs, ours = environments
    template = f"{{% set {x} = {OBJECTS[x]} %}}" + use.format(x=x, name=name)
    want = outcome(template, theirs)
    assert outcome(template, ours) == want
    assert outcome(template, ours) == want  # decided by now


def test_unsafe_reads_are_refused_after_safe_ones_of_the_same_type(environments):
    """A safe method of a type decided first does not let the type's unsafe ones through: mutating a list or a
    dict raises, a private name and a field of ``str.format`` read nothing, as in jinja's sandbox."""
    theirs, ours = environments
    for env in (theirs, ours):
        env.from_string("{{ [1].count(1) }}{{ {}.get('a') }}{{ 'x'.upper() }}{{ 'a{0}'.format(1) }}").render()
    for template, want in [("{{ [1].pop() }}", "SecurityError: access to attribute 'pop' of 'list' object is unsafe."),
                           ("{{ {}.update({}) }}", "SecurityError: access to attribute 'update' of 'dict' object is "
                                                   "unsafe."),
                           ("{{ 'x'.__class__ }}", ""), ("{{ '{0.__class__}'.format('a') }}", "")]:
        assert outcome(template, theirs) == outcome(template, ours) == want, template


def test_a_name_that_is_no_string_raises_what_jinjas_sandbox_raises(environments):
    """Extensions may call ``getattr`` with any name: a number raises jinja's own TypeError, not ours."""
    raised = []
    for env in environments:
        with pytest.raises(TypeError) as exc:
            env.getattr({"a": 1}, 5)
        raised.append(str(exc.value))
    assert raised[0] == raised[1] == "attribute name must be string, not 'int'"


CALLS = [  # a template's calls: its macros (in loops, with defaults, varargs, kwargs, caller), builtin methods, others
    "{% macro m(a, b='d') %}[{{ a }}{{ b }}]{% endmacro %}{{ m(1) }}{{ m(1, b=2) }}{{ m('x', 'y') }}",
    "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k=4) }}",
    "{% macro m(a) %}{{ a }}{% endmacro %}{% for i in [1, 2] %}{{ m(i) }}{{ m(loop.index) }}{% endfor %}",
    "{% macro m(a) %}<{{ caller(a) }}>{% endmacro %}{% call(x) m(3) %}{{ x * 2 }}{% endcall %}",
    "{% macro m() %}{{ 1 }}{% endmacro %}{{ m(2) }}",  # too many arguments: jinja's TypeError
    "{% macro m(a) %}{{ a }}{% endmacro %}{% macro n(f) %}{{ f(5) }}{% endmacro %}{{ n(m) }}",
    "{% set ns = namespace(t='') %}{% for w in ' a b '.strip().split(' ') %}{% set ns.t = ns.t + w.upper() %}"
    "{% endfor %}{{ ns.t }}{{ {'k': 1}.get('k') }}{{ {'k': 1}.items() | list }}{{ 'a,b'.split(',', 1) }}",
    "{% generation %}{{ 'gen'.upper() }}{% endgeneration %}",  # transformers' extension: a call block
    "{{ raise_exception('no') }}", "{{ range(3) | list }}{{ dict(a=1) }}{{ 'x'.zfill('a') }}",
    "{{ [1].pop() }}", "{{ 'a{0}'.format(2) }}",
    "{{ marked() }}", "{{ plain(1) }}{{ bound(2) }}{{ ctx_fn() }}{{ obj.unsafe_method() }}{{ obj.method(3) }}",
    "{% for i in [1] %}{{ eval_fn(i) }}{{ env_fn(i) }}{{ ctx_fn() }}{% endfor %}",
]


class _Host:
    def method(self, x):
        return x + 1

    @unsafe
    def unsafe_method(self):
        return "ran"


def _plain(x):
    return x * 2


@unsafe
def _marked():
    return "ran"


@pass_context
def _ctx_fn(context):
    return type(context).__name__


@pass_eval_context
def _eval_fn(eval_ctx, x):
    return f"{type(eval_ctx).__name__}{x}"


@pass_environment
def _env_fn(env, x):
    return f"sandboxed={env.sandboxed}{x}"


GLOBALS = {"plain": _plain, "bound": _Host().method, "marked": _marked, "ctx_fn": _ctx_fn, "obj": _Host(),
           "eval_fn": _eval_fn, "env_fn": _env_fn}


@pytest.mark.parametrize("template", CALLS)
def test_calls_give_what_jinjas_sandbox_gives(environments, template, monkeypatch):
    """The decided-once sandbox calls a template's macros and builtin methods directly (no per-call safety or
    context lookups): the same text or error as jinja's sandbox, refusals included."""
    theirs, ours = environments
    assert outcome(template, ours, GLOBALS) == outcome(template, theirs, GLOBALS)


def test_macros_and_builtin_methods_are_called_directly(environments, monkeypatch):
    """What the direct calls are for: no call of the sandbox's own ``call`` for them (a callable of another kind
    still takes it)."""
    _, ours = environments
    seen = []
    original = ImmutableSandboxedEnvironment.call
    monkeypatch.setattr(ImmutableSandboxedEnvironment, "call", lambda *a, **k: seen.append(a[2]) or original(*a, **k))
    assert ours.from_string(CALLS[2] + "{{ ' a '.strip() }}").render() == "1122a"
    assert seen == []
    assert ours.from_string("{{ plain(2) }}{{ bound(1) }}").render(**GLOBALS) == "42" and seen == []
    assert ours.from_string("{{ eval_fn(1) }}").render(**GLOBALS) == "EvalContext1" and seen == []
    assert ours.from_string("{{ env_fn(1) }}").render(**GLOBALS) == "sandboxed=True1" and seen == []
    assert ours.from_string("{{ dict(a=1) }}").render() == "{'a': 1}" and len(seen) == 1  # transformers' dict
    assert outcome("{{ marked() }}{{ ctx_fn() }}", ours, GLOBALS).startswith("SecurityError") and len(seen) == 2
    assert ours.from_string("{{ ctx_fn() }}").render(**GLOBALS) == "Context" and len(seen) == 3
