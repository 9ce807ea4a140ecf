"""The step's `accuracy` metric (grpolab.grpo.stats): the 1.0 rate of the first reward, in config
order, whose verifier flag is set and that scored at least one row."""

from types import SimpleNamespace

import torch

from grpolab.data.arith import REFUSAL
from grpolab.rewards.registry import build_reward
from grpolab.grpo.stats import StepRecord, StepStats, score_rollout

G = 2


def _step(rewards):
    """Scores 2 prompts x G completions with `rewards` [(fn, weight)]; returns the metrics row."""
    items = [SimpleNamespace(prompt="1+1=", meta={"answer": "2", "answerable": True}),
             SimpleNamespace(prompt="1/0=", meta={"answer": None, "answerable": False})]
    texts = ["2", "3", REFUSAL, "5"]
    n = len(texts)
    ro = SimpleNamespace(group_size=G, truncated=torch.zeros(n, dtype=torch.bool), prompt_len=1,
                         attention_mask=torch.ones(n, 3, dtype=torch.long),
                         input_ids=torch.zeros(n, 3, dtype=torch.long),
                         advantages=torch.zeros(n))
    st = StepStats(0)
    scores, combined = score_rollout(rewards, items, texts, ro, "raise", st)
    ro.rewards = combined
    s = SimpleNamespace(optim=SimpleNamespace(scheduler=SimpleNamespace(get_last_lr=lambda: [1e-4])), mfu=lambda row: 0.0)
    return st.finish(StepRecord.of(ro, items, texts, scores), s)


def _named(name, **kwargs):
    return build_reward(name, **kwargs)


def test_the_demo_rewards_give_exact_match_accuracy():
    row = _step([(_named("exact_match"), 1.0), (_named("refusal"), 1.0)])
    assert row["accuracy"] == 0.5  # answerable rows: "2" right, "3" wrong; exact_match abstains elsewhere
    assert row["accuracy"] == row["reward/exact_match/mean"]


def test_no_verifier_no_accuracy():
    assert "accuracy" not in _step([(_named("refusal"), 1.0), (_named("format"), 1.0)])


def test_first_verifier_in_config_order_that_scored():
    always = build_reward("refusal", verifier=True)  # refusal right on 3 of 4 rows
    always.name = "refusal_as_verifier"
    row = _step([(_named("format"), 1.0), (always, 1.0), (_named("exact_match"), 1.0)])
    assert row["accuracy"] == 0.75
    row = _step([(_named("exact_match"), 1.0), (always, 1.0)])
    assert row["accuracy"] == 0.5


class _Abstains:
    name = "abstains"
    verifier = True

    def __call__(self, prompts, completions, metadata):
        return [None] * len(completions)


def test_a_verifier_that_abstained_everywhere_is_skipped():
    assert _step([(_Abstains(), 1.0), (_named("exact_match"), 1.0)])["accuracy"] == 0.5


def test_a_labelled_verifier_still_counts():
    fn = build_reward("exact_match")
    fn.name = "acc"  # build_setup sets the label as the name
    assert _step([(fn, 1.0)])["accuracy"] == 0.5
