"""rm_refresh: pair selection and judgement within the annotation budget, the refresh of a saved RM on
the policy's own samples, its checkpoint state, and the gold reward (weight 0) never reaching the loss."""

import json
import random
from types import SimpleNamespace

import pytest
import torch

from grpolab import config as C
from grpolab.data.arith import ArithTask
from grpolab.data.preferences import PrefPair, accuracy_pairs
from grpolab.models.tiny import build_char_tokenizer
from grpolab.rewards.reward_model import RewardModelReward
from grpolab.rewards.rules import ExactMatch
from grpolab.grpo import loop as grpo
from grpolab.reward_models.model import build_reward_model, save_reward_model
from grpolab.reward_models.training import score_stats
from grpolab.app.demo_reward_models import torch_threads
from grpolab.reward_models.refresh import LABELS_FILE, RMRefresh, judge, select_pairs
from grpolab.reward_models.model import load_train_pairs
from grpolab.grpo.setup import build_setup


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def _groups(texts_per_group):
    return [{"prompt": f"{g}+0=", "texts": list(t),
             "metas": [{"answerable": True, "answer": str(g), "truncated": False}] * len(t)}
            for g, t in enumerate(texts_per_group)]


def test_select_pairs_stays_in_budget_pairs_distinct_texts_and_leads_with_the_rm_top():
    groups = _groups([["1", "2", "3", "1"], ["5", "5", "5", "5"], ["7", "8", "8", "9"]])
    scores = [[0.1, 0.9, 0.5, 0.1], [0.0] * 4, [0.3, 0.2, 0.2, 2.0]]
    picks = select_pairs(groups, scores, 3, random.Random(0))
    assert len(picks) == 3
    for g, i, j in picks:
        assert g != 1  # one distinct text: nothing to compare
        assert groups[g]["texts"][i] != groups[g]["texts"][j]
    firsts = {g: i for g, i, _ in picks[:2]}  # round one: one pair per open group, led by the RM's top
    assert firsts == {0: 1, 2: 3}
    everything = select_pairs(groups, scores, 100, random.Random(0))
    # every pair of distinct texts once: 3 in group 0 ({1,2,3}), 3 in group 2 ({7,8,9})
    assert len(everything) == 6
    keys = {(g, *sorted((groups[g]["texts"][i], groups[g]["texts"][j]))) for g, i, j in everything}
    assert len(keys) == 6


def test_judge_prefers_the_higher_label_counts_ties_and_skips_abstentions():
    groups = _groups([["0", "2"], ["0", "0x"], ["3", "4"]])  # answers "0", "1", and none
    groups[2]["metas"] = [{"answerable": False, "answer": None, "truncated": False}] * 2  # exact_match abstains
    calls = []

    def labeler(prompts, texts, metas):
        calls.append(list(texts))
        return ExactMatch()(prompts, texts, metas)

    judged, pairs = judge(labeler, groups, [(0, 0, 1), (1, 0, 1), (2, 0, 1)])
    assert calls == [["0", "2", "0", "0x", "3", "4"]]  # one call, on the picked completions only
    assert judged == 2  # group 1 is a tie (both wrong): judged, no pair; group 2 has no judgement
    assert pairs == [PrefPair("0+0=", "0", "2")]


def _saved_rm(tmp_path, task):
    tok = build_char_tokenizer()
    model = build_reward_model("builtin:tiny", tok, seed=0, hidden_size=32, num_layers=1, num_heads=4)
    pairs = accuracy_pairs(task, random.Random(0), 64)
    mean, std = score_stats(model, tok, pairs)
    path = save_reward_model(model, tok, tmp_path / "rm_acc", info={"score_mean": mean, "score_std": std},
                             pairs=pairs)
    assert load_train_pairs(path) == pairs
    return path


def _record(task, rng, prompts=6, G=4):
    """A StepRecord-like object: sampled texts around the right answers (some right, some wrong)."""
    items = [it for it in task.train_prompts(rng, 50) if it.meta["answerable"]][:prompts]
    texts = []
    for it in items:
        a = it.meta["answer"]
        texts += [a, a + "1", str(rng.randrange(100)), a]
    return SimpleNamespace(items=items, texts=texts, group_size=G, truncated=torch.zeros(len(texts), dtype=torch.bool),
                           lengths=torch.full((len(texts),), 3))


