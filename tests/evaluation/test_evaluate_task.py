"""`grpolab eval` for any task: held-out prompts from the config (data.eval_source, or the built-in
task's split), the config's rewards as metrics, greedy and sampled (pass@1, pass@k)."""

from __future__ import annotations

import json

from grpolab import cli

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.max_new_tokens=4",
        "data.eval_prompts=12"]


def _eval(capsys, *argv) -> dict:
    assert cli.main(["eval", *map(str, argv)]) == 0
    return json.loads(capsys.readouterr().out)


def test_builtin_task_greedy_and_sampled(model_dir, capsys, tmp_path):
    res = _eval(capsys, model_dir, "grpo", *TINY, "--samples", "3", "--out", tmp_path / "eval.json")
    assert res["prompts"] == 12
    g, s = res["greedy"], res["sampled"]
    assert g["accuracy"] == res["arith"]["accuracy"]  # the first verifier (exact_match) is the task's accuracy
    assert set(g) >= {"reward", "reward/exact_match", "reward/refusal"}
    assert s["samples"] == 3 and 0 <= s["pass@1"] <= s["pass@3"] <= 1
    assert json.loads((tmp_path / "eval.json").read_text())["examples"]


def test_a_jsonl_task_by_its_eval_source_and_rewards(model_dir, capsys, tmp_path):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "answerable": True} for i in range(20)]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _eval(capsys, model_dir, "grpo", *TINY, "data.source=jsonl:unused.jsonl", "data.chat_template=false",
                f"data.eval_source=jsonl:{tmp_path / 'held.jsonl'}", "rewards=[exact_match:1.0]")
    assert res["prompts"] == 12 and "arith" not in res
    assert res["greedy"]["reward"] == res["greedy"]["reward/exact_match"] == res["greedy"]["accuracy"]


def test_a_source_without_held_out_prompts_is_named(model_dir, capsys):
    assert cli.main(["eval", str(model_dir), "grpo", *TINY, "data.source=jsonl:train.jsonl"]) == 2
    assert "data.eval_source" in capsys.readouterr().err


def test_best_of_n_by_self_likelihood_beside_greedy(model_dir, capsys):
    res = _eval(capsys, model_dir, "grpo", *TINY, "--best-of", "4")
    bo = res["best_of_n"]
    assert bo["n"] == 4 and bo["prompts"] == 12
    assert bo["greedy"]["accuracy"] == res["greedy"]["accuracy"]  # the same greedy completions
    # the winner is the likeliest of the 4 samples, so no less likely than their mean
    assert bo["best_of_n"]["self_likelihood"] >= bo["sampled"]["self_likelihood"]
