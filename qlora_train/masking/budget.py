"""What one row may cost (``data.row_budget``): template renders, characters rendered, template steps, seconds.

A row's work is bounded by its length almost everywhere, but not on two paths: the general path renders each
trained turn's prefixes (``prefix``: 2N renders of up to N messages, quadratic in the row: 2,000 short
exchanges are 4,000 renders, minutes), and a chat template is code that can loop or build strings without end
on a row it was written to catch. A row over its budget is refused (``DropReason.OVER_BUDGET``, the detail
naming the budget and the amount) and counted; the run goes on.

    >>> from qlora_train.masking.apply_template import apply_template
    >>> with RowSpending(RowBudget(renders=2)):  # what the pipeline does around each row's work
    ...     for _ in range(3):
    ...         text = apply_template([{"role": "user", "content": "hi"}], tok)
    Traceback (most recent call last):
    ...
    qlora_train.masking.messages.RowRejected: over_budget: template renders 3 > row_budget.renders=2

Where it is counted: ``apply_template`` counts each render and its characters against the row's ``RowSpending``
(the one in force, or a fresh one with the default budget for a render outside any row: the layout probe,
diagnostics), and the template sandbox (``apply_template._DecidedOnceSandbox``) checks, while the template runs,
its steps (loop iterations, macro calls) and the clock, and the size of what it builds before it builds
it where one step can build much (``*``, ``**``, ``%``, a width or a count given to ``center``, ``ljust``, ``indent``,
``replace``, ``join``, ``format``), and after it where it grows by the sizes of its parts (a ``set``, a render's
output). What it does not see: one step of C that serializes a structure of shared references (``[x, x]``, nested
forty deep, printed), and renders through ``apply_chat_template`` itself (the first ``CHECKED_RENDERS`` of each
template, and every render where the two ways differ), which are counted and measured only after they return.

``RowOverBudget`` is a ``BaseException``, like ``KeyboardInterrupt``: it is raised inside the template's code and
must reach the row's ``RowSpending`` through whatever catches ``Exception`` in between (jinja's helpers, the
renderer's "a template error refuses the row", a fast path falling back to prefix renders), which turns it into the
row's refusal. Not thread-safe: one row at a time per process (what ``datasets.map`` runs).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from itertools import islice

from qlora_train.masking.messages import DropReason, RowRejected


@dataclass(frozen=True)
class RowBudget:
    """The most one row may cost (``data.row_budget``; defaults measured in docs/masking.md#budgets)."""

    renders: int = 2048  # chat-template renders of the row, all paths and checks together
    row_chars: int = 256_000_000  # characters those renders write, together
    render_chars: int = 16_000_000  # characters of one render, and of any string or list its template builds
    steps: int = 4_000_000  # loop iterations and macro calls of one render's template
    seconds: float = 300.0  # wall-clock seconds the row's rendering and masking takes


DEFAULT_BUDGET = RowBudget()
MAX_NUMBER_BITS = 1 << 16  # a number a template computes (about 20,000 digits; Python prints at most 4,300)
_CLOCK_EVERY = 64  # steps between two looks at the clock (and at the steps budget)


class RowOverBudget(BaseException):  # noqa: N818 - an interrupt, like KeyboardInterrupt (see the module doc)
    """A row's work went over ``budget`` (a ``RowBudget`` field): ``measured`` > ``limit``."""

    def __init__(self, budget: str, what: str, measured, limit, *, bound: str | None = None):
        self.budget, self.measured, self.limit = budget, measured, limit
        bound = bound or f"row_budget.{budget}={_number(limit)}"
        self.detail = f"{what} {_number(measured)} > {bound}"
        super().__init__(self.detail)

    def refusal(self) -> RowRejected:
        return RowRejected(DropReason.OVER_BUDGET, self.detail)


def _number(x) -> str:
    return f"{x:,.1f}" if isinstance(x, float) else f"{x:,}"


class RowSpending:
    """One row's spending against its ``RowBudget``: entered around each part of the row's work (the pipeline
    enters it for the render and again for truncation after the batch's tokenizer call); a ``RowOverBudget``
    leaving it becomes the row's ``RowRejected`` (``over_budget``). Renders count per row, steps per render,
    seconds while it is entered."""

    __slots__ = ("budget", "renders", "chars", "steps", "seconds", "deadline", "_clock_at", "_entered", "_outer")

    def __init__(self, budget: RowBudget = DEFAULT_BUDGET):
        self.budget = budget
        self.renders = self.chars = self.steps = self._clock_at = 0
        self.seconds = 0.0  # spent in earlier entries
        self.deadline = float("inf")
        self._entered = self._outer = None

    def __enter__(self) -> RowSpending:
        global _current
        self._entered, self._outer = time.monotonic(), _current
        self.deadline = self._entered + self.budget.seconds - self.seconds
        _current = self
        return self

    def __exit__(self, kind, exc, tb) -> None:
        global _current
        _current = self._outer
        self.seconds += time.monotonic() - self._entered
        if isinstance(exc, RowOverBudget):
            raise exc.refusal() from None

    # what apply_template counts
    def render_started(self) -> None:
        self.renders += 1
        self.steps = self._clock_at = 0
        if self.renders > self.budget.renders:
            raise RowOverBudget("renders", "template renders", self.renders, self.budget.renders)
        self.clock()

    def render_done(self, n_chars: int) -> None:
        self.size(n_chars)
        self.chars += n_chars
        if self.chars > self.budget.row_chars:
            raise RowOverBudget("row_chars", "characters rendered", self.chars, self.budget.row_chars)
        self.clock()

    # what the sandbox checks while the template runs
    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps >= self._clock_at:  # the clock looked at every _CLOCK_EVERY steps
            if self.steps > self.budget.steps:
                raise RowOverBudget("steps", "template steps in one render", self.steps, self.budget.steps)
            self._clock_at = self.steps + _CLOCK_EVERY
            self.clock()

    def clock(self) -> None:
        now = time.monotonic()
        if now > self.deadline:
            spent = self.seconds + now - self._entered
            raise RowOverBudget("seconds", "seconds", round(spent, 1), self.budget.seconds)

    def size(self, n: int, what: str = "characters in one render") -> None:
        if n > self.budget.render_chars:
            raise RowOverBudget("render_chars", what, n, self.budget.render_chars)


class _Unmetered(RowSpending):
    """The hooks' spending where a template of ours is rendered other than through ``apply_template`` (jinja's
    own ``render``: tests, a caller's own use): sizes checked against the default budget, steps and time not."""

    __slots__ = ()

    def step(self, n: int = 1) -> None:
        pass

    def clock(self) -> None:
        pass


UNMETERED = _Unmetered()
_current: RowSpending = UNMETERED  # the spending in force: a row's (RowSpending entered), else UNMETERED


def current() -> RowSpending | None:
    """The spending of the row being processed, if any."""
    return None if _current is UNMETERED else _current


_SIZED = frozenset({list, tuple, dict, str, range})


def loop_items(iterable):
    """A template's ``{% for %}`` iterable (``_DecidedOnceSandbox`` puts every loop's through it): the same items,
    counted as steps. A list, tuple, dict, string or range is counted whole when the loop starts and, where it
    is longer than ``_CLOCK_EVERY``, given out in runs between which the clock is looked at; another iterable
    item by item."""
    spending = _current
    if type(iterable) in _SIZED:
        n = len(iterable)
        spending.step(n)
        return iterable if n <= _CLOCK_EVERY else _runs(iter(iterable), n, spending)
    return _counted(iter(iterable), spending)


def _runs(items, n: int, spending: RowSpending):
    for _ in range(0, n, _CLOCK_EVERY):
        spending.clock()
        yield from islice(items, _CLOCK_EVERY)


def _counted(items, spending: RowSpending):
    n = 0
    for x in items:
        n += 1
        if n == _CLOCK_EVERY:
            spending.step(n)
            n = 0
        yield x
    spending.step(n)


def checked_value(value):
    """A value a template stores (``{% set %}``): refused where it is longer than a render may be."""
    if isinstance(value, (str, list, tuple, dict)) and len(value) > _current.budget.render_chars:
        _current.size(len(value), "characters (or items) in a value the template sets")
    return value


def check_binop(operator: str, left, right) -> None:
    """Before the template computes ``left <operator> right`` (``*``, ``**``, ``%``): what it would build."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
                _current.size(len(seq) * n, "characters (or items) of a product the template computes")
        if isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length())
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _check_bits(right * left.bit_length())
    elif operator == "%" and isinstance(left, str):
        check_format(left, right if isinstance(right, tuple) else (right,), percent=True)


def _check_bits(bits: int) -> None:
    if bits > MAX_NUMBER_BITS:
        raise RowOverBudget("numbers", "bits of a number the template computes", bits, MAX_NUMBER_BITS,
                            bound=f"{MAX_NUMBER_BITS:,} (more than any template needs)")


_BIG_NUMBER = re.compile(r"\d{7,}")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")  # '{:{}}': a width given as an argument


def check_format(fmt: str, args, *, percent: bool) -> None:
    """Before ``fmt % args`` or ``fmt.format(*args)``: a width in the format, or given as an argument (``%*d``,
    ``{:{}}``), over what a render may be."""
    limit = _current.budget.render_chars
    for m in _BIG_NUMBER.finditer(fmt):
        if int(m.group()) > limit:
            _current.size(int(m.group()), "characters of a width in a format string")
    if ("*" in fmt) if percent else _NESTED_FIELD.search(fmt) is not None:
        for a in args:
            if type(a) is int and a > limit:
                _current.size(a, "characters of a width given to a format string")


def check_method(method, args) -> None:
    """Before a template calls a builtin method of a string that can build more than it is given."""
    s, name = method.__self__, method.__name__
    if not isinstance(s, str) or not args:
        return
    if name in ("ljust", "rjust", "center", "zfill"):
        width = args[0]
        if isinstance(width, int):
            _current.size(width, f"characters of str.{name}")
    elif name == "expandtabs" and isinstance(args[0], int):
        _current.size(len(s) + s.count("\t") * args[0], "characters of str.expandtabs")
    elif name == "replace" and len(args) >= 2:
        check_replace(s, *args[:3])
    elif name == "join":
        check_join(args[0], s)


def check_replace(s, old, new, count=-1) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        n = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _current.size(len(s) + n * (len(new) - len(old)), "characters of a replace")


def check_join(items, sep) -> None:
    if isinstance(items, (list, tuple, str)) and isinstance(sep, str):
        try:
            parts = sum(map(len, items))
        except TypeError:  # not all strings: joined as text of each, which the sizes do not tell
            parts = 0
        _current.size(parts + len(sep) * max(len(items) - 1, 0), "characters of a join")


def _filter_center(value, width=80, *_, **__):
    if isinstance(width, int):
        _current.size(width, "characters of |center")


def _filter_indent(s, width=4, *_, **__):
    if isinstance(s, str):
        pad = width if isinstance(width, int) else len(str(width))
        _current.size(len(s) + (s.count("\n") + 1) * pad, "characters of |indent")


def _filter_join(value, d="", *_, **__):
    check_join(value, d)


def _filter_replace(s, old="", new="", count=None, *_, **__):
    check_replace(s, old, new, -1 if count is None else count)


def _filter_format(value, *args, **kwargs):
    if isinstance(value, str):
        check_format(value, args or tuple(kwargs.values()), percent=True)


def _filter_wordwrap(s, width=79, break_long_words=True, wrapstring=None, *_, **__):
    if isinstance(s, str) and isinstance(width, int) and isinstance(wrapstring, str):
        _current.size(len(s) + (len(s) // max(width, 1) + 1) * len(wrapstring), "characters of |wordwrap")


# jinja's filters that can build more than they are given: checked before they run (their arguments after the
# value; the eval context or environment some take first is left out)
GROWING_FILTERS = {"center": _filter_center, "indent": _filter_indent, "join": _filter_join,
                   "replace": _filter_replace, "format": _filter_format, "wordwrap": _filter_wordwrap}
