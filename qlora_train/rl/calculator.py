"""The demo's tool (``make demo-agent``) and its reward: arithmetic on numbers, evaluated safely (no names, no
calls, no attributes: the expression's syntax tree is walked, only numbers and + - * / // % ** and parentheses).

    >>> calculate("2 + 3 * (4 - 1)")
    '11'
    >>> calculate("__import__('os')")
    Traceback (most recent call last):
    ValueError: only numbers and + - * / // % ** ( ) are allowed, not Call
"""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * (3 + 4)".
    """
    value = _eval(ast.parse(expression, mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def tool_result_read(prompts, completions, **columns) -> list[float]:
    """The demo's reward for using a tool: 1 for a rollout in which a call parsed and its tool returned a result
    (a tool message that is not an error), else 0. ``completions`` are the rollouts' messages after the prompt.

    >>> tool_result_read(None, [[{"role": "assistant", "content": ""}, {"role": "tool", "content": "84"}],
    ...                         [{"role": "assistant", "content": "84"}]])
    [1.0, 0.0]
    """
    return [float(any(isinstance(m, dict) and m.get("role") == "tool" and not str(m.get("content", "")).startswith(
        "error:") for m in completion)) if isinstance(completion, list) else 0.0 for completion in completions]
