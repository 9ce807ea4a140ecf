"""`--nproc N` validates the config as its N ranks will before it starts torchrun: an input error is one
message, exit code 2, and no launcher starts (so no launcher traceback). An input error the ranks find
after they started (a data file, a reward) is printed once by the launching process, exit code 2, no
launcher traceback; a rank that dies is one grpolab line. Under plain torchrun only rank 0 prints an
input error. Ray rollout or reward workers under plain torchrun are refused at validation with the
command that works (`--ray`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpolab import cli, config as C

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=8", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false"]


@pytest.fixture
def no_exec(monkeypatch):
    from grpolab.parallel import launch

    def refuse(*a):
        raise AssertionError(f"torchrun was started: {a}")

    monkeypatch.setattr(launch, "run_torchrun", refuse)
    monkeypatch.setattr(os, "execv", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("extra, message", [
    (["rollout.prompts_per_step=3", "train.minibatch_size=12"],
     "rollout.prompts_per_step=3 does not split over the 2 ranks"),
    (["train.microbatch_size=3"], "train.microbatch_size=3 does not divide the 4 sequences"),
    (["rollout.workers=1"], "--nproc 2 --ray"),
    (["rollout.reward_workers=1"], "rollout.reward_workers=1 start Ray actors"),
])
def test_nproc_refuses_before_torchrun_with_one_message(no_exec, extra, message, tmp_path, capsys):
    assert cli.main(["train", "grpo", *TINY, *extra, f"run.out_dir={tmp_path / 'r'}", "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert "WORLD_SIZE" not in os.environ


def test_ranks_started_by_torchrun_refuse_ray_workers(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("GRPOLAB_RAY_TRAINER", raising=False)
    with pytest.raises(C.ConfigError, match="--ray"):
        C.from_preset("grpo", [*TINY, "rollout.workers=1"])
    monkeypatch.setenv("GRPOLAB_RAY_TRAINER", "1")  # ranks placed by `--ray` share the driver's cluster
    C.from_preset("grpo", [*TINY, "rollout.workers=1"])


def test_only_rank_0_prints_an_input_error(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["train", "grpo", *TINY, "rollout.prompts_per_step=3", "train.minibatch_size=12"]) == 2
        assert ("does not split over the 2 ranks" in capsys.readouterr().err) == printed


def test_ranks_of_an_nproc_launch_leave_their_input_error_to_the_launcher(monkeypatch, capsys, tmp_path):
    from grpolab.parallel.launch import RANK_ERRORS

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(RANK_ERRORS, str(tmp_path))
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["train", "grpo", *TINY, "rollout.prompts_per_step=3", "train.minibatch_size=12"]) == 2
        assert capsys.readouterr().err == ""
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["rank-00000.txt", "rank-00001.txt"]
    assert "does not split over the 2 ranks" in (tmp_path / files[1]).read_text()


ROOT = Path(__file__).resolve().parents[2]
RAISES = "def reward(prompts, completions, metadata):\n    raise RuntimeError('no scorer on this host')\n"


def _nproc(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "OMP_NUM_THREADS": "1"}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "grpolab", "train", "grpo", *TINY, "train.steps=1", "run.threads=1",
           f"run.out_dir={tmp_path / 'run'}", *extra, "--nproc", "2"]
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("case", ["data", "reward"])
def test_an_input_error_found_by_the_ranks_is_one_message_and_exit_code_2(case, tmp_path):
    """Found after torchrun started the ranks (every rank finds it): printed once, rc 2, no launcher traceback."""
    if case == "data":
        (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": \n')
        extra, message = [f"data.source=jsonl:{tmp_path / 'prompts.jsonl'}"], "prompts.jsonl:2: not valid JSON"
    else:
        (tmp_path / "scorer.py").write_text(RAISES)
        extra, message = ["rewards=[scorer:reward]"], "no scorer on this host"
    done = _nproc(tmp_path, *extra)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert out.count(message) == 1 and out.count("grpolab: error:") == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
