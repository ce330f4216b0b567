"""Reward functions: imported from ``rl.rewards`` (errors name the entry), called TRL's way, their failures
stopping the run naming the function and the row, ``None`` counted; our built-ins by hand."""

from __future__ import annotations

import math
import re
import textwrap

import pytest

from qlora_train.config import RewardSpec
from qlora_train.rl.rewards import (
    RewardError,
    extract_answer,
    final_answer,
    length_penalty,
    load_rewards,
    matches,
    normalize_answer,
    score,
)

USER_REWARDS = '''
def exact(prompts, completions, answer, **kwargs):
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

def picky(prompts, completions, **kwargs):
    return [None if c[0]["content"] == "?" else 0.5 for c in completions]

def boom(prompts, completions, answer, **kwargs):
    return [1.0 / len(a) for a in answer]  # ZeroDivisionError on an empty answer

def short(prompts, completions, **kwargs):
    return [1.0]

def words(prompts, completions, **kwargs):
    return ["yes" for _ in completions]

def sees(prompts, completions, completion_ids, trainer_state, **kwargs):
    return [float(len(ids)) + (trainer_state or 0) for ids in completion_ids]

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    (tmp_path / "broken_rewards.py").write_text("import math\nVALUE = 1 / 0\n")
    monkeypatch.chdir(tmp_path)  # a module beside the config, in the current directory
    return "my_rewards"


def spec(function: str, **kw) -> RewardSpec:
    return RewardSpec(function=function, **kw)


def test_functions_are_imported_from_the_current_directory_with_their_weights(user_module):
    rewards = load_rewards([spec("my_rewards:exact", weight=2.0), spec("my_rewards:exact"),
                            spec("qlora_train.rl.rewards:matches", kwargs={"pattern": "^4"})])
    assert [(r.name, r.weight, r.where) for r in rewards] == [
        ("exact", 2.0, "rl.rewards[0]"), ("exact_1", 1.0, "rl.rewards[1]"), ("matches", 1.0, "rl.rewards[2]")]


@pytest.mark.parametrize(("function", "says"), [
    ("no_such_module:f", "rl.rewards[0].function: cannot import no_such_module: No module named 'no_such_module'"),
    ("my_rewards:nope", "rl.rewards[0].function: my_rewards has no 'nope' (its functions: boom, exact, picky, sees, "
                        "short, words)"),
    ("my_rewards:NOT_A_FUNCTION", "rl.rewards[0].function: my_rewards:NOT_A_FUNCTION is a int, not a function"),
    ("broken_rewards:f", "rl.rewards[0].function: importing broken_rewards raised ZeroDivisionError: division by "
                         "zero at broken_rewards.py:2"),
])
def test_a_function_that_cannot_be_had_is_one_line(user_module, function, says):
    with pytest.raises(RewardError) as exc:
        load_rewards([spec(function)])
    assert str(exc.value).startswith(says), str(exc.value)
    assert "\n" not in str(exc.value) and exc.value.exit_code == 2


def completions(*texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


ROWS = ["d.jsonl:1", "d.jsonl:1", "d.jsonl:2", "d.jsonl:2"]


def call(rewards, texts, answers, rows=ROWS):
    return score(rewards, [[{"role": "user", "content": "q"}]] * len(texts), completions(*texts),
                 [{"answer": a} for a in answers], completion_ids=[[1] * len(t) for t in texts], rows=rows)


def test_scores_per_function_and_none_counted(user_module):
    rewards = load_rewards([spec("my_rewards:exact"), spec("my_rewards:picky")])
    s = call(rewards, ["4", "5", "?", "x"], ["4", "4", "y", "x"])
    assert [row[0] for row in s.values] == [1.0, 0.0, 0.0, 1.0]
    assert [row[1] for row in s.values][:2] == [0.5, 0.5] and math.isnan(s.values[2][1])
    assert s.none == [0, 1]


def test_the_call_passes_completion_ids_and_the_trainer_state(user_module):
    (sees,) = load_rewards([spec("my_rewards:sees")])
    s = score([sees], [[]] * 2, completions("ab", "c"), [{}, {}], completion_ids=[[1, 2], [3]], rows=ROWS[:2],
              trainer_state=10)
    assert [row[0] for row in s.values] == [12.0, 11.0]


def test_a_function_that_raises_names_itself_the_exception_and_the_first_row_it_fails_on(user_module):
    rewards = load_rewards([spec("my_rewards:boom")])
    with pytest.raises(RewardError) as exc:
        call(rewards, ["a", "b", "c", "d"], ["x", "x", "", ""])  # row 2's answer is empty
    assert str(exc.value) == ("rl.rewards[0] (my_rewards:boom) raised ZeroDivisionError: float division by zero "
                              "at my_rewards.py:9, on row d.jsonl:2: the run stops at a reward function's first error")


@pytest.mark.parametrize(("function", "says"), [
    ("my_rewards:short", "rl.rewards[0] (my_rewards:short) returned 1 rewards for 4 completions (one per "
                         "completion expected), on rows d.jsonl:1, d.jsonl:2"),
    ("my_rewards:words", "rl.rewards[0] (my_rewards:words) returned 'yes' for completion 0, not a number or None, on "
                         "row d.jsonl:1"),
])
def test_a_wrong_answer_from_a_function_stops_the_run(user_module, function, says):
    with pytest.raises(RewardError, match="^" + re.escape(says)):
        call(load_rewards([spec(function)]), ["a", "b", "c", "d"], ["x"] * 4)


def test_final_answer_compares_the_final_answers_normalised():
    texts = ["<think>3?</think>It is 4.", "so \\boxed{1,200}", "#### -0.50", "Answer: Paris", "no idea"]
    truths = ["4", "#### 1200", "-.5", "paris", None]
    assert final_answer(None, completions(*texts), answer=truths) == [1.0, 1.0, 0.0, 1.0, None]
    assert final_answer(None, completions("4"), column="solution", answer=["4"]) == [None]
    assert (extract_answer("x \\boxed{a{b}c} y"), normalize_answer("-.5"), normalize_answer("1e3")) == \
        ("a{b}c", "-.5", "1e3")


def test_matches_and_length_penalty():
    assert matches(None, completions("<think>\n</think>ok", "ok"), pattern="^<think>") == [1.0, 0.0]
    assert matches(None, ["abc", "abcd"], pattern="abc", full=True) == [1.0, 0.0]
    assert length_penalty(None, ["", "", ""], completion_ids=[[1] * 4, [1] * 6, [1] * 40], max_tokens=4) == \
        [0.0, -0.5, -1.0]
