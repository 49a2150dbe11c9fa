"""The calculator tool: a Python arithmetic expression evaluated safely (parsed with ``ast``, never ``eval``).

Allowed: int and float literals, ``+ - * / // % **``, unary ``+ -``, parentheses, and the functions
``abs round min max sqrt``; nothing else (names, attributes, calls of anything else, strings, comprehensions)
is evaluated: such an expression raises :class:`CalculatorError`, which the episode reads as ``error: ...``. Exponents are capped at 64 and every
intermediate integer at 10**100 (so ``9**9**9`` answers with an error instead of holding a core for minutes).
A float result that is a whole number is written as an int (``6 / 3`` -> ``2``), others to 10 significant
digits: the answers the arithmetic and GSM8K rewards compare.

Registered as the tool ``calculator`` (one parameter, ``expression``).
"""

from __future__ import annotations

import ast
import math
import operator

from megarl.agents.tools import register_tool

MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**100
MAX_LENGTH = 500  # characters of an expression
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (the message says what)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (module docstring).

    Raises:
        CalculatorError: syntax, a construct that is not allowed, a too large number, division by zero.
    """
    text = expression.strip().replace("^", "**").replace(",", "")  # 1,234 and 2^3 as people write them
    if len(text) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {e.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is above {MAX_EXPONENT}")
        try:
            out = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(out, complex):
            raise CalculatorError("the result is not a real number")
        if abs(out) > MAX_MAGNITUDE:
            raise CalculatorError("number too large")
        return out
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        try:
            return _FUNCTIONS[node.func.id](*[_value(a) for a in node.args])
        except (TypeError, ValueError) as e:
            raise CalculatorError(f"{node.func.id}: {e}") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % **, parentheses and "
                          f"{', '.join(_FUNCTIONS)} only)")


def format_number(value: int | float) -> str:
    """``value`` as the calculator answers: whole numbers without a decimal point, else 10 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


@register_tool("calculator", description="Evaluate an arithmetic expression such as 12345 + 67890 or (3 + 4) * 5.",
               parameters={"type": "object", "properties": {"expression": {
                   "type": "string", "description": "the expression, e.g. 12345 + 67890"}},
                   "required": ["expression"]})
def calculator(expression: str) -> str:
    """The value of ``expression`` as text (module docstring).

    Raises:
        CalculatorError: as :func:`evaluate` (the episode's observation is ``error: CalculatorError: ...``, a
            tool error of kind ``exception``).
    """
    return format_number(evaluate(str(expression)))
