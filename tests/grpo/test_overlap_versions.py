"""rollout.overlap=K without Ray: the weight versions a Rollout records per row and token (merged
batches, merged episodes), the staleness statistics of a step, the Prefetcher's bookkeeping, and
the config's checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpolab import config as C
from grpolab.agents.episode import Episode, EpisodeBatch
from grpolab.batch import Rollout, concat_rollouts
from grpolab.grpo.overlap import Prefetcher
from grpolab.grpo.stats import StepStats
from grpolab.parallel.parallel import Parallel
from grpolab.rollout.ray_engine import merge_episodes


def _rollout(n: int, lc: int, version: int) -> Rollout:
    loss = torch.ones(n, lc, dtype=torch.bool)
    loss[0, lc - 1] = False
    return Rollout(input_ids=torch.arange(n * (2 + lc)).view(n, 2 + lc), attention_mask=torch.ones(n, 2 + lc, dtype=torch.bool),
                   prompt_len=2, loss_mask=loss, truncated=torch.zeros(n, dtype=torch.bool), group_size=2,
                   sampler_logp=torch.randn(n, lc), weight_version=version)


def test_one_version_per_rollout_is_kept_as_a_number_and_broadcast_on_demand():
    ro = _rollout(2, 3, 4)
    assert ro.versions is None
    assert ro.token_versions().tolist() == [[4] * 3] * 2 and ro.row_versions().tolist() == [4, 4]
    both = concat_rollouts([ro, _rollout(2, 3, 4)], pad=0)
    assert both.versions is None and both.weight_version == 4


def test_rollouts_of_different_versions_keep_each_rows_version_per_token():
    a, b = _rollout(2, 3, 5), _rollout(2, 4, 3)
    ro = concat_rollouts([a, b], pad=0)
    assert ro.weight_version == 3
    assert ro.versions.tolist() == [[5, 5, 5, 5]] * 2 + [[3, 3, 3, 3]] * 2
    assert ro.row_versions().tolist() == [5, 5, 3, 3]
    sub = ro.select(torch.tensor([3, 0]))
    assert sub.row_versions().tolist() == [3, 5] and sub.versions.shape == sub.loss_mask.shape
    tokens = ro.versions.clone()
    tokens[1, 1] = 2  # a token sampled by an older version (an in-flight weight update): the row is as old as it
    assert ro.replace(versions=tokens).row_versions().tolist() == [5, 2, 3, 3]


def _episode(prompt: list[int], ids: list[int]) -> Episode:
    ep = Episode(prompt)
    ep.add_policy(ids, [-0.5] * len(ids))
    return ep.finish("done", truncated=False)


def test_merged_episode_batches_keep_each_episodes_version():
    first = EpisodeBatch([_episode([5], [6, 7]), _episode([5], [8])], 2, 0, weight_version=3)
    second = EpisodeBatch([_episode([9, 9], [1]), _episode([9, 9], [2, 3, 4])], 2, 0, weight_version=1)
    same = merge_episodes([EpisodeBatch([_episode([5], [6])] * 2, 2, 0, 3), EpisodeBatch([_episode([5], [7])] * 2, 2, 0, 3)])
    assert same.rollout().versions is None and same.rollout().weight_version == 3
    merged = merge_episodes([first, second])
    assert [e.weight_version for e in merged.episodes] == [3, 3, 1, 1]
    ro = merged.rollout()
    assert ro.weight_version == 1 and ro.versions.shape == ro.loss_mask.shape
    assert ro.versions.tolist() == [[3, 3, 3]] * 2 + [[1, 1, 1]] * 2 and ro.row_versions().tolist() == [3, 3, 1, 1]


def test_the_step_logs_the_mean_and_the_max_staleness_over_its_rows():
    st = StepStats(0)
    st.set_staleness(torch.tensor([2, 2, 0, 0]))
    st.reduce(Parallel())
    assert (st.staleness_sum / st.staleness_rows, st.staleness_max) == (1.0, 2)


class _Stream:
    def __init__(self):
        self.cursor = 0

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]

    def next_batch(self, n):
        self.cursor += n
        return [SimpleNamespace(prompt=i) for i in range(self.cursor - n, self.cursor)]


def test_the_prefetcher_keeps_k_steps_in_flight_and_restarts_before_the_earliest(monkeypatch):
    """take(step k) submits the steps up to k+K (never past train.steps); the checkpoint's prompt state
    is the one before the earliest batch in flight; restart puts the stream back there."""
    import grpolab.grpo.dynamic_sampling as ds

    cfg = SimpleNamespace(rollout=SimpleNamespace(prompts_per_step=2, group_size=2), train=SimpleNamespace(steps=4, seed=0))
    stream = _Stream()
    s = SimpleNamespace(cfg=cfg, data=SimpleNamespace(prompts=stream, agent=None,
                                                      engine=SimpleNamespace(submit=lambda p, g, generator: p)),
                        services=SimpleNamespace(parallel=Parallel()))
    monkeypatch.setattr(ds, "generate_batch", lambda s, items, st, in_flight=None: [it.prompt for it in items])
    pre = Prefetcher(2)
    try:
        assert pre.take(s, StepStats(0)) == [0, 1]  # generated in place
        assert [p.step for p in pre.pending] == [1, 2] and pre.prompt_state == {"cursor": 2}
        assert pre.take(s, StepStats(1)) == [2, 3]
        assert [p.step for p in pre.pending] == [2, 3] and pre.prompt_state == {"cursor": 4}
        assert pre.take(s, StepStats(2)) == [4, 5] and [p.step for p in pre.pending] == [3]  # step 4 is past the end
        pre.restart(s)
        assert not pre.pending and pre.prompt_state is None and stream.cursor == 6
        assert pre.take(s, StepStats(3)) == [6, 7]  # the restarted pipeline draws step 3's prompts again
    finally:
        pre.close()


def test_overlap_k_is_checked():
    base = ["rollout.workers=1"]
    assert C.from_preset("grpo", base + ["rollout.overlap=3"]).rollout.overlap == 3
    with pytest.raises(C.ConfigError, match=r"rollout.overlap=-1 must be ≥ 0"):
        C.from_preset("grpo", base + ["rollout.overlap=-1"])
    with pytest.raises(C.ConfigError, match=r"rollout.overlap=2 generates the next 2 rollouts .* set rollout.workers ≥ 1"):
        C.from_preset("grpo", ["rollout.overlap=2"])
    with pytest.raises(C.ConfigError, match=r"rollout.overlap=2 prefetches one batch per step; rollout.dynamic_sampling"):
        C.from_preset("dapo", base + ["rollout.overlap=2"])
