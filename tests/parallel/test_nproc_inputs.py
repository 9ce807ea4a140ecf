"""`--nproc N` validates the config as its N ranks will before it starts torchrun: an input error is one
message, exit code 2, and no launcher starts (so no launcher traceback); under torchrun only rank 0 prints
an input error. Ray rollout or reward workers under plain torchrun are refused at validation with the
command that works (`--ray`)."""

from __future__ import annotations

import os

import pytest

from grpolab import cli, config as C

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=8", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false"]


@pytest.fixture
def no_exec(monkeypatch):
    def refuse(*a):
        raise AssertionError(f"torchrun was started: {a}")

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
