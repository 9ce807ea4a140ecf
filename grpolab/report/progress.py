"""Training progress: a rich live display on a terminal, plain log lines elsewhere.

    prog = Progress(total_steps=100)
    for step in range(100):
        prog.phase("rollout")
        ...
        prog.phase("learn", "epoch 1/2 minibatch 3/4")
        ...
        prog.step_done(step, {"reward/mean": 0.4, "kl": 0.01})
    prog.close()

When the stream is not a TTY (CI, a log file) every phase change and every finished step prints
one plain line: no carriage returns, no ANSI escape codes. Detail-only updates (the minibatch
counter) are shown live on a terminal and not printed as lines.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

# (metrics key, label, format) shown after each step when present in the stats.
SHOWN_STATS: tuple[tuple[str, str, str], ...] = (
    ("reward/mean", "reward", "{:.4f}"),
    ("accuracy", "acc", "{:.3f}"),
    ("kl", "kl", "{:.4g}"),
    ("loss", "loss", "{:.4g}"),
)


def format_duration(seconds: float) -> str:
    """H:MM:SS (or M:SS under an hour); '?' for an unknown duration."""
    if not seconds >= 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_stats(stats: dict[str, Any]) -> str:
    """'reward 0.5000 | kl 0.001' from the SHOWN_STATS keys present (None shown as 'n/a')."""
    parts = []
    for key, label, fmt in SHOWN_STATS:
        if key in stats:
            v = stats[key]
            parts.append(f"{label} {'n/a' if v is None else fmt.format(v)}")
    return " | ".join(parts)


class Progress:
    """Progress over `total_steps` GRPO steps with phases and an ETA.

    total_steps: steps of this run; start_step: steps already done (when resuming), so the
        counter and the ETA start there. enabled=False prints nothing.
    stream: where to write (default sys.stderr); a TTY gets the rich live display.
    clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, total_steps: int, *, enabled: bool = True, stream: TextIO | None = None,
                 start_step: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        if total_steps < 0 or not 0 <= start_step <= max(total_steps, 0):
            raise ValueError(f"progress: need 0 <= start_step <= total_steps, got "
                             f"start_step={start_step} total_steps={total_steps}")
        self.total = total_steps
        self.done = start_step
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._t0 = clock()
        self._start = start_step
        self._phase = ""
        self._rich = None
        if enabled and _isatty(self.stream):
            self._rich = _RichView(self.stream, total_steps, start_step)

    # -- timing ---------------------------------------------------------------------------
    def seconds_per_step(self) -> float | None:
        """Mean wall time of the steps finished since this object was created."""
        n = self.done - self._start
        return (self._clock() - self._t0) / n if n > 0 else None

    def eta_seconds(self) -> float | None:
        sps = self.seconds_per_step()
        return None if sps is None else sps * max(self.total - self.done, 0)

    # -- events ---------------------------------------------------------------------------
    def phase(self, name: str, detail: str = "") -> None:
        """Marks the current phase (e.g. rollout, score, learn) of the step being run."""
        if not self.enabled:
            return
        changed = name != self._phase
        self._phase = name
        if self._rich is not None:
            self._rich.update(phase=f"{name} {detail}".strip())
        elif changed:
            text = f"{name}: {detail}" if detail else name
            self._print(f"[{self._counter(self.done + 1)}] {text}")

    def step_done(self, step: int, stats: dict[str, Any] | None = None) -> None:
        """Records one finished step (its index as logged, and its metrics row)."""
        self.done += 1
        self._phase = ""
        if not self.enabled:
            return
        sps = self.seconds_per_step()
        stats_text = format_stats(stats or {})
        if self._rich is not None:
            self._rich.advance(f"step {step} | {stats_text}" if stats_text else f"step {step}")
            return
        parts = [f"[{self._counter(self.done)}] step {step} done"]
        if stats_text:
            parts.append(stats_text)
        parts.append(f"{sps:.2f} s/step" if sps is not None else "? s/step")
        parts.append(f"eta {format_duration(self.eta_seconds() or 0.0)}")
        self._print(" | ".join(parts))

    def log(self, message: str) -> None:
        """A free-form line (e.g. 'saved checkpoint step-10') that does not break the display."""
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.log(message)
        else:
            self._print(message)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------
    def _counter(self, n: int) -> str:
        width = len(str(self.total))
        return f"{min(n, self.total):>{width}}/{self.total}"

    def _print(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _RichView:
    """The rich live display, three lines: bar with n/total, elapsed and ETA; the current phase;
    the last finished step's stats."""

    def __init__(self, stream: TextIO, total: int, start: int) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                   TextColumn, TimeElapsedColumn, TimeRemainingColumn)

        self.console = Console(file=stream)
        self.bar = RichProgress(
            TextColumn("[bold]GRPO step"), BarColumn(bar_width=30), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=self.console)
        self.task = self.bar.add_task("grpo", total=total, completed=start)
        self.phase_text = ""
        self.last_text = ""
        self.live = Live(Group(self.bar, self), console=self.console, refresh_per_second=4)
        self.live.start()

    def __rich__(self):
        from rich.text import Text

        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("phase: ", style="dim").append(self.phase_text or "-")
        text.append("\nlast:  ", style="dim").append(self.last_text or "-")
        return text

    def update(self, phase: str) -> None:
        self.phase_text = phase

    def advance(self, last: str) -> None:
        self.phase_text = ""
        self.last_text = last
        self.bar.update(self.task, advance=1)

    def log(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False)

    def stop(self) -> None:
        self.live.stop()
