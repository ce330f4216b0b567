"""Reward functions: ``rl.rewards`` imported (``load_rewards``), called on a step's completions (``score``), and a
few of our own (``final_answer``, ``matches``, ``length_penalty``).

A reward function follows TRL's convention, so that existing ones work unchanged::

    def reward(prompts, completions, **columns) -> list[float | None]

- ``prompts``: each completion's prompt, its messages (a string prompt is one user turn: ``[{"role": "user",
  "content": ...}]``), repeated for each of the prompt's completions;
- ``completions``: each completion as ``[{"role": "assistant", "content": text}]`` (the sampled ids decoded without
  special tokens, the end-of-turn token left out, as TRL decodes them);
- ``columns``: every other column of the prompt's row by its name (``answer``, ``tests``, ...), one value per
  completion; and ``completion_ids`` (the sampled ids) and ``trainer_state`` (the Trainer's state);
- it returns one number per completion, or ``None`` where it has nothing to say (that completion is left out of
  this function's mean and counted; a completion every function leaves out gets advantage 0).

A function that raises, returns a list of another length or a value that is not a number stops the run at once:
``RewardError`` (exit 2) names the function, what went wrong and the row whose completions it was scoring.

    >>> final_answer(None, [[{"role": "assistant", "content": "so it is \\\\boxed{4}."}]], answer=["#### 4"])
    [1.0]
    >>> matches(None, ["<answer>5</answer>", "5"], pattern=r"^<answer>\\d+</answer>$")
    [1.0, 0.0]
    >>> length_penalty(None, ["a", "b"], completion_ids=[[1, 2], [1, 2, 3, 4, 5, 6]], max_tokens=4)
    [0.0, -0.5]
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from qlora_train.config import RewardSpec
from qlora_train.errors import QloraError


class RewardError(QloraError):
    """A reward function cannot be imported, or failed on a step's completions: one line naming it (and the
    row), exit 2."""

    exit_code = 2


@dataclass(frozen=True)
class RewardFunction:
    """One of ``rl.rewards``, imported: what it is called, the callable (its ``kwargs`` bound) and its weight."""

    name: str  # the function's own name, as the logs key it (rewards/<name>/mean); made unique by load_rewards
    function: str  # "package.module:name", as configured
    call: Callable
    weight: float
    where: str  # "rl.rewards[0]"


def load_rewards(specs: Sequence[RewardSpec]) -> list[RewardFunction]:
    """``rl.rewards`` -> the functions, imported from the installed packages or the current directory; a module
    that cannot be imported, a name it does not define or one that is not callable is a ``RewardError``."""
    out, names = [], set()
    for i, spec in enumerate(specs):
        where = f"rl.rewards[{i}]"
        module_name, _, attr = spec.function.partition(":")
        module = _import(module_name, where)
        fn = getattr(module, attr, None)
        if fn is None:
            public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise RewardError(f"{where}.function: {module_name} has no '{attr}' (its functions: "
                              f"{', '.join(public[:12]) or 'none'})")
        if not callable(fn):
            raise RewardError(f"{where}.function: {spec.function} is a {type(fn).__name__}, not a function")
        name = attr if attr not in names else f"{attr}_{i}"
        names.add(name)
        call = functools.partial(fn, **spec.kwargs) if spec.kwargs else fn
        out.append(RewardFunction(name, spec.function, call, spec.weight, where))
    return out


def _import(module_name: str, where: str):
    """Import ``module_name``, the current directory searched too (a ``rewards.py`` beside the config)."""
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.append(here)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise RewardError(f"{where}.function: cannot import {module_name}: {exc} (a module must be installed or in "
                          f"the current directory, {here})") from None
    except Exception as exc:  # the module's own code failed while it was imported: say where
        raise RewardError(f"{where}.function: importing {module_name} raised {_one_line(exc)}"
                          f"{_where_raised(exc)}") from None
    finally:
        if added:
            sys.path.remove(here)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _where_raised(exc: BaseException) -> str:
    """`` at file:line`` of the innermost frame of ``exc``'s traceback outside Python's own import machinery."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    if not frames:
        return ""
    last = frames[-1]
    return f" at {Path(last.filename).name}:{last.lineno}"


@dataclass(frozen=True)
class Scores:
    """A step's rewards: ``values[i][f]`` the reward function f gave completion i (nan where it returned None)."""

    values: list[list[float]]
    none: list[int]  # per function: the completions it left out (None)


def score(rewards: Sequence[RewardFunction], prompts: list, completions: list, columns: list[dict], *,
          completion_ids: list[list[int]], rows: list[str], trainer_state=None) -> Scores:
    """Call each reward function once on all of a step's completions (``prompts``, ``completions``,
    ``completion_ids`` and ``columns``, one entry per completion; ``rows`` the location of each completion's row)
    -> ``Scores``, or ``RewardError`` naming the function and the row."""
    n = len(completions)
    keys = list(dict.fromkeys(k for c in columns for k in c))
    kwargs = {k: [c.get(k) for c in columns] for k in keys}
    values = [[math.nan] * len(rewards) for _ in range(n)]
    none = [0] * len(rewards)
    for f, reward in enumerate(rewards):
        try:
            out = reward.call(prompts=prompts, completions=completions, completion_ids=completion_ids,
                              trainer_state=trainer_state, **kwargs)
        except Exception as exc:  # the user's code: stop, naming it and the first row it fails on
            raise RewardError(_raised(reward, exc, prompts, completions, completion_ids, columns, rows,
                                      trainer_state)) from None
        try:
            out = list(out)
        except TypeError:
            raise RewardError(f"{reward.where} ({reward.function}) returned a {type(out).__name__}, not a list of "
                              f"{n} rewards (one per completion), on rows {_rows(rows)}") from None
        if len(out) != n:
            raise RewardError(f"{reward.where} ({reward.function}) returned {len(out)} rewards for {n} completions "
                              f"(one per completion expected), on rows {_rows(rows)}")
        for i, value in enumerate(out):
            if value is None or isinstance(value, numbers.Real) and not isinstance(value, bool) and \
                    math.isnan(float(value)):
                none[f] += 1
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise RewardError(f"{reward.where} ({reward.function}) returned {value!r} for completion {i}, not a "
                                  f"number or None, on row {rows[i]}")
            values[i][f] = float(value)
    return Scores(values, none)


