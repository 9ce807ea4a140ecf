"""An OSError of a user path is one message naming the field or flag and the path (a folder under a
regular file, a full disk), never a traceback; a full disk keeps the last complete checkpoint."""

from __future__ import annotations

import errno

import pytest

from grpolab import cli
from grpolab.grpo import checkpoint_hook
from grpolab.rundir import checkpoint as ck

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=8", "train.microbatch_size=4",
        "run.progress=false", "run.tensorboard=false", "run.threads=1"]


@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    return f


def _argvs(tmp_path, target):
    src = tmp_path / "src"
    return {
        "run.out_dir": (["train", "grpo", *TINY, f"run.out_dir={target}", "train.steps=1"], None),
        "--out": (["data", "--out", str(target), "--prompts", "3", "--pairs", "2", "--heldout-pairs", "2"], None),
        "export --out": (["export", str(src), "--out", str(target)], src),
        "sft run.out_dir": (["sft", "sft", *TINY, "sft.steps=1", f"run.out_dir={target}"], None),
    }


@pytest.mark.parametrize("case", ["run.out_dir", "--out", "export --out", "sft run.out_dir"])
def test_an_output_folder_under_a_regular_file_is_named(case, tmp_path, a_file, capsys):
    target = a_file / "sub"
    argv, src = _argvs(tmp_path, target)[case]
    if src is not None:
        assert cli.main(["train", "grpo", *TINY, f"run.out_dir={src}", "train.steps=1"]) == 0
        capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    flag = case.split()[-1]
    assert f"{flag}='{target}': cannot be written: a part of it is a file, not a folder" in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_full_disk_is_named_and_the_last_checkpoint_kept(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    real = ck.save_checkpoint

    def full_after_first(setup, root, step, *a, **kw):
        if step >= 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(root / f".tmp-step-{step}"))
        return real(setup, root, step, *a, **kw)

    monkeypatch.setattr(checkpoint_hook, "save_checkpoint", full_after_first)
    code = cli.main(["train", "grpo", *TINY, f"run.out_dir={run}", "train.steps=3", "run.checkpoint_every=1"])
    err = capsys.readouterr().err
    assert code == 2 and "no space left on the device" in err and "Traceback" not in err, err
    assert [p.name for p in ck.complete_checkpoints(run / "checkpoints")] == ["step-1"]
