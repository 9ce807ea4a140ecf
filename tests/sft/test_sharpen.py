"""Sharpening: best-of-N by a scorer (picks the argmax among finished candidates), SFT-sharpening on a
tiny π0 (the winners become likelier and greedy decoding moves to them), best-of-N vs greedy
evaluation, and `grpolab sharpen` end to end."""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys

import pytest
import torch

from grpolab.cli import sharpen as cli_sharpen
from grpolab import config as C
from grpolab.config import ConfigError
from grpolab.data.build import arith_task
from grpolab.models.loading import load_model
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.rewards.self_likelihood import SelfLikelihood
from grpolab.rollout.hf import HFEngine
from grpolab.evaluation.evaluate import evaluate_arith
from grpolab.rollout.hf import generate_texts
from grpolab.rewards.registry import build_rewards
from grpolab.sft.sft import train_sft
from grpolab.evaluation.best_of_n import arith_metrics, best_index, best_of_n, best_of_n_eval
from grpolab.sft.sharpen import sharpen_sft

OPS = "data.arith_ops=+-"


def make_pi0():
    """A tiny model SFT'd briefly on the task's training side: short digit answers that end in EOS."""
    task = arith_task(C.from_preset("grpo", [OPS]))
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    train_sft(model, tok, task.sft_examples(random.Random(0), 256, refusal_examples=8), steps=80, batch_size=32,
              microbatch_size=32, lr=3e-3)
    return model, tok, task


@pytest.fixture(scope="module")
def pi0_parts():
    return make_pi0()


@pytest.fixture
def pi0(pi0_parts):
    """(a fresh copy of π0, tokenizer, task): tests may train the model."""
    model, tok, task = pi0_parts
    return copy.deepcopy(model), tok, task


@pytest.fixture(scope="module")
def pi0_dir(pi0_parts, tmp_path_factory):
    model, tok, _ = pi0_parts
    path = tmp_path_factory.mktemp("pi0")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_best_index_prefers_eligible_scored_candidates_and_the_first_of_ties():
    nan = math.nan
    scores = torch.tensor([[1.0, 3.0, 2.0], [5.0, 1.0, 2.0], [nan, -1.0, nan], [nan, nan, nan], [2.0, 2.0, 0.0]])
    eligible = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    # row 1: the best is not eligible; row 2: no eligible scored one -> the scored one; row 4: a tie
    assert best_index(scores, eligible).tolist() == [1, 2, 1, 0, 0]


