"""A run directory is never overwritten (grpolab.rundir.rundir), and a resume uses only checkpoints
whose files match their SHA-256, says which one it continues from, and never restarts over a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab import cli, config as C
from grpolab.rundir import checkpoint as ck
from grpolab.rundir.lock import LOCK_FILE
from grpolab.rundir.rundir import RUN_FILE, claim, mark_finished, read_run
from grpolab.grpo.setup import build_setup

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=8", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false"]


def _train(run: Path, *extra: str) -> int:
    return cli.main(["train", "grpo", *TINY, f"run.out_dir={run}", *extra])


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}  # the lock file names whoever held the folder last


def test_claim_refuses_a_run_and_overwrite_moves_it_aside(tmp_path):
    run = tmp_path / "run"
    claim(run, "train")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(C.ConfigError, match=r"run.out_dir='.*run' already holds a running train run; add --resume.*"
                                            r"--overwrite to move it aside"):
        claim(run, "train")
    with pytest.raises(C.ConfigError, match=r"holds a running train run, which `grpolab demo --resume` cannot"):
        claim(run, "demo", resume=True)
    with pytest.raises(C.ConfigError, match=r"holds a running train run, which `grpolab ablate` cannot"):
        claim(run, "ablate", resume=True)  # a command without --resume continues its own folder by itself
    assert claim(run, "train", resume=True) == run and read_run(run)["status"] == "running"
    mark_finished(run)
    assert read_run(run)["status"] == "finished"
    said = []
    claim(run, "sft", overwrite=True, say=said.append)
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(moved) == 1 and (moved[0] / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert str(moved[0]) in said[0] and read_run(moved[0])["status"] == "finished"
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, RUN_FILE] and read_run(run)["command"] == "sft"


def test_no_command_overwrites_a_finished_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run, "train.steps=1") == 0
    assert read_run(run)["status"] == "finished"
    import shutil

    shutil.rmtree(run / "checkpoints")  # a finished run is still a run without its checkpoints
    before = _snapshot(run)
    assert _train(run, "train.steps=1") == 2
    assert cli.main(["sft", "sft", *TINY, "sft.steps=1", f"run.out_dir={run}"]) == 2
    assert cli.main(["demo", "--quick", "--out", str(run), "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("already holds a finished train run") == 3
    assert _snapshot(run) == before


def _checkpoints(tmp_path: Path, steps: int = 2) -> Path:
    run = tmp_path / "run"
    assert _train(run, f"train.steps={steps}", "run.checkpoint_every=1") == 0
    return run


def test_a_same_size_corruption_is_named_and_the_previous_checkpoint_used(tmp_path, capsys):
    run = _checkpoints(tmp_path)
    weights = run / "checkpoints/step-2/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte of a weight flipped
    weights.write_bytes(bytes(data))
    said = []
    assert ck.resolve_resume("auto", run, say=said.append) == run / "checkpoints/step-1"
    assert "step-2/model.safetensors is damaged" in said[0] and "SHA-256" in said[0]
    capsys.readouterr()
    assert _train(run, "train.steps=3", "--resume") == 0
    err = capsys.readouterr().err
    assert "model.safetensors is damaged" in err
    assert f"resuming after step 1 from {run / 'checkpoints/step-1'}" in err
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_with_no_usable_checkpoint_a_resume_stops_instead_of_starting_over(tmp_path, capsys):
    run = _checkpoints(tmp_path)
    for step in (1, 2):
        f = run / f"checkpoints/step-{step}/rng.pt"
        f.write_bytes(bytes(f.stat().st_size))
    metrics = (run / "metrics.jsonl").read_text()
    assert _train(run, "train.steps=3", "--resume") == 2
    err = capsys.readouterr().err
    assert "holds a run with 2 logged steps but no usable checkpoint" in err and "step-1/rng.pt is damaged" in err
    assert (run / "metrics.jsonl").read_text() == metrics


def test_a_resume_of_a_folder_without_steps_starts_fresh(tmp_path):
    assert ck.resolve_resume("auto", tmp_path / "new") is None
    s = build_setup(C.from_preset("grpo", TINY))
    path = ck.save_checkpoint(s, tmp_path / "checkpoints", step=1, keep=1)
    manifest = json.loads((path / ck.MARKER).read_text())["files"]
    assert all(len(entry["sha256"]) == 64 for entry in manifest.values())


def test_killed_before_its_first_checkpoint_a_resume_starts_over(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')  # no checkpoint was due yet
    said = []
    assert ck.resolve_resume("auto", tmp_path, say=said.append, checkpoint_every=2) is None
    assert "logged 2 steps before its first checkpoint" in said[0]
    with pytest.raises(ck.CheckpointError, match="2 logged steps but no usable checkpoint"):
        ck.resolve_resume("auto", tmp_path, checkpoint_every=1)  # step-1 should exist
    with pytest.raises(ck.CheckpointError, match="2 logged steps"):
        ck.resolve_resume("auto", tmp_path, checkpoint_every=0)  # no periodic checkpoints: nothing to resume
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)  # a checkpoint that is not usable
    with pytest.raises(ck.CheckpointError, match="2 logged steps"):
        ck.resolve_resume("auto", tmp_path, checkpoint_every=2)
