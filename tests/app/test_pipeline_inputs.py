"""The pipeline fingerprints each stage's input files as well as its settings (an edited data file is a
changed stage, named; a file only touched is not), checks every stage's inputs exist before any stage
runs, and holds its folder against a second pipeline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpolab import cli

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "arith"
PIPELINE = """out_dir: out
sft:
  preset: sft
  model: {hidden_size: 32, num_layers: 1, num_heads: 2}
  data: {source: "jsonl:data/sft.jsonl"}
  sft: {steps: 2, batch_size: 8, microbatch_size: 8}
grpo:
  preset: grpo
  data: {source: "jsonl:data/prompts.jsonl", eval_source: "jsonl:data/heldout.jsonl", eval_prompts: 4}
  rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 4}
  train: {steps: 1, minibatch_size: 8, microbatch_size: 8}
  rewards: ["exact_match:1.0"]
  run: {progress: false, tensorboard: false, threads: 1}
"""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    for name in ("sft.jsonl", "prompts.jsonl", "heldout.jsonl"):
        lines = (DATA / name).read_text().splitlines(keepends=True)[:200]
        (tmp_path / "data" / name).write_text("".join(lines))
    (tmp_path / "p.yaml").write_text(PIPELINE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_missing_input_is_named_before_any_stage_runs(folder, capsys):
    (folder / "data" / "prompts.jsonl").unlink()
    assert cli.main(["pipeline", "p.yaml"]) == 2
    err = capsys.readouterr().err
    assert "grpo.data.source: 'data/prompts.jsonl' does not exist" in err
    assert not (folder / "out" / "sft").exists()


def test_an_edited_input_file_is_a_changed_stage(folder, capsys):
    assert cli.main(["pipeline", "p.yaml"]) == 0
    sft = folder / "data" / "sft.jsonl"
    os.utime(sft)  # touched, same content: still finished
    assert cli.main(["pipeline", "p.yaml"]) == 0
    err = capsys.readouterr().err
    assert "sft: finished before, skipped" in err and "grpo: finished before, skipped" in err
    sft.write_text("".join(sft.read_text().splitlines(keepends=True)[:100]))  # edited
    assert cli.main(["pipeline", "p.yaml"]) == 2
    err = capsys.readouterr().err
    assert "pipeline stage 'sft' finished on other input files: sft.data.source changed since" in err
    assert "--from sft" in err
    assert cli.main(["pipeline", "p.yaml", "--from", "sft"]) == 0


def test_a_second_pipeline_into_a_held_folder_is_refused(folder, capsys):
    (folder / "out").mkdir()
    hold = ("import sys, time; from grpolab.rundir.lock import lock_folder; lock_folder(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", hold, "out"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert cli.main(["pipeline", "p.yaml"]) == 2
        assert f"out_dir='out' is in use by PID {proc.pid}" in capsys.readouterr().err
    finally:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder / "out")


def test_a_pipeline_never_writes_over_the_users_files(folder, capsys):
    (folder / "out").mkdir()
    (folder / "out" / "notes.txt").write_text("my own\n")
    assert cli.main(["pipeline", "p.yaml"]) == 2
    err = capsys.readouterr().err
    assert "out_dir='out' holds files grpolab did not write (notes.txt)" in err and "--overwrite" in err
    assert "Traceback" not in err and not (folder / "out" / "sft").exists()
    assert (folder / "out" / "notes.txt").read_text() == "my own\n"
    assert cli.main(["pipeline", "p.yaml", "--overwrite", "--no-report"]) == 0
    moved, = folder.glob("out.old-*")
    assert (moved / "notes.txt").read_text() == "my own\n" and not (folder / "out" / "notes.txt").exists()
    capsys.readouterr()
    assert cli.main(["pipeline", "p.yaml", "--no-report"]) == 0  # its own folder: finished stages skipped
    assert "grpo: finished before, skipped" in capsys.readouterr().err


def test_a_pipeline_refuses_a_folder_holding_another_commands_run(folder, capsys):
    (folder / "out" / "final").mkdir(parents=True)
    (folder / "out" / "run.json").write_text('{"command": "train", "status": "finished"}')
    assert cli.main(["pipeline", "p.yaml"]) == 2
    err = capsys.readouterr().err
    assert "out_dir='out' holds a finished train run, which `grpolab pipeline` cannot continue" in err
    assert sorted(p.name for p in (folder / "out").iterdir()) == [".grpolab.lock", "final", "run.json"]


@pytest.mark.parametrize("model", ["folder", "builtin:tiny-chat"])
def test_chat_rows_are_read_with_the_models_tokenizer_before_any_stage_runs(model, tmp_path, monkeypatch, capsys):
    """SFT rows given as chat messages need the model's chat template: the checks before the first stage
    render them with the model's tokenizer (a folder's, loaded without the model, or a built-in one's),
    and a bad row is named there."""
    from grpolab import config as C
    from grpolab.models.policy import load_policy

    if model == "folder":
        policy, tok = load_policy(C.from_preset("sft", ["model.name_or_path=builtin:tiny-chat", "model.hidden_size=32",
                                                        "model.num_layers=1", "model.num_heads=2"]))
        policy.save_pretrained(tmp_path / "model")
        tok.save_pretrained(tmp_path / "model")
    chat = [{"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(4) for b in range(4)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+1?", "answer": str(a + 1)}) + "\n"
                                                    for a in range(8)))
    name = "model" if model == "folder" else model
    text = PIPELINE.replace("model: {hidden_size: 32,", f"model: {{name_or_path: {name!r}, hidden_size: 32,")
    text = text.replace("data/sft.jsonl", "sft.jsonl").replace("data/prompts.jsonl", "prompts.jsonl")
    text = text.replace('jsonl:data/heldout.jsonl", eval_prompts: 4',
                        'jsonl:prompts.jsonl", eval_prompts: 4, chat_template: false')
    text = text.replace('rewards: ["exact_match:1.0"]', 'rewards: ["answer_format:1.0"]')
    (tmp_path / "p.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["pipeline", "p.yaml", "--no-report"]) == 0
    assert "[sft] 16 examples" in capsys.readouterr().out
    chat[3] = {"messages": [{"role": "user", "content": "1+1?"}]}  # no reply to learn
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    assert cli.main(["pipeline", "p.yaml", "--from", "sft", "--no-report"]) == 2
    assert "sft.data.source: sft.jsonl:4: field 'messages' must end with the assistant's reply" in capsys.readouterr().err