def _rows(rows: list[str]) -> str:
    distinct = list(dict.fromkeys(rows))
    return ", ".join(distinct[:4]) + (f" and {len(distinct) - 4} more" if len(distinct) > 4 else "")


def _raised(reward: RewardFunction, exc: Exception, prompts, completions, completion_ids, columns, rows,
            trainer_state) -> str:
    """What to say when ``reward`` raised on a step's completions: the exception, where in the user's code, and
    the first row whose completions alone make it raise (called again row by row; all the step's rows when none
    does alone)."""
    first = None
    for row in dict.fromkeys(rows):
        idx = [i for i, r in enumerate(rows) if r == row]
        kwargs = {k: [columns[i].get(k) for i in idx] for k in dict.fromkeys(k for i in idx for k in columns[i])}
        try:
            reward.call(prompts=[prompts[i] for i in idx], completions=[completions[i] for i in idx],
                        completion_ids=[completion_ids[i] for i in idx], trainer_state=trainer_state, **kwargs)
        except Exception:  # noqa: BLE001 (the user's code: any exception marks the row)
            first = row
            break
    on = f"on row {first}" if first else f"on rows {_rows(rows)}"
    return (f"{reward.where} ({reward.function}) raised {_one_line(exc)}{_where_raised(exc)}, {on}: the run stops "
            "at a reward function's first error")


# ---------------------------------------------------------------------------------------------------- built-ins


def completion_text(completion) -> str:
    """A completion as reward functions get it (``[{"role": "assistant", "content": text}]``, or a string) -> its
    text (the last message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return str(completion)


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_MARKED = re.compile(r"(?:####|answer\s*(?:is)?\s*[:=])\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str) -> str:
    """A text's final answer: after its reasoning block (``</think>``), the last ``\\boxed{...}``, else what follows
    the last ``####`` or ``answer:`` (its first line), else the whole text.

    >>> extract_answer("<think>2+2</think>So \\\\boxed{4}."), extract_answer("...\\n#### 1,200"), extract_answer("7")
    ('4', '1,200', '7')
    """
    text = text.rsplit("</think>", 1)[-1]
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    marked = _MARKED.findall(text)
    if marked:
        return marked[-1].strip().splitlines()[0] if marked[-1].strip() else ""
    return text


def normalize_answer(text: str) -> str:
    """An answer as ``final_answer`` compares it: whitespace collapsed, case folded, surrounding ``$`` and a final
    ``.`` dropped; a number in its plain form (``1,200.0`` -> ``1200``).

    >>> normalize_answer(" The  Answer. "), normalize_answer("$1,200.0$"), normalize_answer("-0.50")
    ('the answer', '1200', '-0.5')
    """
    text = " ".join(str(text).split()).strip("$ ").rstrip(".").strip().casefold()
    if _NUMBER.fullmatch(text):
        value = float(text.replace(",", ""))
        return str(int(value)) if value.is_integer() else repr(value)
    return text


def final_answer(prompts, completions, *, column: str = "answer", **columns) -> list[float | None]:
    """1.0 where a completion's final answer (``extract_answer``; where the row's is a number, that answer's last
    number) equals its row's ``column`` (its own final answer: a GSM8K solution's ``#### 72`` is 72) after
    ``normalize_answer``, else 0.0; None for a row without the column."""
    truths = columns.get(column)
    if truths is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, truth in zip(completions, truths, strict=True):
        if truth is None:
            out.append(None)
            continue
        want = normalize_answer(extract_answer(str(truth)))
        got = extract_answer(completion_text(completion))
        if _NUMBER.fullmatch(want):  # a number: the answer's last number ("It is 4." -> 4)
            numbers = _NUMBER.findall(got)
            got = numbers[-1] if numbers else ""
        out.append(1.0 if normalize_answer(got) == want else 0.0)
    return out


def matches(prompts, completions, *, pattern: str, full: bool = False, **columns) -> list[float]:
    """1.0 where a completion's text holds ``pattern`` (a regular expression, ``re.DOTALL``; with ``full``, is all
    of it), else 0.0: a format check (``^<think>.*</think>``, an answer tag, a token it must produce)."""
    regex = re.compile(pattern, re.DOTALL)
    find = regex.fullmatch if full else regex.search
    return [1.0 if find(completion_text(c)) else 0.0 for c in completions]


def length_penalty(prompts, completions, *, completion_ids, max_tokens: int, **columns) -> list[float]:
    """0 for a completion of at most ``max_tokens`` tokens, else ``-(tokens - max_tokens) / max_tokens``, at least
    -1: longer than needed costs in proportion."""
    return [0.0 - min(1.0, max(0, len(ids) - max_tokens) / max_tokens) for ids in completion_ids]
