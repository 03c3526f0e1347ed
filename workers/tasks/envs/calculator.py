"""The built-in ``calculator`` environment: hermes / verl style tool calls.

The last assistant turn's ``<tool_call>{"name": "calculator", "arguments": {"expression":
"3*(4+5)"}}</tool_call>`` gets a tool message with the value; a bad call (JSON, tool name,
expression) gets an ``"Error: ..."`` tool message, as verl's tools answer; a turn with no tool
call ends the trajectory (None). Expressions are numbers, ``+ - * / ** // %`` and parentheses,
evaluated from their ``ast`` (never ``eval``). ``TOOLS`` is its OpenAI schema, which the policy's
prompts show through a chat template's ``tools`` (``envs/tools.py``)."""
from __future__ import annotations

import ast
import json
import math
import operator
import re

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_POWER_BITS = 10_000  # a power's result at most this many bits: 9**9**9 would run for minutes
MAX_LENGTH = 1000  # characters of an expression
TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression: numbers, + - * / ** // % and parentheses.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "the expression, e.g. 3*(4+5)"}}}}}]


def evaluate(expression: str) -> float | int:
    """The value of an arithmetic expression; ValueError saying what is not allowed."""
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return _value(tree.body)
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    except RecursionError:  # ~1000 nested signs or parentheses, a policy's run of dashes
        raise ValueError("the expression is nested too deeply") from None


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and abs(right) * math.log2(abs(left)) > MAX_POWER_BITS:
            raise ValueError(f"{_format(left)} ** {_format(right)} is too large")
        try:
            out = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError) as e:
            raise ValueError(str(e)) from None
        if not isinstance(out, (int, float)):  # a negative number to a fractional power: complex
            raise ValueError(f"{ast.unparse(node)!r} is not a real number")
        return out
    raise ValueError(f"{ast.unparse(node)!r} is not allowed (numbers, + - * / ** // % and parentheses)")


def _format(value: float | int) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)


def calculator_env(task, messages: list[dict]) -> str | None:
    """The tool's answer to the last assistant turn's first tool call; None when it has none."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    match = TOOL_CALL.search(str(last.get("content") or "")) if last else None
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except (ValueError, RecursionError) as e:  # a JSONDecodeError; an int past 4300 digits; [[[[...
        return f"Error: the tool call is not valid JSON ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(call, dict) or call.get("name") != "calculator":
        name = call.get("name") if isinstance(call, dict) else None
        return f"Error: unknown tool {name!r} (the one tool is 'calculator')"
    args = call.get("arguments")
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            pass
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return "Error: the calculator takes {\"expression\": \"<arithmetic>\"}"
    try:
        return _format(evaluate(expression))
    except ValueError as e:
        return f"Error: {e}"


calculator_env.TOOLS = TOOLS