def test_refresh_labels_within_budget_trains_the_rm_and_restores_from_its_state(tmp_path):
    task = ArithTask()
    path = _saved_rm(tmp_path, task)
    rc = C.RMRefreshConfig(every_steps=2, labeler="exact_match", labels_per_refresh=5, train_steps=3, batch_size=8)
    calls = []

    class CountingLabeler:
        name = "counting"

        def __call__(self, prompts, texts, metas):
            calls.append(len(texts))
            return ExactMatch()(prompts, texts, metas)

    rm = RewardModelReward(str(path), normalize="fixed")
    before = {k: v.clone() for k, v in rm.model.state_dict().items()}
    refresh = RMRefresh(rc, {"accuracy_rm": rm}, CountingLabeler(), seed=0, run_dir=tmp_path)
    rng = random.Random(1)
    row0 = refresh.after_step(0, _record(task, rng))
    assert row0 == {"rm_refresh/labels_total": 0} and calls == []  # not a refresh step: nothing labelled
    row1 = refresh.after_step(1, _record(task, rng))
    assert calls == [2 * 5]  # 5 pairs of two completions, once
    assert row1["rm_refresh/labels"] <= 5 and row1["rm_refresh/labels_total"] == row1["rm_refresh/labels"]
    labelled = [json.loads(x) for x in (tmp_path / LABELS_FILE).read_text().splitlines()]
    assert len(labelled) == row1["rm_refresh/pairs"] >= 1 and refresh.pool == [
        PrefPair(x["prompt"], x["chosen"], x["rejected"]) for x in labelled]
    assert "rm_refresh/accuracy_rm/pair_acc_before" in row1 and "rm_refresh/accuracy_rm/loss" in row1
    after = rm.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the RM trained
    assert refresh.pending == []

    refresh.after_step(2, _record(task, rng))  # a pending step, then save and restore into a fresh one
    ck = tmp_path / "ck"
    ck.mkdir()
    refresh.save(ck)
    rm2 = RewardModelReward(str(path), normalize="fixed")
    other = RMRefresh(rc, {"accuracy_rm": rm2}, CountingLabeler(), seed=0)
    other.load(ck)
    for k, v in rm.model.state_dict().items():
        torch.testing.assert_close(rm2.model.state_dict()[k], v)
    assert (other.labels_total, other.pool, other.pending) == (refresh.labels_total, refresh.pool, refresh.pending)
    assert (rm2.mean, rm2.std) == (rm.mean, rm.std)


def test_every_labelled_pair_prefers_the_right_answer(tmp_path):
    task = ArithTask()
    path = _saved_rm(tmp_path, task)
    rc = C.RMRefreshConfig(every_steps=1, labeler="exact_match", labels_per_refresh=40, train_steps=1, batch_size=4)
    refresh = RMRefresh(rc, {"a": RewardModelReward(str(path))}, ExactMatch(), seed=3)
    record = _record(task, random.Random(5))
    refresh.after_step(0, record)
    answers = {it.prompt: it.meta["answer"] for it in record.items}
    assert refresh.pool and all(p.chosen == answers[p.prompt] != p.rejected for p in refresh.pool)


class _Gold:
    """A weight-0 'gold' verifier whose scores differ between two otherwise identical runs."""

    name = "gold"
    verifier = True

    def __init__(self, flip: bool):
        self.flip = flip

    def __call__(self, prompts, completions, metadata):
        return [float((len(c) % 2 == 0) != self.flip) for c in completions]


def test_the_gold_reward_at_weight_0_never_reaches_the_loss():
    """Two runs whose weight-0 gold reward scores every completion oppositely train the same policy
    (bit for bit); the gold is still logged (its mean differs between the runs)."""
    from grpolab.rewards.base import register_reward, reward_names

    for flip in (False, True):
        if f"t_gold_{flip}" not in reward_names():
            register_reward(f"t_gold_{flip}")(lambda flip=flip: _Gold(flip))
    tiny = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
            "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=4", "train.microbatch_size=4",
            "train.steps=2", "run.progress=false", "run.tensorboard=false"]
    runs = []
    for flip in (False, True):
        cfg = C.from_preset("grpo", tiny + [f"rewards=[refusal:1.0, t_gold_{flip}:0.0]"])
        s = build_setup(cfg)
        rows = grpo.train(s)
        runs.append((rows, {k: v.detach().clone() for k, v in s.models.policy.state_dict().items()}))
    (rows_a, w_a), (rows_b, w_b) = runs
    for k in w_a:
        torch.testing.assert_close(w_a[k], w_b[k], rtol=0, atol=0)
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert rows_a[0]["reward/t_gold_False/mean"] + rows_b[0]["reward/t_gold_True/mean"] == pytest.approx(1.0)


def test_an_rm_folder_keeps_a_seeded_sample_of_a_large_training_set(tmp_path, monkeypatch):
    from grpolab.reward_models import model as rm_model

    monkeypatch.setattr(rm_model, "MAX_SAVED_PAIRS", 10)
    pairs = [PrefPair(f"{i}+0=", str(i), "x") for i in range(25)]
    rm_model.write_train_pairs(tmp_path, pairs)
    kept = load_train_pairs(tmp_path)
    assert len(kept) == 10 and len(set(kept)) == 10 and set(kept) <= set(pairs)
    rm_model.write_train_pairs(tmp_path, pairs[:5])
    assert load_train_pairs(tmp_path) == pairs[:5]


def test_build_names_ensemble_members_and_refuses_unknown_rewards(tmp_path):
    from grpolab.rewards.reward_model import RewardModelEnsemble
    from grpolab.grpo.setup import build_rm_refresh

    task = ArithTask()
    a = _saved_rm(tmp_path / "a", task)
    b = _saved_rm(tmp_path / "b", task)
    ens = RewardModelEnsemble([str(a), str(b)], mode="min")
    ens.name = "ens"
    single = RewardModelReward(str(a))
    single.name = "acc"
    cfg = C.from_preset("grpo", ["rm_refresh.every_steps=2", "rm_refresh.labeler=exact_match",
                                 "rm_refresh.rewards=[ens]"])
    refresh = build_rm_refresh(cfg, [(ens, 1.0), (single, 1.0)])
    assert list(refresh.targets) == ["ens/0", "ens/1"] and refresh.targets["ens/1"] is ens.members[1]
    everything = build_rm_refresh(cfg.replace(**{"rm_refresh.rewards": []}), [(ens, 1.0), (single, 1.0)])
    assert list(everything.targets) == ["ens/0", "ens/1", "acc"]
    with pytest.raises(ValueError, match="not reward_model"):
        build_rm_refresh(cfg.replace(**{"rm_refresh.rewards": ["nope"]}), [(single, 1.0)])
