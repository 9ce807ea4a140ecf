import io
import re

import pytest

from grpolab.report.progress import Progress, format_duration

ANSI = re.compile(r"\x1b\[|\x1b\]|\x1b")


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def run_steps(prog, clock, steps):
    for step in range(steps):
        prog.phase("rollout")
        prog.phase("score")
        for mb in range(2):
            prog.phase("learn", f"epoch 1/1 minibatch {mb + 1}/2")
        clock.t += 2.0
        prog.step_done(step, {"reward/mean": 0.25 * step, "kl": 0.001, "other": 5})


def test_plain_output_one_line_per_phase_and_step_no_control_codes():
    out, clock = io.StringIO(), FakeClock()
    prog = Progress(4, stream=out, clock=clock)
    run_steps(prog, clock, 4)
    prog.log("saved checkpoint step-4")
    prog.close()
    text = out.getvalue()
    assert "\r" not in text and not ANSI.search(text)
    lines = text.splitlines()
    # Per step: rollout, score, learn (minibatch changes within a phase are not new lines), done.
    assert len(lines) == 4 * 4 + 1
    assert lines[0] == "[1/4] rollout"
    assert lines[2] == "[1/4] learn: epoch 1/1 minibatch 1/2"
    done = [line for line in lines if " done" in line]
    assert done[0] == "[1/4] step 0 done | reward 0.0000 | kl 0.001 | 2.00 s/step | eta 0:06"
    assert done[3] == "[4/4] step 3 done | reward 0.7500 | kl 0.001 | 2.00 s/step | eta 0:00"
    assert lines[-1] == "saved checkpoint step-4"


def test_resume_counts_from_start_step():
    out, clock = io.StringIO(), FakeClock()
    prog = Progress(10, stream=out, clock=clock, start_step=8)
    clock.t += 3.0
    prog.step_done(8, {})
    assert prog.eta_seconds() == pytest.approx(3.0)
    assert out.getvalue().splitlines() == ["[ 9/10] step 8 done | 3.00 s/step | eta 0:03"]


def test_disabled_prints_nothing():
    out, clock = io.StringIO(), FakeClock()
    prog = Progress(3, stream=out, enabled=False, clock=clock)
    run_steps(prog, clock, 3)
    prog.log("hello")
    assert out.getvalue() == ""
    assert prog.done == 3


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_tty_uses_rich_live_display():
    out, clock = FakeTTY(), FakeClock()
    with Progress(2, stream=out, clock=clock) as prog:
        run_steps(prog, clock, 2)
    text = out.getvalue()
    assert "\x1b[" in text  # rich drew with terminal control codes
    assert "2/2" in text and "reward 0.2500" in text


def test_format_duration():
    assert format_duration(59.6) == "1:00"
    assert format_duration(3725) == "1:02:05"
    assert format_duration(float("nan")) == "?"


def test_bad_start_step():
    with pytest.raises(ValueError, match="start_step"):
        Progress(3, start_step=4, stream=io.StringIO())
