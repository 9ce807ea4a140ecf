"""One integrity check for every reader: a checkpoint's files are verified against their SHA-256 by resume
and export (what is skipped is named with the reason), a run's final/ and a reward model carry a manifest
that every loader checks, and a damaged model file is named by the loader in every command (no
SafetensorError traceback)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from grpolab import cli
from grpolab.manifest import MANIFEST
from grpolab.rundir import checkpoint as ck

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=8", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false", "run.threads=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("integrity") / "run"
    assert cli.main(["train", "grpo", *TINY, f"run.out_dir={run}", "train.steps=2", "run.checkpoint_every=1"]) == 0
    return run


def _copy(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte of a weight flipped
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_export_refuses_a_checkpoint_whose_sha256_fails(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    _flip(run / "checkpoints/step-2/model.safetensors")
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x"), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert "step-2/model.safetensors is damaged" in err and "SHA-256" in err and "Traceback" not in err
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_export_of_the_newest_names_the_damaged_one_it_skips(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    shutil.rmtree(run / "final")
    _flip(run / "checkpoints/step-2/model.safetensors")
    assert cli.main(["export", str(run), "--out", str(tmp_path / "x")]) == 0
    err = capsys.readouterr().err
    assert "step-2/model.safetensors is damaged" in err and "skipped" in err


def test_resume_names_a_checkpoint_skipped_for_its_size(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    _cut(run / "checkpoints/step-2/optimizer.pt")
    said = []
    assert ck.resolve_resume("auto", run, say=said.append) == run / "checkpoints/step-1"
    assert len(said) == 1 and "step-2/optimizer.pt is damaged" in said[0] and "skipped" in said[0]


@pytest.mark.parametrize("damage", [_flip, _cut])
def test_eval_of_a_run_with_a_damaged_final_names_the_file(trained, tmp_path, capsys, damage):
    run = _copy(trained, tmp_path)
    assert (run / "final" / MANIFEST).is_file()
    damage(run / "final/model.safetensors")
    assert cli.main(["eval", str(run), "run.threads=1"]) == 2
    err = capsys.readouterr().err
    assert f"model folder {run / 'final'}: model.safetensors is damaged" in err and "Traceback" not in err


def test_a_cut_weights_file_without_a_manifest_is_named_by_the_loader(trained, tmp_path, capsys):
    model = tmp_path / "hf"
    shutil.copytree(trained / "final", model)
    (model / MANIFEST).unlink()  # any HF folder
    _cut(model / "model.safetensors")
    assert cli.main(["eval", str(model), "run.threads=1"]) == 2
    err = capsys.readouterr().err
    assert f"model folder {model}: model.safetensors cannot be read" in err and "Traceback" not in err
    assert cli.main(["train", "grpo", *TINY, f"model.name_or_path={model}", f"run.out_dir={tmp_path / 'r'}",
                     "train.steps=1"]) == 2
    assert "model.safetensors cannot be read" in capsys.readouterr().err
