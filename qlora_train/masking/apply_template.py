"""``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)``, the text exactly, in 40% of its time.

What transformers does on each call beyond rendering the compiled template is make copies: it converts the
messages, tools and special tokens to plain JSON types (``_normalize_chat_messages``, ``_plain_template_data``:
a deep copy, so that rich objects never reach the sandbox), drops the keys whose value is None, copies reasoning
under the other names templates read it by (``_alias_reasoning_fields``) and picks the template (named ones:
by whether there are tools). For messages and tools that are plain JSON data already (what the parser makes) the
copies change nothing: the template sees equal data, and the sandbox keeps it from writing to it. ``apply_template``
does the rest (the template picked per call, None keys dropped, reasoning aliased by transformers' own function,
the special tokens converted once per tokenizer) and renders the template with what transformers would pass it,
as jinja's ``Template.render`` does but with the template's globals flattened once, compiled in a copy of
transformers' sandbox that makes each of its per-read safety decisions once per type and name, and calls the
template's macros, builtin methods and plain functions without the per-call lookups whose answers are fixed
(``_DecidedOnceSandbox``): about 25 us a short chat row instead of 71, which matters because the render is a
third of a row's cost. The same sandbox checks the row's budget while the template runs (``budget``,
``data.row_budget``: its loops and macro calls counted, what ``*``, ``**``, ``%``, widths, joins and replaces
would build measured before they build it), and each render is counted against it.

It is checked, not assumed: the first ``CHECKED_RENDERS`` renders of each tokenizer and template are made both
ways and compared; on a difference (or where transformers' internals it uses are missing) that tokenizer renders
through ``apply_chat_template`` from then on, with a warning.

    >>> apply_template([{"role": "user", "content": "hi"}], tok, add_generation_prompt=True)
    '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import logging
import re
import weakref
from functools import update_wrapper
from itertools import islice
from types import BuiltinMethodType, FunctionType, MethodType

from jinja2 import TemplateError, nodes
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from qlora_train.masking.messages import RowRejected

try:  # how jinja marks a callable that takes the context (jinja 3.x); without it every call takes the sandbox's way
    from jinja2.utils import _PassArg
except ImportError:  # pragma: no cover - another jinja
    _PassArg = None

from qlora_train.masking import budget  # noqa: E402 - after jinja's optional parts

log = logging.getLogger(__name__)

CHECKED_RENDERS = 16  # per tokenizer and template: rendered both ways and compared

try:  # transformers' own steps of apply_chat_template (5.x), so that the render is its render
    from transformers.utils.chat_template_utils import (
        _alias_reasoning_fields,
        _compile_jinja_template,
        _plain_template_data,
    )
except ImportError:  # pragma: no cover - another transformers: apply_chat_template itself
    _alias_reasoning_fields = _compile_jinja_template = _plain_template_data = None


class TemplateRaised(TemplateError):
    """An exception the chat template's own code raised while it rendered, whatever its type (``{{ 1 / 0 }}``'s
    ZeroDivisionError, the RecursionError of a macro that calls itself without end, ``'a'.index('b')``'s
    ValueError): the template's refusal of that render, as ``raise_exception``'s ``TemplateError`` is (a row's
    ``template_error``, an unknown fact to the layout probe), never a bug of ours. It keeps the original's type
    name, message (``DETAIL_MAX`` characters at most) and the template line it was raised at, not its traceback
    (a deep recursion's frames, the row's data)."""

    DETAIL_MAX = 300

    def __init__(self, kind: str, message: str, line: int):
        if len(message) > self.DETAIL_MAX:
            message = f"{message[:self.DETAIL_MAX]}... ({len(message)} characters)"
        self.kind, self.original, self.line = kind, message, line
        super().__init__(f"{kind}: {message} (line {line} of the template)" if message else
                         f"{kind} (line {line} of the template)")

    def __reduce__(self):  # pickled with its own arguments (a datasets worker's exception reaches the parent)
        return type(self), (self.kind, self.original, self.line)


def call_template(render, *args, **kwargs):
    """``render(*args, **kwargs)``, a call that runs a chat template's code (``tokenizer.apply_chat_template``);
    what the template's code raises comes out as a ``TemplateError``: jinja's own (``raise_exception``, undefined
    values, the sandbox's refusals) as raised, any other type as ``TemplateRaised``. An exception raised where no
    template code runs (transformers' checks of its arguments, our code) comes out as it was raised, and so does
    a ``RowRejected`` raised from within the render (our refusal, not the template's)."""
    try:
        return render(*args, **kwargs)
    except TemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - the template's, whatever its type; re-raised where it is not
        raised = _template_raised(exc)
        if raised is None:
            raise
    raise raised  # outside the except: the original and its frames are freed now


def _template_raised(exc: Exception) -> TemplateRaised | None:
    """``exc`` as the template's ``TemplateRaised`` when a frame of template code raised it or is on its way
    (the innermost one gives the line), else None."""
    if isinstance(exc, RowRejected):
        return None
    line, tb = None, exc.__traceback__
    while tb is not None:
        names = tb.tb_frame.f_globals
        if "__jinja_template__" in names:  # compiled template code: its Python line mapped to the template's
            line = names["__jinja_template__"].get_corresponding_lineno(tb.tb_lineno)
        elif "__jinja_exception__" in names:  # a frame jinja rewrote (``handle_exception``): the template's line
            line = tb.tb_lineno
        tb = tb.tb_next
    return None if line is None else TemplateRaised(type(exc).__name__, str(exc), line)


class _DirectRender:
    """The compiled-template call of one tokenizer's template, and whether it has matched so far."""

    def __init__(self, tokenizer, special_tokens: dict):
        # what it was made for: another template or other special tokens make a new one
        self.source, self.special_tokens = tokenizer.chat_template, special_tokens
        self.context = _plain_template_data(dict(special_tokens))
        self.checked = 0
        self.exact = True

    def render(self, tokenizer, messages, tools, add_generation_prompt: bool) -> str:
        chat = _alias_reasoning_fields([{k: v for k, v in m.items() if v is not None} for m in messages])
        return _render(tokenizer.get_chat_template(None, tools), {
            "messages": chat, "tools": tools, "documents": None, "add_generation_prompt": add_generation_prompt,
            **self.context})


class _DecidedOnceSandbox(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox (what transformers renders chat templates in), deciding once per type and name
    what it decides on every attribute a template reads.

    The sandbox checks each ``x.name`` a template reads (``message.role``, ``loop.first``, ``text.strip``): is the
    name private, internal to Python or a mutating method of a list, dict or set (``is_safe_attribute``), and for a
    dict it first tries the attribute and catches the ``AttributeError`` before reading the key. For the types
    below those answers depend on the object's type and the name alone, so they are worked out on the first read
    and looked up after it: the same values, the same refusals, two fifths less time a render. Anything else (another
    type, a private name, a ``str.format`` method, which the sandbox wraps) takes the sandbox's own path; so
    does a read the decision does not fit (an attribute the object lacks).

    Decisions are kept only for names a template's source spells (``message.content``: ``content``), never for a
    name made of row data (``('{0.' ~ content ~ '}').format(m)``, ``m | attr(content)``): such a name is decided on
    each read, so what is kept is bounded by the templates' words (and ``DECIDED_MAX``), not by the data."""

    FIXED_TYPES = frozenset({dict, list, tuple, str, int, float, bool, type(None), LoopContext})
    spelled: frozenset[str] = frozenset()  # the words of the templates compiled in this environment (``_parse``)

    # The row budget (``budget``, ``data.row_budget``), checked while the template runs: its loops' iterations and
    # its calls are counted as steps (and the clock looked at), what ``*``, ``**``, ``%`` and the growing string
    # methods and filters would build is measured before they build it, and what ``{% set %}`` stores after.
    intercepted_binops = frozenset({"*", "**", "%"})  # compiled as call_binop: only where a template uses them

    def call_binop(self, context, operator, left, right):
        budget.check_binop(operator, left, right)
        return self.binop_table[operator](left, right)

    def _parse(self, source, name, filename):
        """The template's tree with each ``{% for %}``'s iterable put through ``budget.loop_items`` and each
        ``{% set %}``'s value that can build something through ``budget.checked_value`` (as filters, which the
        compiler looks up once); the source's words are kept in ``spelled`` (the decided-once cache's names)."""
        self.spelled = self.spelled | frozenset(_WORD.findall(source))
        tree = super()._parse(source, name, filename)
        for node in tree.find_all(nodes.For):
            node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=node.lineno)
        for node in tree.find_all(nodes.Assign):
            if isinstance(node.node, _BUILDS) or next(node.node.find_all(_BUILDS), None) is not None:
                node.node = nodes.Filter(node.node, _SET_FILTER, [], [], None, None, lineno=node.lineno)
        for node in tree.find_all(nodes.AssignBlock):  # the block's text, then its own filter, then ours
            node.filter = nodes.Filter(node.filter, _SET_FILTER, [], [], None, None, lineno=node.lineno)
        return tree

    def getattr(self, obj, attribute):
        how = _DECIDED.get((type(obj), attribute))
        if how is None:
            how = self._decide(obj, attribute)
        if how == _ATTRIBUTE:  # safe wherever the object has it: read it as the sandbox does
            try:
                value = getattr(obj, attribute)
            except AttributeError:
                return super().getattr(obj, attribute)
            return self.wrap_str_format(value) or value
        if how == _ITEM:  # not an attribute of the type (a dict's key): the sandbox's second try, without the first
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)

    def _decide(self, obj, attribute: str) -> int:
        kind = type(obj)
        how = _SANDBOX
        namespace = issubclass(kind, Namespace) and kind.__getattribute__ is Namespace.__getattribute__
        if (kind in self.FIXED_TYPES or namespace) and type(attribute) is str and not attribute.startswith("_") \
                and attribute not in ("format", "format_map"):
            if hasattr(kind, attribute) or namespace:  # a namespace's names are its own (``ns.found``)
                if self.is_safe_attribute(obj, attribute, None):
                    how = _ATTRIBUTE
            elif kind is not LoopContext:  # builtins have no attributes of their own; a loop may (depth0)
                how = _ITEM
        if attribute in self.spelled and len(_DECIDED) < DECIDED_MAX:  # a name from the data: decided, not kept
            _DECIDED[(kind, attribute)] = how
        return how

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's names (kwargs cannot clash)
        """A call from the template. The sandbox asks every callable whether it is marked unsafe and jinja whether
        it takes the context or environment, reading attributes most callables lack. A template's own macro
        (safe; it takes the evaluation context) and a builtin method (it can carry no mark; the sandbox's
        ``getattr`` already refused the unsafe ones) always get the same answers; a Python function or method (a
        global such as ``raise_exception``, an extension's method) carries its marks in its function's
        ``__dict__``, read there in one lookup each. Called as ``Context.call`` would, then; one that takes the
        whole context, or a callable of another kind, takes the sandbox's way."""
        kind = type(__obj)
        if _PassArg is None:
            return super().call(__context, __obj, *args, **kwargs)
        if kind is Macro:
            budget._current.step()  # a call of the template's own is a step (a macro can recurse, twice a level)
            pass_arg = _PassArg.eval_context
        elif kind is BuiltinMethodType:
            if __obj.__name__ in _GROWING_METHODS:
                budget.check_method(__obj, args)
            pass_arg = None
        else:
            func = __obj.__func__ if kind is MethodType else __obj
            marks = func.__dict__ if type(func) is FunctionType else None
            if marks is not None and "__wrapped__" in marks:  # the sandbox's str.format (``wrap_str_format``)
                _check_str_format(marks["__wrapped__"], args, kwargs)
            if marks is None or marks.get("unsafe_callable") or marks.get("alters_data"):
                budget._current.step()  # a loop's own call (a recursive loop), a class, an extension's method
                return super().call(__context, __obj, *args, **kwargs)
            pass_arg = marks.get("jinja_pass_arg")
            if pass_arg is _PassArg.context:
                budget._current.step()
                return super().call(__context, __obj, *args, **kwargs)
        if pass_arg is _PassArg.eval_context:
            args = (__context.eval_ctx, *args)
        elif pass_arg is _PassArg.environment:
            args = (__context.environment, *args)
        kwargs.pop("_block_vars", None)
        kwargs.pop("_loop_vars", None)
        try:
            return __obj(*args, **kwargs)
        except StopIteration:
            return __context.environment.undefined("value was undefined because a callable raised a StopIteration "
                                                   "exception")


_LOOP_FILTER, _SET_FILTER = "_budget_loop_items", "_budget_checked_value"
# what in a value can build a longer string or list than those it reads (``{% set c = m.content %}`` cannot)
_BUILDS = (nodes.Concat, nodes.Add, nodes.Mul, nodes.Pow, nodes.Mod, nodes.Call, nodes.Filter)
_GROWING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs", "replace", "join"})


def _check_str_format(method, args, kwargs) -> None:
    fmt = getattr(method, "__self__", None)
    if isinstance(fmt, str) and getattr(method, "__name__", None) in ("format", "format_map"):
        budget.check_format(fmt, (*args, *kwargs.values()), percent=False)


def _checked_filter(run, check):
    """A jinja filter that can build more than it is given, ``check``ed (with its arguments, less the context
    or environment it may take first) before it runs."""
    skip = 0 if _PassArg is None or _PassArg.from_obj(run) is None else 1

    def checked(*args, **kwargs):
        check(*args[skip:], **kwargs)
        return run(*args, **kwargs)
    return update_wrapper(checked, run)  # its jinja marks (``jinja_pass_arg``) with it


_SANDBOX, _ATTRIBUTE, _ITEM = 0, 1, 2  # how a (type, name) is read: the sandbox's way, as an attribute, as a key
_DECIDED: dict[tuple[type, str], int] = {}  # (type, a name some template spells) -> how; at most DECIDED_MAX
DECIDED_MAX = 4096  # a template reads tens of names of a few types; past this, reads are decided each time
_WORD = re.compile(r"\w+")  # a name a template's source spells: a run of word characters in it
_GLOBALS: dict[str, tuple] = {}  # template text -> (its compiled template, its globals as one dict)


def _compile(template: str):
    """transformers' compiled ``template``, compiled once more in ``_DecidedOnceSandbox`` (an overlay of
    transformers' environment: its filters, globals, extensions and options), when that is the sandbox it uses."""
    compiled = _compile_jinja_template(template)
    if type(compiled.environment) is ImmutableSandboxedEnvironment:
        env = compiled.environment.overlay()
        env.__class__ = _DecidedOnceSandbox
        env.filters = {**env.filters, _LOOP_FILTER: budget.loop_items, _SET_FILTER: budget.checked_value,
                       **{name: _checked_filter(env.filters[name], check)
                          for name, check in budget.GROWING_FILTERS.items() if name in env.filters}}
        compiled = env.from_string(template)
    return compiled


def _render(template: str, variables: dict) -> str:
    """``compiled.render(**variables)`` of the compiled ``template`` (``_compile``), as jinja's ``Template.render``
    does it, with the template's globals (a ``ChainMap`` jinja flattens twice on every render, 3 us each)
    flattened once."""
    entry = _GLOBALS.get(template)
    if entry is None:
        compiled = _compile(template)
        entry = _GLOBALS[template] = (compiled, dict(compiled.globals))
    compiled, flat = entry
    env = compiled.environment
    context = env.context_class(env, {**flat, **variables}, compiled.name, compiled.blocks, globals=flat)
    try:
        return env.concat(_output(compiled.root_render_func(context)))
    except TemplateError:  # re-raised by jinja with the template's lines in the traceback
        env.handle_exception()
    except Exception as exc:  # noqa: BLE001 - the template's (``call_template``), whatever its type
        raised = _template_raised(exc)
        if raised is None:
            raise
    raise raised


def _output(pieces) -> list[str]:
    """A render's pieces of text, measured (``budget``: ``render_chars``) before they are joined into one."""
    out = list(islice(pieces, _PIECES))
    n = sum(map(len, out))
    while True:
        budget._current.size(n)
        if len(out) % _PIECES:
            return out
        more = list(islice(pieces, _PIECES))
        if not more:
            return out
        out += more
        n += sum(map(len, more))


_PIECES = 4096


_RENDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _DirectRender


def apply_template(messages: list[dict], tokenizer, *, tools=None, add_generation_prompt: bool = False) -> str:
    """Exactly ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
    add_generation_prompt=add_generation_prompt)`` for messages and tools of plain JSON data; raises what it
    raises, what the template's code raises as a ``TemplateError`` (``TemplateRaised``: see ``call_template``).
    Counted against the row's budget (``budget.RowSpending``; outside a row, the default budget for this render
    alone): over it, ``budget.RowOverBudget`` (in a row) or ``RowRejected`` (``over_budget``, outside)."""
    spending = budget._current
    if spending is budget.UNMETERED:
        with budget.RowSpending():
            return apply_template(messages, tokenizer, tools=tools, add_generation_prompt=add_generation_prompt)
    spending.render_started()
    text = _apply(messages, tokenizer, tools, add_generation_prompt)
    spending.render_done(len(text))
    return text


def _apply(messages: list[dict], tokenizer, tools, add_generation_prompt: bool) -> str:
    direct, special_tokens = _RENDERS.get(tokenizer), tokenizer.special_tokens_map
    if direct is None or direct.source is not tokenizer.chat_template or direct.special_tokens != special_tokens:
        if _compile_jinja_template is None or not tokenizer.chat_template:
            return _reference(messages, tokenizer, tools, add_generation_prompt)
        direct = _RENDERS[tokenizer] = _DirectRender(tokenizer, special_tokens)
    if not direct.exact:
        return _reference(messages, tokenizer, tools, add_generation_prompt)
    if direct.checked >= CHECKED_RENDERS:
        return direct.render(tokenizer, messages, tools, add_generation_prompt)
    direct.checked += 1
    try:  # first, within the budget: a render over it is not made again without it (RowOverBudget is no Exception)
        got = direct.render(tokenizer, messages, tools, add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - any difference means: not this way
        got = f"<raised {type(exc).__name__}: {exc}>"
    want = _reference(messages, tokenizer, tools, add_generation_prompt)  # raises as the template does
    if got != want:
        direct.exact = False
        log.warning("chat template: rendering it without transformers' copies gave another text than "
                    "apply_chat_template (%d characters vs %d); rendering through apply_chat_template (slower)",
                    len(got), len(want))
    return want


def _reference(messages, tokenizer, tools, add_generation_prompt: bool) -> str:
    return call_template(tokenizer.apply_chat_template, messages, tools=tools, tokenize=False,
                         add_generation_prompt=add_generation_prompt)
