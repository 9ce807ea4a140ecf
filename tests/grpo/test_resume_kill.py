"""Kill-and-resume exactness with real processes: `grpolab train` is SIGKILLed at KILLS = 3 random
points (chosen by a seeded RNG: after a random number of finished steps, plus a random delay, so a
kill may land in a rollout, in the learning phase or half-way through a checkpoint write), resumed
with --resume after each, and resumed once more to the end. Its metrics.jsonl and samples.jsonl
must equal an uninterrupted run's line for line (every field but the wall-clock ones), and so must
the final weights. The test prints the kill points it tried. (The graceful SIGTERM stop is tested
in test_checkpoint.py.)
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
KILLS = 3
TIMING_KEYS = ("time/", "tokens_per_s/", "mfu")
OVERRIDES = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
    "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
    f"train.steps={STEPS}", "train.minibatch_size=4", "train.microbatch_size=2",  # 2 optimizer steps/step
    "train.lr=1e-2", "train.lr_schedule=cosine", "train.warmup_steps=3",
    "loss.entropy_coef=0.01",  # a gradient even when every group's rewards are equal
    "run.checkpoint_every=1", "run.keep_checkpoints=2", "run.progress=false", "run.tensorboard=false",
]
AGENT = [  # multi-turn episodes: the tiny chat model guessing a number, replies appended as context
    "model.name_or_path=builtin:tiny-chat", "environment.name=grpolab.agents.builtin:GuessNumber",
    "environment.kwargs={n: 9, max_turns: 3}", "data.source=builtin:seeds", "rewards=[]",
    "rollout.max_turns=3", "rollout.max_new_tokens=3",
]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def _start(out: Path, log: Path, resume: bool, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "grpolab.cli", "train", "grpo", *OVERRIDES, *extra, f"run.out_dir={out}"]
    return subprocess.Popen(cmd + (["--resume"] if resume else []), cwd=out.parent, env=ENV,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)


def _complete_lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def _wait(proc: subprocess.Popen, log: Path, timeout: float = 180.0, until=lambda: False) -> None:
    """Waits for `until()` (while the process runs) or for the process to end."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not until():
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


@pytest.mark.parametrize("extra", [(), tuple(AGENT)], ids=["completions", "episodes"])
def test_sigkill_at_random_points_then_resume_matches_an_uninterrupted_run(tmp_path, extra):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref_log, run_log = tmp_path / "reference.log", tmp_path / "killed.log"
    ref = _start(ref_dir, ref_log, resume=False, extra=extra)  # runs alongside the killed chain

    rng = random.Random(1234)
    # metrics lines to wait for before each kill; at least 2 steps remain, so the kill (≤ 0.4 s
    # later) always finds the process running
    marks = sorted(rng.sample(range(1, STEPS - 1), KILLS))
    tried = []
    for i, k in enumerate(marks):
        delay = rng.uniform(0.0, 0.4)
        proc = _start(run_dir, run_log, resume=i > 0, extra=extra)
        _wait(proc, run_log, until=lambda k=k: _complete_lines(run_dir / "metrics.jsonl") >= k)
        assert proc.poll() is None, f"the run ended before kill point {k}:\n{run_log.read_text()[-3000:]}"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
        assert proc.returncode == -signal.SIGKILL
        tried.append((k, round(delay, 2)))
    print(f"\n{len(tried)} SIGKILL points tried (metrics lines written, extra delay in s): {tried}")

    final = _start(run_dir, run_log, resume=True, extra=extra)
    _wait(final, run_log)
    _wait(ref, ref_log)
    assert final.returncode == 0, run_log.read_text()[-3000:]
    assert ref.returncode == 0, ref_log.read_text()[-3000:]

    got, want = _rows(run_dir), _rows(ref_dir)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert len({r["lr"] for r in want}) > 2 and any(r["grad_norm"] > 0 for r in want)  # the test has teeth
    for g, w in zip(got, want):
        assert g == w, f"step {w['step']} differs"
    assert (run_dir / "samples.jsonl").read_text() == (ref_dir / "samples.jsonl").read_text()
    a, b = load_file(run_dir / "final" / "model.safetensors"), load_file(ref_dir / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(tried) == KILLS
