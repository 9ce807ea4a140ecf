"""A pipeline of one's own, right the first time: every stage's rewards, files and options checked before
the first stage runs (nothing is written when one is wrong), reward models on the SFT stage's model by
default (backbone and lr said), `grpolab config` on a pipeline file, an evaluation after SFT, every
held-out metric per `eval.group_by` value, and every held-out completion with its scores in
completions.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab import cli

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith"
PIPELINE = """out_dir: out
sft:
  preset: sft
  model: {hidden_size: 32, num_layers: 1, num_heads: 2}
  data: {source: "jsonl:data/sft.jsonl"}
  sft: {steps: 4, batch_size: 8, microbatch_size: 8}
reward_models:
  acc: {data: data/acc.jsonl, steps: 2, batch_size: 4, microbatch_size: 4}
grpo:
  preset: grpo
  data: {source: "jsonl:data/prompts.jsonl", eval_source: "jsonl:data/heldout.jsonl"}
  rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 4}
  train: {steps: 1, minibatch_size: 8, microbatch_size: 8}
  rewards: ["exact_match:0.0", "refusal:0.0"]
  run: {progress: false, tensorboard: false, threads: 1}
eval: {rewards: ["exact_match:1.0", "refusal:1.0"], group_by: kind}
"""
HELDOUT = 12
"""Held-out rows: 6 unanswerable (kind missing_operand / div_by_zero) and 6 answerable (kind add / sub)."""

TRL_MODULE = '''
def needs_solution(completions, solution, **kw):  # a TRL reward reading a column the prompts lack
    return [0.0] * len(completions)
'''


@pytest.fixture
def folder(tmp_path, monkeypatch):
    d = tmp_path / "data"
    d.mkdir()
    for name, out, n in (("sft.jsonl", "sft.jsonl", 64), ("prompts.jsonl", "prompts.jsonl", 40),
                         ("accuracy_pairs.jsonl", "acc.jsonl", 40)):
        (d / out).write_text("".join((DATA / name).read_text().splitlines(keepends=True)[:n]))
    rows = [json.loads(x) for x in (DATA / "heldout.jsonl").read_text().splitlines()]
    una, ans = [r for r in rows if not r["answerable"]][:6], [r for r in rows if r["answerable"]][:6]
    (d / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in una + ans))
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "trl_rewards_56.py").write_text(TRL_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("overrides, edit, message", [
    (["grpo.rewards=[trl_rewards_56:needs_solution]"], None,
     "p.yaml: grpo.rewards: reward 'trl_rewards_56:needs_solution' takes solution, which the rows do not have"),
    (["eval.rewards=[no_such_module_56:fn]"], None, "p.yaml: eval.rewards: rewards: reward 'no_such_module_56:fn'"),
    (["eval.group_by=topic"], None, "eval.group_by: no held-out row has the field 'topic'"),
    (["reward_models.acc.steps=many"], None, "p.yaml:8: reward_models.acc.steps: expected int, got 'many'"),
    ([], ("acc.jsonl", '{"prompt": "1+1=", "chosen": "2"\n'), "reward_models.acc.data:"),
    ([], ("heldout.jsonl", '{"answer": "2"}\n'), "grpo.data.eval_source:"),
    (["sft.sft.batch_size=6"], None, "p.yaml: sft: sft.batch_size=6 is not a multiple of sft.microbatch_size=8"),
])
def test_every_stage_is_checked_before_the_first_runs(folder, capsys, overrides, edit, message):
    if edit is not None:
        name, text = edit
        (folder / "data" / name).write_text(text)
    assert cli.main(["pipeline", "p.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "on_reward_error" not in err and "Traceback" not in err
    assert not (folder / "out").exists()  # nothing ran, not even the folder was claimed


def test_grpolab_config_reads_a_pipeline_file(folder, capsys):
    assert cli.main(["config", "p.yaml", "grpo.train.steps=3"]) == 0
    out = capsys.readouterr().out
    for section in ("stage sft: grpolab sft -> out/sft/final", "stage reward_models:acc: grpolab rm -> out/rm-acc",
                    "stage grpo: grpolab train -> out/grpo", "stage eval:"):
        assert section in out
    assert "reward_models.acc.base: out/sft/final   # default: the SFT stage's model" in out
    assert "reward_models.acc.lr: 1e-05   # default: grpolab rm's for this backbone" in out
    assert "train.steps: int = 3" in out and "model.name_or_path: str = out/sft/final" in out
    assert "loss.policy_loss: str = sft" in out  # the SFT stage's config as it runs
    assert "eval.group_by: ['kind']" in out


def test_a_pipeline_of_ones_own_runs_first_time_and_shows_each_category(folder, capsys):
    assert cli.main(["pipeline", "p.yaml", "--no-report"]) == 0
    captured = capsys.readouterr()
    out = folder / "out"
    # the reward model trained on the SFT stage's model and tokenizer, and the stage said so with its lr
    info = json.loads((out / "rm-acc" / "grpolab_rm.json").read_text())
    assert info["base"] == "out/sft/final" and info["lr"] == 1e-5
    assert "reward_models:acc: backbone sft (the SFT stage's model, the default), lr 1e-05" in captured.err
    # SFT progress with time per step and ETA
    assert "[sft] step 4/4 loss" in captured.out and "s/step" in captured.out and "ETA 0:00" in captured.out
    # an evaluation after SFT, per kind
    sft_eval = json.loads((out / "sft" / "eval.json").read_text())
    kinds = {"missing_operand", "div_by_zero", "add", "sub"}
    assert sft_eval["prompts"] == HELDOUT and set(sft_eval["by"]["kind"]) <= kinds
    assert sum(g["prompts"] for g in sft_eval["by"]["kind"].values()) == HELDOUT
    assert len((out / "sft" / "completions.jsonl").read_text().splitlines()) == HELDOUT
    # the final evaluation: every metric per kind, and every held-out completion with its scores
    payload = json.loads((out / "eval.json").read_text())
    for model in ("pi0", "final"):
        by = payload[model]["by"]["kind"]
        assert sum(g["prompts"] for g in by.values()) == HELDOUT
        assert all(set(g["greedy"]) == set(payload[model]["greedy"]) for g in by.values())
        assert "completions" not in payload[model]
    records = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["model"] for r in records] == ["pi0"] * HELDOUT + ["final"] * HELDOUT
    final = [r for r in records if r["model"] == "final"]
    assert set(final[0]["scores"]) == {"exact_match", "refusal"} and "completion" in final[0]
    table = [line for line in captured.out.splitlines() if line.startswith("kind=")]  # the printed table, per kind
    assert {line.split()[0][5:] for line in table} == set(payload["final"]["by"]["kind"])
    for kind, group in payload["final"]["by"]["kind"].items():
        mine = [r for r in final if r["meta"]["kind"] == kind]
        refusal = [r["scores"]["refusal"] for r in mine if r["scores"]["refusal"] is not None]
        if refusal:  # the per-kind figure is the mean of that kind's rows in completions.jsonl
            assert group["greedy"]["reward/refusal"] == pytest.approx(sum(refusal) / len(refusal))


def test_the_sft_evaluation_leaves_out_the_reward_models_trained_later(folder):
    assert cli.main(["pipeline", "p.yaml", "--no-report", "eval.rewards=null", "eval.group_by=[]"]) == 0
    sft = json.loads((folder / "out" / "sft" / "eval.json").read_text())["greedy"]
    final = json.loads((folder / "out" / "eval.json").read_text())["final"]["greedy"]
    assert {"reward/exact_match", "reward/refusal"} <= set(sft) and "reward/acc_rm" not in sft
    assert {"reward/exact_match", "reward/refusal", "reward/acc_rm"} <= set(final)
