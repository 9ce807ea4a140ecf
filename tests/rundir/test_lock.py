"""One writer per output folder (grpolab.rundir.lock), with real concurrent processes: while one process
holds a folder every other command that would write it is refused with one message naming the holder's
PID and command; a SIGKILLed holder leaves no stale lock. A folder of the user's own files is never
written over (`grpolab data --out`, `export --out`, any run folder): --overwrite moves it aside."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpolab import cli
from grpolab.rundir.lock import LOCK_FILE, lock_folder, release
from grpolab.rundir.rundir import claim

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=8", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false", "run.threads=1"]
HOLD = ("import sys, time; from grpolab.rundir.rundir import claim; claim(sys.argv[1], 'train'); "
        "print('held', flush=True); time.sleep(120)")


def _holder(folder: Path) -> subprocess.Popen:
    """A process that claims `folder` for a train run and sleeps."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def held(tmp_path):
    run = tmp_path / "run"
    proc = _holder(run)
    yield run, proc
    proc.kill()
    proc.wait()


def test_every_writer_is_refused_while_another_process_holds_the_folder(held, tmp_path, capsys):
    run, proc = held
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # a run in progress
    attempts = [
        ["train", "grpo", *TINY, f"run.out_dir={run}", "train.steps=1"],
        ["train", "grpo", *TINY, f"run.out_dir={run}", "train.steps=1", "--resume"],
        ["train", "grpo", *TINY, f"run.out_dir={run}", "train.steps=1", "--overwrite"],
        ["sft", "sft", *TINY, "sft.steps=1", f"run.out_dir={run}"],
        ["demo", "--quick", "--out", str(run), "train.steps=1"],
        ["rm", "--data", "builtin:accuracy", "--out", str(run)],
        ["data", "--out", str(run), "--prompts", "3", "--pairs", "2", "--heldout-pairs", "2"],
    ]
    for argv in attempts:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"is in use by PID {proc.pid} (python -c ... {run})" in err, (argv, err)
        assert "Traceback" not in err
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "metrics.jsonl", "run.json"]


def test_export_into_a_held_folder_is_refused(held, tmp_path, capsys):
    src = tmp_path / "src"
    assert cli.main(["train", "grpo", *TINY, f"run.out_dir={src}", "train.steps=1"]) == 0
    run, proc = held
    assert cli.main(["export", str(src), "--out", str(run)]) == 2
    assert f"--out='{run}' is in use by PID {proc.pid}" in capsys.readouterr().err


def test_a_killed_holder_leaves_no_stale_lock(held):
    run, proc = held
    with pytest.raises(Exception, match=f"in use by PID {proc.pid}"):
        claim(run, "train", resume=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (run / LOCK_FILE).exists()  # the file stays; the kernel released the lock
    assert claim(run, "train", resume=True) == run
    release(run)


def test_two_train_runs_started_together_one_is_refused(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpolab", "train", "grpo", *TINY, f"run.out_dir={run}", "train.steps=2"]
    procs = [subprocess.Popen(cmd, env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    (_, _, refused), = [r for r in results if r[0] == 2]
    winner, = [p for p, r in zip(procs, results) if r[0] == 0]
    assert f"is in use by PID {winner.pid} (grpolab train grpo" in refused and "Traceback" not in refused
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]


def test_the_same_process_may_take_its_own_lock_again(tmp_path):
    assert lock_folder(tmp_path / "a") == lock_folder(tmp_path / "a")
    release(tmp_path / "a")
    proc = _holder(tmp_path / "a")  # released: another process takes it
    proc.kill()
    proc.wait()


def test_data_never_writes_over_the_users_files(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "prompts.jsonl").write_text('{"prompt": "my own"}\n')
    small = ["--prompts", "3", "--pairs", "2", "--heldout-pairs", "2"]
    assert cli.main(["data", "--out", str(out), *small]) == 2
    err = capsys.readouterr().err
    assert f"--out='{out}' holds prompts.jsonl, which grpolab data did not write" in err
    assert (out / "prompts.jsonl").read_text() == '{"prompt": "my own"}\n'
    assert cli.main(["data", "--out", str(out), *small, "--overwrite"]) == 0
    moved, = tmp_path.glob("mine.old-*")
    assert (moved / "prompts.jsonl").read_text() == '{"prompt": "my own"}\n'
    assert cli.main(["data", "--out", str(out), *small]) == 0  # its own unchanged files: written again
    (out / "sft.jsonl").write_text("edited\n")
    assert cli.main(["data", "--out", str(out), *small]) == 2
    assert "holds sft.jsonl" in capsys.readouterr().err and (out / "sft.jsonl").read_text() == "edited\n"


def test_a_run_never_writes_into_a_folder_of_the_users_files(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my: own\n")
    assert cli.main(["train", "grpo", *TINY, f"run.out_dir={out}", "train.steps=1"]) == 2
    assert "holds files grpolab did not write (config.yaml)" in capsys.readouterr().err
    assert (out / "config.yaml").read_text() == "my: own\n"
    src = tmp_path / "src"
    assert cli.main(["train", "grpo", *TINY, f"run.out_dir={src}", "train.steps=1"]) == 0
    assert cli.main(["export", str(src), "--out", str(out)]) == 2
    assert "holds files grpolab did not write (config.yaml)" in capsys.readouterr().err
    assert cli.main(["export", str(src), "--out", str(out), "--overwrite"]) == 0
    moved, = tmp_path.glob("mine.old-*")
    assert (moved / "config.yaml").read_text() == "my: own\n" and (out / "model.safetensors").is_file()
