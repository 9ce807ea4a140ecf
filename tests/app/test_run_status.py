"""run.json says how a run ended: "failed" with the error when `grpolab train` or `grpolab sft` raises
(a GRPO start that fails included), never "running" after the process is gone; and `grpolab sft` reads
every row of a data file unless sft.examples caps them, saying so when it does."""

from __future__ import annotations

import json

from grpolab import cli
from grpolab.rundir.rundir import mark_stopped, read_run, recording_failure

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "run.threads=1", "run.progress=false",
        "run.tensorboard=false"]


def _rows(path, n):
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)[::-1], "answer": "x"}) + "\n"
                            for i in range(n)))
    return path


def test_a_grpo_start_that_fails_leaves_run_json_failed(tmp_path, monkeypatch, capsys):
    (tmp_path / "rewards_status_56.py").write_text("def gold(completions, solution, **kw):\n    return [0.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _rows(tmp_path / "p.jsonl", 8)
    out = tmp_path / "run"
    code = cli.main(["train", "grpo", *TINY, f"data.source=jsonl:{data}", "rewards=[rewards_status_56:gold]",
                     "rollout.prompts_per_step=2", "rollout.group_size=2", "train.minibatch_size=4",
                     "train.microbatch_size=4", f"run.out_dir={out}"])
    assert code == 2 and "takes solution" in capsys.readouterr().err
    info = read_run(out)
    assert info["status"] == "failed" and "RewardSetupError" in info["error"] and "ended" in info


def test_an_sft_run_that_fails_says_so(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n')
    assert cli.main(["sft", "sft", *TINY, f"data.source=jsonl:{bad}", f"run.out_dir={tmp_path / 'run'}"]) == 2
    info = read_run(tmp_path / "run")
    assert info["status"] == "failed" and "ValueError" in info["error"]


def test_recording_failure_marks_a_stop_and_passes_the_error_on(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"command": "train", "status": "running"}))
    for exc, status in ((KeyboardInterrupt(), "stopped"), (RuntimeError("boom"), "failed")):
        try:
            with recording_failure(tmp_path):
                raise exc
        except BaseException as e:  # noqa: BLE001 - passed on unchanged
            assert e is exc
        assert read_run(tmp_path)["status"] == status
    assert read_run(tmp_path)["error"] == "RuntimeError: boom" and read_run(tmp_path)["command"] == "train"
    mark_stopped(tmp_path, "exit code 143", "stopped")
    assert read_run(tmp_path)["status"] == "stopped"


def test_sft_uses_every_row_unless_capped_and_says_a_cap(tmp_path, capsys):
    data = _rows(tmp_path / "sft.jsonl", 10)
    common = ["sft", "sft", *TINY, f"data.source=jsonl:{data}", "sft.steps=2", "sft.batch_size=2",
              "sft.microbatch_size=2"]
    assert cli.main([*common, f"run.out_dir={tmp_path / 'a'}"]) == 0
    got = capsys.readouterr()
    assert "[sft] 10 examples" in got.out and "note" not in got.err
    assert read_run(tmp_path / "a")["status"] == "finished"
    assert cli.main([*common, "sft.examples=4", f"run.out_dir={tmp_path / 'b'}"]) == 0
    got = capsys.readouterr()
    assert "[sft] 4 examples" in got.out
    assert "sft.examples=4 keeps the first 4 of the 10 rows (6 unused); sft.examples=null uses them all" in got.err


def test_a_reward_model_run_that_fails_says_so(tmp_path, capsys):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('{"prompt": "1+1=", "chosen": "2"}\n')
    assert cli.main(["rm", "--data", str(bad), "--out", str(tmp_path / "rm")]) == 2
    assert "rejected" in capsys.readouterr().err
    info = read_run(tmp_path / "rm")
    assert info["status"] == "failed" and info["command"] == "rm" and "rejected" in info["error"]
