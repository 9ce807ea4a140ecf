"""Built-in environments and tools, for demos and tests. Deterministic given the item.

- `CalculatorTask` with the `calculator` tool: multiply two `digits`-digit numbers (4 by default:
  too big for a tiny model's head, easy with the tool). Config:
      environment: {name: "grpolab.agents.builtin:CalculatorTask", kwargs: {digits: 4}}
      rollout.tools: ["grpolab.agents.builtin:calculator"]
- `GuessNumber`: find a secret in [1, n] from "higher"/"lower" replies.
- `run_python`: a code tool; the code runs in grpolab's sandbox (sandbox/sandbox.py: another uid,
  resource limits, no network), never in the training process.

An item is a dict: {"seed": int} (operands or secret drawn from random.Random(seed)), or the
values themselves ({"a": int, "b": int} / {"secret": int}).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction
from typing import Any

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200
_MAX_MAGNITUDE = 10**60
_INT = re.compile(r"-?\d+")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression on integers: + - * / and parentheses.

    Args:
        expression: The expression, e.g. "(1234 + 5) * 678".
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of an expression tree of integer literals, + - * / and unary +/-; ValueError else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        value = _OPS[type(node.op)](left, right)
    else:
        raise ValueError(f"unsupported: {ast.unparse(node)!r} (only integers, + - * / and parentheses)")
    if abs(value) > _MAX_MAGNITUDE:
        raise ValueError("number too large")
    return value


def last_integer(text: str) -> int | None:
    """The last integer written in `text` ("1,234" reads as 1234), None when there is none."""
    found = _INT.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return int(found[-1]) if found else None


def _rng(item: Any) -> random.Random:
    if not isinstance(item, dict) or not isinstance(item.get("seed"), int):
        raise ValueError(f"expected an item {{'seed': int}}, got {item!r}"[:200])
    return random.Random(item["seed"])


class CalculatorTask:
    """Multiply two numbers; reward 1.0 when the final answer is the product, else 0.0.

    One step: the first assistant message that the driver hands here (tool calls are answered by
    the tools, not here) is the final answer, read as its last integer. digits: operand size.
    """

    def __init__(self, digits: int = 4):
        if digits < 1:
            raise ValueError(f"CalculatorTask: digits must be >= 1, got {digits}")
        self.digits = digits
        self.operands: tuple[int, int] | None = None
        self.answer: int | None = None

    def reset(self, item: Any) -> list[dict[str, str]]:
        if isinstance(item, dict) and "a" in item and "b" in item:
            a, b = int(item["a"]), int(item["b"])
        else:
            rng = _rng(item)
            a, b = (rng.randrange(10 ** (self.digits - 1), 10**self.digits) for _ in range(2))
        self.operands, self.answer = (a, b), a * b
        return [{"role": "user", "content": f"What is {a} * {b}?"}]

    def step(self, message: dict[str, str]) -> tuple[list[dict[str, str]], float, bool]:
        correct = last_integer(message["content"]) == self.answer
        return [], 1.0 if correct else 0.0, True


class GuessNumber:
    """Guess a secret in [1, n]. Each assistant message must contain a number (its last integer is the
    guess); the reply is "higher", "lower" or "correct" ("Reply with a number." when there is none,
    which uses up the turn). Done when solved or after max_turns guesses. Reward, at the end only:
    1.0 - turn_cost * (guesses - 1) when solved (turn_cost = 0 by default: any solve within the turns
    is 1.0; a small cost, e.g. 0.05, rewards fewer guesses), 0.0 when not solved. Give the driver
    max_turns >= this max_turns, or it cuts the episode (truncated) before the game ends.
    hint: each "higher" / "lower" reply also names the secrets that the replies so far leave
    ("higher, 9 to 16"), so the best next guess depends on the last reply only.
    """

    def __init__(self, n: int = 100, max_turns: int = 7, turn_cost: float = 0.0, hint: bool = False):
        if n < 1 or max_turns < 1 or not 0.0 <= turn_cost * (max_turns - 1) <= 1.0:
            raise ValueError(f"GuessNumber: need n >= 1, max_turns >= 1, 0 <= turn_cost*(max_turns-1) <= 1; got "
                             f"n={n}, max_turns={max_turns}, turn_cost={turn_cost}")
        self.n, self.max_turns, self.turn_cost, self.hint = n, max_turns, turn_cost, hint
        self.secret, self.guesses, self.lo, self.hi = 0, 0, 1, n

    def reset(self, item: Any) -> list[dict[str, str]]:
        if isinstance(item, dict) and "secret" in item:
            self.secret = int(item["secret"])
        else:
            self.secret = _rng(item).randint(1, self.n)
        self.guesses, self.lo, self.hi = 0, 1, self.n
        return [{"role": "user", "content": f"Guess my number between 1 and {self.n}: I say higher, lower or correct. "
                                            f"{self.max_turns} guesses."}]

    def step(self, message: dict[str, str]) -> tuple[list[dict[str, str]], float | None, bool]:
        self.guesses += 1
        guess = last_integer(message["content"])
        if guess == self.secret:
            return [{"role": "user", "content": "correct"}], 1.0 - self.turn_cost * (self.guesses - 1), True
        if guess is None:
            reply = "Reply with a number."
        elif self.secret > guess:
            self.lo = max(self.lo, guess + 1)
            reply = f"higher, {self.lo} to {self.hi}" if self.hint else "higher"
        else:
            self.hi = min(self.hi, guess - 1)
            reply = f"lower, {self.lo} to {self.hi}" if self.hint else "lower"
        if self.guesses >= self.max_turns:
            return [{"role": "user", "content": reply}], 0.0, True
        return [{"role": "user", "content": reply}], None, False


def run_python(code: str) -> str:
    """Runs Python code in a sandbox and returns what it printed.

    Args:
        code: A complete Python program; print what you want to see.
    """
    from grpolab.sandbox.sandbox import run_sandboxed

    result = run_sandboxed(code, timeout_s=5.0, memory_mb=512, max_output_bytes=4096)
    text = result.stdout
    if not result.passed:
        text += (("\n" if text else "") + result.stderr.strip()[-1000:] + f"\n[{result.reason}]").lstrip("\n")
    return text


run_python.timeout_s = 15.0  # the tool's time limit (tools.load_tools): the sandbox's 5 s plus its start-up;
# longer than the sandbox's own limit, so the worker is not killed while the sandbox cleans up