def test_best_of_n_keeps_the_argmax_of_a_hand_built_scorer(pi0):
    model, tok, task = pi0
    engine = HFEngine(tok, 6)
    items = task.train_prompts(random.Random(3), 6)
    seen = []

    def scorer(prompts, completions, metadata):  # any text function: digit sum, minus length
        seen.extend(metadata)
        return [sum(int(ch) for ch in c if ch.isdigit()) - 0.1 * len(c) for c in completions]

    n = 5
    best = best_of_n(model, engine, [it.prompt for it in items], n, scorer, torch.Generator().manual_seed(0),
                     metadata=[it.meta for it in items])
    assert len(best.texts) == 6 and best.candidate_scores.shape == (6, n) and len(seen) == 6 * n
    assert all(m["answerable"] == items[i // n].meta["answerable"] and "truncated" in m for i, m in enumerate(seen))
    for i in range(6):  # a plain loop as the reference
        cands = list(zip(best.candidates[i], best.candidate_truncated[i].tolist()))
        pool = [c for c, tr in cands if not tr] or [c for c, _ in cands]
        top = max(pool, key=lambda c: scorer([""], [c], [{}])[0])
        assert scorer([""], [best.texts[i]], [{}])[0] == scorer([""], [top], [{}])[0]
        assert best.scores[i] == best.candidate_scores[i].masked_fill(best.candidate_truncated[i], -1e9).max() \
            or bool(best.candidate_truncated[i].all())
    assert not best.truncated.any()  # π0 ends most completions: each prompt has a finished one


def test_sharpen_sft_makes_the_winners_likelier_and_greedy_moves_to_them(pi0):
    model, tok, task = pi0
    engine = HFEngine(tok, 6)
    prompts = [it.prompt for it in task.train_prompts(random.Random(5), 32)]
    scorer = SelfLikelihood(model=model, tokenizer=tok)  # frozen π0
    before, _ = generate_texts(model, engine, prompts)
    res = sharpen_sft(model, engine, prompts, 8, scorer, steps=60, batch_size=16, microbatch_size=16, lr=3e-3,
                      generator=torch.Generator().manual_seed(0))
    after, _ = generate_texts(model, engine, prompts)
    winners = res.best.texts
    assert len(res.pairs) == sum(not t for t in res.best.truncated.tolist()) > 0
    assert res.losses[-1] < res.losses[0]
    now = SelfLikelihood(model=model, tokenizer=tok)(prompts, winners, [{}] * len(prompts))
    assert sum(now) / len(now) > float(res.best.scores.mean()) + 1.0  # the sharpened model prefers the winners
    same_before = sum(a == b for a, b in zip(before, winners))
    same_after = sum(a == b for a, b in zip(after, winners))
    assert same_after >= same_before + 8 and same_after >= 0.5 * len(prompts)


def test_best_of_n_eval_compares_greedy_with_best_of_n(pi0):
    model, tok, task = pi0
    cfg = C.from_preset("grpo", [OPS, "data.eval_prompts=24"])
    items = task.eval_items(24, seed=0)
    engine = HFEngine(tok, 6)
    n = 4
    res = best_of_n_eval(model, engine, items, build_rewards(cfg), n, torch.Generator().manual_seed(0), arith=True)
    assert res["prompts"] == 24 and res["n"] == n
    g, b, s = res["greedy"], res["best_of_n"], res["sampled"]
    assert g["arith"]["accuracy"] == evaluate_arith(model, engine, items)["accuracy"]
    for part in (g, b, s):
        assert 0 <= part["accuracy"] <= 1 and part["self_likelihood"] < 0 and set(part["arith"]) >= {"accuracy"}
    assert b["accuracy"] <= s[f"pass@{n}"] and s["accuracy"] <= s[f"pass@{n}"]


def test_arith_metrics_on_given_texts():
    task = arith_task(C.from_preset("grpo", [OPS]))
    items = task.eval_items(40, seed=0)
    ans = [it for it in items if it.meta["answerable"]][:2]
    una = [it for it in items if not it.meta["answerable"]][:2]
    texts = [ans[0].meta["answer"], "cannot", "cannot", "12"]
    got = arith_metrics(texts, [False, False, True, False], ans + una)
    assert got == {"accuracy": 0.5, "refusal_recall": 0.0, "false_refusal": 0.5}  # the truncated refusal fails


def sharpen_main(argv: list[str]) -> int:
    """`grpolab sharpen ...` as cli.main runs a subcommand (ConfigError -> one line, exit 2)."""
    parser = argparse.ArgumentParser(prog="grpolab")
    cli_sharpen.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sharpen", *argv])
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"grpolab: config error: {e}", file=sys.stderr)
        return 2


CLI = [OPS, "rollout.max_new_tokens=6", "sft.steps=20", "sft.batch_size=8", "sft.microbatch_size=8", "sft.lr=3e-3",
       "run.threads=1"]


def test_cli_sharpen_end_to_end(pi0_dir, tmp_path, capsys):
    out = tmp_path / "sharp"
    assert sharpen_main(["grpo", f"model.name_or_path={pi0_dir}", *CLI, "--n", "4", "--prompts", "24",
                         "--out", str(out)]) == 0
    assert f"run directory: {out}" in capsys.readouterr().out
    info = json.loads((out / "sharpen.json").read_text())
    assert info["n"] == 4 and info["prompts"] == 24 and info["sft"]["steps"] == 20 and info["pi0"] == str(pi0_dir)
    sl = info["self_likelihood_under_pi0"]
    assert sl["winners"] > sl["sampled"]  # best-of-4 beats the average sample under π0
    assert sl["sharpened_greedy"] > sl["pi0_greedy"] - 0.5 and info["sft_pairs"] <= 24
    rows = [json.loads(line) for line in (out / "winners.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and set(rows[0]) == {"prompt", "winner", "self_likelihood", "truncated"}
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    model, _ = load_model(str(out / "final"))
    assert sum(p.numel() for p in model.parameters()) > 0
    # the folder now holds a run: refused, naming --out
    assert sharpen_main(["grpo", f"model.name_or_path={pi0_dir}", *CLI, "--n", "4", "--out", str(out)]) == 2
    assert "--out=" in capsys.readouterr().err


def test_cli_sharpen_bad_input_is_one_line(tmp_path, capsys):
    assert sharpen_main(["grpo", *CLI, "--n", "0", "--out", str(tmp_path / "a")]) == 2
    assert "--n=0" in capsys.readouterr().err
    assert sharpen_main(["grpo", *CLI, f"model.name_or_path={tmp_path / 'nowhere'}", "--n", "2",
                         "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "Traceback" not in err
