"""Evaluate an arithmetic expression safely: walk its ``ast``, allow numbers and math only, never eval.

::

    evaluate("2 * (3 + 4) ** 2")     # 98
    evaluate("sqrt(2) * cos(pi)")    # -1.4142135623730951
    evaluate("__import__('os')")     # ValueError: function '__import__' is not allowed; ...

Every refusal and arithmetic failure (division by zero, overflow, a math domain error) is a
``ValueError`` whose text says what is allowed.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Number = int | float

MAX_EXPRESSION_CHARS = 500
"""Longer expressions are refused before parsing."""
MAX_INT_BITS = 4096
"""Integer results (and intermediate values) larger than this many bits (~1,230 digits) are refused."""
MAX_EXPONENT = 10_000
"""Powers with a larger absolute exponent are refused before computing them."""

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}

_BINARY_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPERATORS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


@dataclass(frozen=True)
class _Function:
    """A function the calculator may call, with how many arguments it takes."""

    implementation: Callable[..., Any]
    min_args: int
    max_args: int | None


FUNCTIONS: dict[str, _Function] = {
    "sqrt": _Function(math.sqrt, 1, 1),
    "exp": _Function(math.exp, 1, 1),
    "log": _Function(math.log, 1, 2),
    "log10": _Function(math.log10, 1, 1),
    "log2": _Function(math.log2, 1, 1),
    "sin": _Function(math.sin, 1, 1),
    "cos": _Function(math.cos, 1, 1),
    "tan": _Function(math.tan, 1, 1),
    "asin": _Function(math.asin, 1, 1),
    "acos": _Function(math.acos, 1, 1),
    "atan": _Function(math.atan, 1, 1),
    "floor": _Function(math.floor, 1, 1),
    "ceil": _Function(math.ceil, 1, 1),
    "abs": _Function(abs, 1, 1),
    "round": _Function(round, 1, 2),
    "min": _Function(lambda *values: min(values), 1, None),
    "max": _Function(lambda *values: max(values), 1, None),
}

_ALLOWED = (
    "numbers, + - * / // % **, unary -, parentheses, the constants "
    + ", ".join(sorted(CONSTANTS))
    + " and the functions "
    + ", ".join(sorted(FUNCTIONS))
)


def evaluate(expression: str) -> Number:
    """The value of an arithmetic ``expression``; raises ``ValueError`` for anything else."""
    text = expression.strip()
    if not text:
        raise ValueError(f"the expression is empty; write one with {_ALLOWED}")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(
            f"the expression is {len(text)} characters long; the limit is {MAX_EXPRESSION_CHARS}"
        )
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        raise ValueError(f"cannot parse {text!r}: {error.msg}") from None
    try:
        return _evaluate_node(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


def _evaluate_node(node: ast.expr) -> Number:
    """Dispatch on the node type; everything not listed is refused."""
    match node:
        case ast.Constant(value=value):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"only numbers are allowed, got {value!r}; use {_ALLOWED}")
            return _checked(value)
        case ast.Name(id=name):
            if name not in CONSTANTS:
                raise ValueError(f"unknown name {name!r}; allowed constants: {', '.join(sorted(CONSTANTS))}")
            return CONSTANTS[name]
        case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY_OPERATORS:
            return _checked(_UNARY_OPERATORS[type(op)](_evaluate_node(operand)))
        case ast.BinOp(left=left, op=ast.Pow(), right=right):
            return _power(_evaluate_node(left), _evaluate_node(right))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY_OPERATORS:
            apply = _BINARY_OPERATORS[type(op)]
            return _checked(apply(_evaluate_node(left), _evaluate_node(right)))
        case ast.BinOp(op=ast.BitXor()):
            raise ValueError("operator ^ is not supported; write powers with **, e.g. 2 ** 10")
        case ast.Call():
            return _call(node)
        case ast.Attribute():
            raise _attribute_refused(node)
        case _:
            raise ValueError(f"{ast.unparse(node)!r} is not allowed in a calculation; use {_ALLOWED}")


def _call(node: ast.Call) -> Number:
    """A call of an allowed function by name, with positional arguments only."""
    if isinstance(node.func, ast.Attribute):
        raise _attribute_refused(node.func)
    if not isinstance(node.func, ast.Name):
        raise ValueError(f"{ast.unparse(node.func)!r} cannot be called; call functions by name")
    name = node.func.id
    function = FUNCTIONS.get(name)
    if function is None:
        allowed = ", ".join(sorted(FUNCTIONS))
        raise ValueError(f"function {name!r} is not allowed; allowed functions: {allowed}")
    if node.keywords or any(isinstance(argument, ast.Starred) for argument in node.args):
        raise ValueError(f"{name}() takes positional arguments only")
    count = len(node.args)
    if count < function.min_args or (function.max_args is not None and count > function.max_args):
        expected = _arity_text(function)
        raise ValueError(f"{name}() takes {expected}, got {count}")
    arguments = [_evaluate_node(argument) for argument in node.args]
    try:
        return _checked(function.implementation(*arguments))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{name}({', '.join(map(str, arguments))}) failed: {error}") from None


def _attribute_refused(node: ast.Attribute) -> ValueError:
    return ValueError(f"attribute access ({ast.unparse(node)!r}) is not allowed; use {_ALLOWED}")


def _arity_text(function: _Function) -> str:
    if function.max_args is None:
        return f"at least {function.min_args} argument(s)"
    if function.min_args == function.max_args:
        return f"{function.min_args} argument(s)"
    return f"{function.min_args} to {function.max_args} arguments"


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent``, refused before computing when the result would be huge."""
    if abs(exponent) > MAX_EXPONENT:
        raise ValueError(f"exponent {exponent} is too large; the limit is {MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        estimated_bits = exponent * math.log2(abs(base))
        if estimated_bits > MAX_INT_BITS:
            raise ValueError(
                f"{base} ** {exponent} is too large (about {int(estimated_bits * math.log10(2))} "
                f"digits); results are limited to {MAX_INT_BITS} bits"
            )
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    return _checked(base**exponent)


def _checked(value: object) -> Number:
    """Refuse complex, non-finite and oversized results."""
    if isinstance(value, complex):
        raise ValueError("the result is not a real number (e.g. a fractional power of a negative number)")
    if not isinstance(value, (int, float)):
        raise ValueError(f"the result is not a number, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"the result has more than {MAX_INT_BITS} bits; use smaller numbers")
    return value
