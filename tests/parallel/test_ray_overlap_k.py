"""rollout.overlap=2 on a local Ray cluster (CPU): batches up to 2 weight versions behind, the loss
taken against the sampler's recorded log-probs exactly as in one process, agent episodes recording
their versions per token, and a stopped run that resumes exactly (grpo/overlap.py: resume guarantee)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from grpolab import config as C  # noqa: E402
from grpolab.grpo import loop as grpo  # noqa: E402
from grpolab.grpo.run import train_in_run_dir  # noqa: E402
from grpolab.grpo.setup import build_setup  # noqa: E402
from grpolab.grpo.stats import StepStats  # noqa: E402

from ray_sizes import (AGENT, TINY, compared_rows, sample_prompts, stop_after_step_1_and_resume,  # noqa: E402
                       train_rows)
K = 2


def _cfg(*overrides: str) -> C.Config:
    return C.from_preset("grpo", TINY + list(overrides))


def _spy_learn(monkeypatch) -> list:
    """(rollout, the policy's weights) of every step's learn call, the weights before it learns."""
    seen, learn = [], grpo.learn

    def spy(setup, ro, st):
        seen.append((ro, copy.deepcopy(setup.models.policy.state_dict())))
        learn(setup, ro, st)

    monkeypatch.setattr(grpo, "learn", spy)
    return seen


def test_overlap_2_learns_up_to_two_versions_behind_with_the_one_process_loss(ray_cluster, monkeypatch):
    """Step k learns on a batch sampled by weights max(k-2, 0) (staleness 0, 1, 2, 2, logged as mean and
    max, never above K); π_old is that behaviour policy's (the sampler's log-probs), and the loss is the
    one a one-process trainer computes on the same recorded batch with the same weights."""
    over = ["train.lr=0.05", "loss.entropy_coef=0.05", "train.minibatch_size=16", "train.steps=4"]
    learn = grpo.learn
    seen = _spy_learn(monkeypatch)
    s = build_setup(_cfg("rollout.workers=1", f"rollout.overlap={K}", *over))
    rows = []
    s.services.hooks.append(lambda step, row, record: rows.append(row))
    try:
        grpo.train(s)
        assert not s.data.engine.sync_wait and s.data.engine.versions() == [4]  # the last sync, waited for here
    finally:
        s.close()
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 2, 2]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 2]
    assert all(r["rollout/staleness_max"] <= K for r in rows)
    local = build_setup(_cfg(*over))  # one process: no workers, no overlap
    model = copy.deepcopy(local.models.policy)
    for k, (ro, weights) in enumerate(seen):
        assert ro.weight_version == max(k - K, 0)
        assert (k - ro.token_versions()).eq(rows[k]["rollout/staleness"]).all()
        torch.testing.assert_close(ro.old_logp, ro.sampler_logp, rtol=0, atol=0)
        model.load_state_dict(seen[ro.weight_version][1])  # the behaviour policy
        torch.testing.assert_close(ro.old_logp, local.optim.forward.rollout_logprobs(model, ro) * ro.loss_mask)
        local.models.policy.load_state_dict(weights)
        local.seed_step(k)
        st = StepStats(k)
        learn(local, ro, st)
        assert len(st.losses) == 1
        torch.testing.assert_close(st.losses[0], rows[k]["loss"], rtol=1e-6, atol=1e-7)


def test_overlap_2_samples_episodes_up_to_two_versions_behind(ray_cluster, monkeypatch):
    seen = _spy_learn(monkeypatch)
    rows = train_rows(build_setup(C.from_preset("grpo", AGENT + ["rollout.workers=2", f"rollout.overlap={K}",
                                                                  "train.lr=0.05"])))
    assert [(r["rollout/staleness"], r["rollout/staleness_max"]) for r in rows] == [(0, 0), (1, 1), (2, 2)]
    assert all(math.isfinite(r["loss"]) and r["episode/policy_tokens"] > 0 for r in rows)
    for k, (ro, _) in enumerate(seen):
        assert ro.weight_version == 0 and ro.token_versions().eq(0).all() and ro.row_versions().eq(0).all()


def _rows(run: Path) -> list[dict]:
    return compared_rows(run)


def test_a_stopped_overlap_2_run_resumes_exactly(ray_cluster, tmp_path):
    """Stopped (SIGTERM's way) after step 1 with steps 2 and 3 in flight, resumed from step-2: the
    metrics and samples equal those of an uninterrupted run that restarts its pipeline at the end of
    step 1 (staleness 0, 1, 0, 1, 2), and every step trains on the prompts of the run never interrupted."""

    cfg = _cfg("rollout.workers=1", f"rollout.overlap={K}", "train.steps=5", "run.checkpoint_every=1", "train.lr=0.05",
               "loss.entropy_coef=0.05")
    assert train_in_run_dir(build_setup(cfg), tmp_path / "whole") == 0
    s = build_setup(cfg)
    s.services.hooks.append(lambda step, row, record: s.data.prefetch.restart(s) if step == 1 else None)
    assert train_in_run_dir(s, tmp_path / "restarted") == 0
    stop_after_step_1_and_resume(cfg, tmp_path / "run")

    assert [r["rollout/staleness"] for r in _rows(tmp_path / "whole")] == [0, 1, 2, 2, 2]
    assert [r["rollout/staleness"] for r in _rows(tmp_path / "run")] == [0, 1, 0, 1, 2]
    assert _rows(tmp_path / "run") == _rows(tmp_path / "restarted")
    assert (tmp_path / "run" / "samples.jsonl").read_text() == (tmp_path / "restarted" / "samples.jsonl").read_text()
    assert sample_prompts(tmp_path / "run") == sample_prompts(tmp_path / "whole")
    assert _rows(tmp_path / "run")[2]["reward/mean"] != _rows(tmp_path / "whole")[2]["reward/mean"] or \
        _rows(tmp_path / "run")[2]["loss"] != _rows(tmp_path / "whole")[2]["loss"]  # other weights sampled step 2
