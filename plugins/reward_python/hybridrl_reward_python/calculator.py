"""Tool ``calculator``: arithmetic on the model's expression, read as a syntax tree (no code run)."""

from __future__ import annotations

import ast
import math
import operator

from pydantic import Field

from hybridrl.components import Options, Tool

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator(Tool):
    """Evaluates an arithmetic expression: numbers, + - * / // % **, parentheses."""

    class Options(Options):
        max_digits: int = Field(60, gt=0, description="Refuse results with more digits than this.")

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression, e.g. 12 * (3 + 4) ** 2.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "The expression."}},
                    "required": ["expression"],
                },
            },
        }

    def __call__(self, arguments: dict) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError('give the expression as a string: {"expression": "2 + 2"}')
        value = self._eval(ast.parse(expression.strip(), mode="eval").body)
        if isinstance(value, float):
            return f"{value:.12g}"
        return str(value)

    def _eval(self, node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > self.options.max_digits:
                raise ValueError(f"the result would have more than {self.options.max_digits} digits")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and len(str(abs(value))) > self.options.max_digits:
                raise ValueError(f"the result has more than {self.options.max_digits} digits")
            return value
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")
