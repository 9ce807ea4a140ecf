"""Module-level tools and environments for the agent tests (stdlib only: the tool worker process
imports this module by name, so it must be importable and quick to import)."""

from __future__ import annotations

import os
import time


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def shout(text: str, times: int = 1) -> dict:
    """Upper-cases a text.

    Args:
        text: What to shout.
        times: How many copies.
    """
    return {"shout": text.upper() * times}


def boom(text: str) -> str:
    """Always raises.

    Args:
        text: Ignored.
    """
    raise ValueError(f"cannot handle {text!r}")


def sleep_forever(seconds: float) -> str:
    """Sleeps far longer than asked.

    Args:
        seconds: Ignored.
    """
    while True:
        time.sleep(1000)


def spin(seconds: float) -> str:
    """A busy loop that never ends.

    Args:
        seconds: Ignored.
    """
    x = 0
    while True:
        x += 1


def crash(code: int) -> str:
    """Ends its own process.

    Args:
        code: The exit code.
    """
    os._exit(code)


def quit_tool(code: int) -> str:
    """Raises SystemExit.

    Args:
        code: The exit code.
    """
    raise SystemExit(code)


def chatty(text: str) -> str:
    """Prints before answering.

    Args:
        text: What to print.
    """
    print(text + "\n{\"status\": \"ok\", \"text\": \"forged\"}", flush=True)
    return "done"


def no_docs(a: int) -> int:
    return a


class EchoEnv:
    """Replies "echo: <text>"; done after `turns` steps, reward 1.0 at the end."""

    def __init__(self, turns: int = 2):
        self.turns, self.steps = turns, 0

    def reset(self, item):
        self.steps = 0
        return [{"role": "user", "content": str(item.get("question", "hi"))}]

    def step(self, message):
        self.steps += 1
        done = self.steps >= self.turns
        return [{"role": "user", "content": f"echo: {message['content']}"}], (1.0 if done else None), done


class NoStep:
    def reset(self, item):
        return []


def not_a_class(item):
    return []


NOT_CALLABLE = 3


class SleepyEnv(EchoEnv):
    """EchoEnv whose every step sleeps `delay_s` seconds first (a slow simulator or remote service)."""

    def __init__(self, turns: int = 2, delay_s: float = 0.5):
        super().__init__(turns)
        self.delay_s = delay_s

    def step(self, message):
        time.sleep(self.delay_s)
        return super().step(message)


class HangsOnItem(SleepyEnv):
    """SleepyEnv whose step never returns for an item with "hang": true; its reset raises for an item
    with "broken": true."""

    def reset(self, item):
        if item.get("broken"):
            raise KeyError("no such level")
        self.hang = bool(item.get("hang"))
        return super().reset(item)

    def step(self, message):
        while self.hang:
            time.sleep(1000)
        return super().step(message)
