"""rollout.overlap=2 on a local Ray cluster (CPU): batches up to 2 weight versions behind, the loss
taken against the sampler's recorded log-probs exactly as in one process, agent episodes recording
their versions per token, and a stopped run that resumes exactly (grpo/overlap.py: resume guarantee)."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from grpolab import config as C  # noqa: E402
from grpolab.grpo import loop as grpo  # noqa: E402
from grpolab.grpo.run import train_in_run_dir  # noqa: E402
from grpolab.grpo.setup import build_setup  # noqa: E402
from grpolab.grpo.stats import StepStats  # noqa: E402

HERE = Path(__file__).resolve().parent
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "train.minibatch_size=8", "train.microbatch_size=4", "train.steps=3", "run.threads=1",
        "run.progress=false", "run.tensorboard=false",
        "model.dtype=float32"]  # workers and trainer compared token for token: float32 on every CPU kind
AGENT = ["model.name_or_path=builtin:tiny-chat", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "environment.name=grpolab.agents.builtin:GuessNumber", "environment.kwargs={n: 9, max_turns: 3}",
         "data.source=builtin:seeds", "rewards=[]", "rollout.max_turns=3", "rollout.max_new_tokens=4",
         "rollout.prompts_per_step=4", "rollout.group_size=4", "train.minibatch_size=8", "train.microbatch_size=4",
         "train.steps=3", "run.threads=1", "run.progress=false", "run.tensorboard=false", "model.dtype=float32"]
NOT_COMPARED = ("time/", "tokens_per_s/", "mfu", "sync/")
K = 2


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join(p for p in (str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="grpolab-tests",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    torch.set_num_threads(1)
    yield
    ray.shutdown()


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


def test_overlap_2_learns_up_to_two_versions_behind_with_the_one_process_loss(cluster, monkeypatch):
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


def test_overlap_2_samples_episodes_up_to_two_versions_behind(cluster, monkeypatch):
    seen = _spy_learn(monkeypatch)
    s = build_setup(C.from_preset("grpo", AGENT + ["rollout.workers=2", f"rollout.overlap={K}", "train.lr=0.05"]))
    rows = []
    s.services.hooks.append(lambda step, row, record: rows.append(row))
    try:
        grpo.train(s)
    finally:
        s.close()
    assert [(r["rollout/staleness"], r["rollout/staleness_max"]) for r in rows] == [(0, 0), (1, 1), (2, 2)]
    assert all(math.isfinite(r["loss"]) and r["episode/policy_tokens"] > 0 for r in rows)
    for k, (ro, _) in enumerate(seen):
        assert ro.weight_version == 0 and ro.token_versions().eq(0).all() and ro.row_versions().eq(0).all()


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rows]


def test_a_stopped_overlap_2_run_resumes_exactly(cluster, tmp_path):
    """Stopped (SIGTERM's way) after step 1 with steps 2 and 3 in flight, resumed from step-2: the
    metrics and samples equal those of an uninterrupted run that restarts its pipeline at the end of
    step 1 (staleness 0, 1, 0, 1, 2), and every step trains on the prompts of the run never interrupted."""
    from grpolab.grpo.signals import request_stop
    from grpolab.rundir.checkpoint import complete_checkpoints

    cfg = _cfg("rollout.workers=1", f"rollout.overlap={K}", "train.steps=5", "run.checkpoint_every=1", "train.lr=0.05",
               "loss.entropy_coef=0.05")
    assert train_in_run_dir(build_setup(cfg), tmp_path / "whole") == 0
    s = build_setup(cfg)
    s.services.hooks.append(lambda step, row, record: s.data.prefetch.restart(s) if step == 1 else None)
    assert train_in_run_dir(s, tmp_path / "restarted") == 0
    s = build_setup(cfg)
    s.services.hooks.insert(0, lambda step, row, record: request_stop() if step == 1 else None)
    assert train_in_run_dir(s, tmp_path / "run") == 143
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")][-1] == "step-2"
    s = build_setup(cfg)
    assert train_in_run_dir(s, tmp_path / "run", resume_from=tmp_path / "run" / "checkpoints" / "step-2") == 0

    def prompts(run):
        return [(r["step"], r["prompt"]) for r in map(json.loads, (run / "samples.jsonl").read_text().splitlines())]

    assert [r["rollout/staleness"] for r in _rows(tmp_path / "whole")] == [0, 1, 2, 2, 2]
    assert [r["rollout/staleness"] for r in _rows(tmp_path / "run")] == [0, 1, 0, 1, 2]
    assert _rows(tmp_path / "run") == _rows(tmp_path / "restarted")
    assert (tmp_path / "run" / "samples.jsonl").read_text() == (tmp_path / "restarted" / "samples.jsonl").read_text()
    assert prompts(tmp_path / "run") == prompts(tmp_path / "whole")
    assert _rows(tmp_path / "run")[2]["reward/mean"] != _rows(tmp_path / "whole")[2]["reward/mean"] or \
        _rows(tmp_path / "run")[2]["loss"] != _rows(tmp_path / "whole")[2]["loss"]  # other weights sampled step 2
