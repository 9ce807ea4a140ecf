"""`grpolab pipeline` on the example seed pipeline, shrunk to a few steps per stage (tiny model):
every stage's outputs, eval.json, skipping finished stages, a changed stage, --from, a GRPO stage
that was stopped and resumes, and bad pipeline files named by file and line."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from grpolab import cli
from grpolab.rewards.registry import register_reward

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "seed_pipeline.yaml"
SMALL = [
    "sft.model.hidden_size=32", "sft.model.num_layers=1", "sft.model.num_heads=2", "sft.sft.steps=20",
    "reward_models.accuracy.steps=5", "reward_models.refusal.steps=5",
    "reward_models.accuracy.hidden_size=32", "reward_models.refusal.hidden_size=32",
    "reward_models.accuracy.heldout_pairs=50",
    "grpo.train.steps=2", "grpo.rollout.prompts_per_step=4", "grpo.rollout.group_size=4",
    "grpo.train.minibatch_size=16", "grpo.train.microbatch_size=16", "grpo.data.eval_prompts=16",
    "grpo.run.progress=false", "grpo.run.tensorboard=false", "grpo.run.checkpoint_every=1", "eval.samples=2",
]

STOP_AT_CALL = {"n": 0, "at": 0}


@register_reward("test_pipeline_sigterm")
def _sigterm_reward():
    """A reward of 0 that sends this process SIGTERM on its STOP_AT_CALL['at']-th call (0 = never)."""

    def reward(prompts, completions, metadata):
        STOP_AT_CALL["n"] += 1
        if STOP_AT_CALL["n"] == STOP_AT_CALL["at"]:
            os.kill(os.getpid(), signal.SIGTERM)
        return [0.0] * len(completions)

    return reward


def _run(out: Path, *extra: str) -> int:
    return cli.main(["pipeline", str(EXAMPLE), f"out_dir={out}", *SMALL, *extra])


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example names its data relative to the repository


def test_seed_pipeline_runs_every_stage(tmp_path, at_root, capsys):
    out = tmp_path / "p"
    assert _run(out) == 0
    assert (out / "sft" / "final" / "config.json").is_file()
    for name in ("accuracy", "refusal"):
        info = json.loads((out / f"rm-{name}" / "grpolab_rm.json").read_text())
        assert 0.0 <= info["heldout_accuracy"] <= 1.0
        assert info["data"].endswith(f"{name}_pairs.jsonl")
    grpo_cfg = (out / "grpo" / "config.yaml").read_text()
    assert str(out / "sft" / "final") in grpo_cfg and str(out / "rm-accuracy") in grpo_cfg
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    # the gold rule checks are logged beside the proxy RMs (weight 0: not trained on)
    gold_and_proxy = {"reward/exact_match/mean", "reward/accuracy_rm/mean", "accuracy", "pair_acc/accuracy_rm"}
    assert gold_and_proxy <= set(rows[0])
    assert (out / "grpo" / "final" / "config.json").is_file() and (out / "grpo" / "report.html").is_file()
    ev = json.loads((out / "eval.json").read_text())
    assert [r["name"] for r in ev["rewards"]] == ["exact_match", "refusal"]  # the gold checks, not the RMs
    assert set(ev["reward_models"]) == {"accuracy", "refusal"}
    for policy in ("pi0", "final"):
        assert ev[policy]["prompts"] == 16
        assert 0.0 <= ev[policy]["greedy"]["accuracy"] <= 1.0
        assert {"pass@1", "pass@2"} <= set(ev[policy]["sampled"])
    assert set(ev["stages"]) == {"sft", "reward_models:accuracy", "reward_models:refusal", "grpo"}
    assert "held-out metric" in capsys.readouterr().out

    # a second run skips every stage: nothing is trained again
    stamp = (out / "grpo" / "final" / "model.safetensors").stat().st_mtime_ns
    assert _run(out) == 0
    assert "grpo: finished before, skipped" in capsys.readouterr().err
    assert (out / "grpo" / "final" / "model.safetensors").stat().st_mtime_ns == stamp

    # changed settings of a finished stage: refused, naming the stage and the way out
    assert _run(out, "grpo.train.steps=3") == 2
    assert "pipeline stage 'grpo' finished with other settings" in capsys.readouterr().err

    # --from grpo redoes GRPO and eval, moves the old ones aside, keeps SFT and the reward models
    sft_stamp = (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns
    assert _run(out, "grpo.train.steps=3", "--from", "grpo") == 0
    assert len((out / "grpo" / "metrics.jsonl").read_text().splitlines()) == 3
    assert len(list(tmp_path.glob("p/grpo.old-*"))) == 1 and len(list(tmp_path.glob("p/eval.json.old-*"))) == 1
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns == sft_stamp


def test_stopped_grpo_stage_resumes(tmp_path, at_root, capsys):
    out = tmp_path / "p"
    killer = ["grpo.train.steps=4", "grpo.rewards=[test_pipeline_sigterm]"]
    # calls 1 and 2 are the probes (the pipeline's, before any stage; GRPO's start-up); SIGTERM in the first
    # step, which finishes
    STOP_AT_CALL.update(n=0, at=3)
    assert _run(out, *killer) == 2
    assert "stopped before its last step" in capsys.readouterr().err
    done = len((out / "grpo" / "metrics.jsonl").read_text().splitlines())
    assert done == 1 and not (out / "eval.json").exists()
    STOP_AT_CALL.update(n=0, at=0)
    assert _run(out, *killer) == 0
    err = capsys.readouterr().err
    assert "sft: finished before, skipped" in err and f"resuming after step {done}" in err
    steps = [json.loads(line)["step"] for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and len(steps) == 4
    assert (out / "eval.json").is_file()


@pytest.mark.parametrize("text, extra, message", [
    ("out_dir: x\ngrpo: {}\nsftt: {}\n", [], "p.yaml:3: unknown section 'sftt'"),
    ("grpo:\n  train:\n    stepz: 3\n", [], "p.yaml:3: train.stepz"),
    ("grpo: {rewards: []}\nreward_models:\n  acc: {data: a.jsonl, stepz: 3}\n", [],
     "p.yaml:3: reward_models.acc.stepz: unknown option"),
    ("grpo: {rewards: []}\n", [], "grpo.rewards is empty and there are no reward_models"),
    ("grpo: {}\n", ["--from", "nope"], "--from 'nope'"),
    ("grpo: {}\n", ["grpoo.train.steps=1"], "expected SECTION.key=value"),
    ("grpo: {}\n", ["--from", "grpo", "grpoo.train.steps=1"], "expected SECTION.key=value"),  # after an option
])
def test_bad_pipeline_files_are_named(tmp_path, capsys, monkeypatch, text, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text(text)
    assert cli.main(["pipeline", "p.yaml", *extra]) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["pipeline", "p.yaml", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
