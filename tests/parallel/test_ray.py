"""Rollout and reward workers on a local Ray cluster (CPU): weight sync checked on the workers'
tokens, one worker = the single-process run, reward calls in parallel, overlap one version behind
with the behaviour log-probs in the loss."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from grpolab import config as C  # noqa: E402
from grpolab.rollout.hf import HFEngine  # noqa: E402
from grpolab.grpo import loop as grpo  # noqa: E402
from grpolab.grpo.run import train_in_run_dir  # noqa: E402
from grpolab.grpo.setup import build_setup  # noqa: E402

from ray_sizes import TINY, compared_rows, sample_prompts, stop_after_step_1_and_resume  # noqa: E402


def _cfg(*overrides: str) -> C.Config:
    return C.from_preset("grpo", TINY + list(overrides))


def _checksum(model) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.state_dict().values()))


def test_every_worker_samples_with_the_trainers_new_weights_after_each_sync(ray_cluster):
    """3 steps with 2 rollout workers: after each sync each worker holds version step+1, its weights
    are the trainer's, and from one sampling state it draws the tokens and log-probs the trainer's
    own policy draws (and the greedy tokens); the policy does change over the steps."""
    s = build_setup(_cfg("rollout.workers=2", "train.lr=0.05", "loss.entropy_coef=0.05"))
    probe = ["12+7=", "3*4=", "9-2=", "8/0="]
    local = HFEngine(s.models.tokenizer, s.cfg.rollout.max_new_tokens, model=s.models.policy)
    seen = [local.generate(probe, 2, generator=torch.Generator().manual_seed(5)).input_ids]

    def check(step, row, record):
        assert s.data.engine.versions() == [step + 1, step + 1]
        assert row["sync/bytes"] == sum(v.numel() * v.element_size() for v in s.models.policy.state_dict().values())
        state = torch.Generator().manual_seed(5).get_state()
        mine = local.generate(probe, 2, generator=torch.Generator().manual_seed(5))
        greedy = local.generate(probe, 1, greedy=True)
        for w in s.data.engine.workers:
            assert ray.get(w.state_checksum.remote()) == _checksum(s.models.policy)
            ro, _ = ray.get(w.generate.remote(probe, 2, bytes(state.numpy()), None, False))
            assert ro.weight_version == step + 1
            torch.testing.assert_close(ro.input_ids, mine.input_ids, rtol=0, atol=0)
            torch.testing.assert_close(ro.sampler_logp, mine.sampler_logp)
            g, _ = ray.get(w.generate.remote(probe, 1, None, 0, True))
            torch.testing.assert_close(g.input_ids, greedy.input_ids, rtol=0, atol=0)
        seen.append(mine.input_ids)

    s.services.hooks.append(check)
    try:
        grpo.train(s)
    finally:
        s.close()
    assert len(seen) == 4
    assert any(not torch.equal(a, seen[0]) for a in seen[1:]), "the policy never changed: the test proves nothing"


def _rows(run_dir: Path) -> list[dict]:
    return compared_rows(run_dir)


def test_one_rollout_worker_writes_the_single_process_metrics(ray_cluster, tmp_path):
    """Same seed, CPU: rollout.workers=1 gives the metrics and samples of the in-process engine."""
    for name, extra in (("local", []), ("ray", ["rollout.workers=1"])):
        s = build_setup(_cfg(*extra, "loss.entropy_coef=0.01"))
        assert train_in_run_dir(s, tmp_path / name) == 0
    assert len(_rows(tmp_path / "ray")) == 3
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
    assert (tmp_path / "ray" / "samples.jsonl").read_text() == (tmp_path / "local" / "samples.jsonl").read_text()
    assert all("sync/seconds" in json.loads(x) for x in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines())


def test_reward_workers_score_the_groups_at_once_with_the_same_scores(ray_cluster, tmp_path):
    """A reward that sleeps 1 s per call, 4 groups over 2 reward workers: the 4 calls all run at the
    same time (no call starts after another has ended), and the scores are the in-process ones."""
    log = tmp_path / "calls.jsonl"
    reward = f'rewards=[{{name: "slow_rewards:sleepy", kwargs: {{log: "{log}", seconds: 1.0}}}}]'
    s = build_setup(_cfg("rollout.reward_workers=2", "train.steps=1", reward))
    records = []
    s.services.hooks.append(lambda step, row, record: records.append((row, record)))
    try:
        grpo.train(s)
    finally:
        s.close()
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    remote = [c for c in calls if c["pid"] != os.getpid()]  # the trainer's own call is build_setup's probe
    assert len(remote) == 4 and all(c["rows"] == 4 for c in remote)
    assert max(c["start"] for c in remote) < min(c["end"] for c in remote)
    row, record = records[0]
    torch.testing.assert_close(record.scores["slow_rewards:sleepy"],
                               torch.tensor([float(len(t)) for t in record.texts]))


def test_overlap_learns_one_version_behind_on_the_behaviour_log_probs(ray_cluster, monkeypatch):
    """rollout.overlap=1: step k's rollout was sampled by weights k-1 (staleness 0, 1, 1), and the loss
    takes π_old from those weights (the sampler's log-probs), not from the trainer's policy at step k."""
    s = build_setup(_cfg("rollout.workers=1", "rollout.overlap=1", "train.lr=0.05", "loss.entropy_coef=0.05"))
    seen = []
    learn = grpo.learn

    def spy(setup, ro, st):
        seen.append((ro, copy.deepcopy(setup.models.policy.state_dict())))  # the weights that learn on `ro`
        learn(setup, ro, st)

    monkeypatch.setattr(grpo, "learn", spy)
    staleness = []
    s.services.hooks.append(lambda step, row, record: staleness.append(row["rollout/staleness"]))
    try:
        grpo.train(s)
    finally:
        s.close()
    assert staleness == [0, 1, 1]
    model = copy.deepcopy(s.models.policy)
    for k, (ro, weights) in enumerate(seen):
        assert ro.weight_version == max(k - 1, 0)
        torch.testing.assert_close(ro.old_logp, ro.sampler_logp, rtol=0, atol=0)
        behaviour = seen[max(k - 1, 0)][1]
        model.load_state_dict(behaviour)
        torch.testing.assert_close(ro.old_logp, s.optim.forward.rollout_logprobs(model, ro) * ro.loss_mask)
        if k:
            model.load_state_dict(weights)  # the trainer's own policy at step k: not what the ratio is taken against
            trainer = s.optim.forward.rollout_logprobs(model, ro) * ro.loss_mask
            assert (trainer - ro.old_logp).abs().max() > 1e-4


def test_colocated_placement_shares_each_trainer_gpu_and_refuses_an_overfull_one():
    """Colocated mode: ceil(workers / ranks) workers per trainer bundle on a CUDA model; none on CPUs or
    with whole GPUs (separate mode); a share that leaves the trainer nothing is refused."""
    from grpolab.app.ray_launch import colocated_workers

    def cfg(*ov):
        return C.from_preset("grpo", TINY + list(ov))

    assert colocated_workers(cfg("rollout.workers=3", "rollout.worker_gpus=0.25", "model.device=cuda"), 2) == 2
    assert colocated_workers(cfg("rollout.workers=3", "rollout.worker_gpus=0.25"), 2) == 0  # CPU
    assert colocated_workers(cfg("rollout.workers=2", "rollout.worker_gpus=1", "model.device=cuda"), 2) == 0
    with pytest.raises(ValueError, match="rollout.worker_gpus=0.5"):
        colocated_workers(cfg("rollout.workers=2", "rollout.worker_gpus=0.5", "model.device=cuda"), 1)


def test_the_actors_command_line_drops_ray_and_nproc():
    from grpolab.app.ray_launch import strip_ray

    assert strip_ray(["train", "c.yaml", "--ray", "--nproc", "2", "a=1"]) == ["train", "c.yaml", "a=1"]
    assert strip_ray(["train", "c.yaml", "--ray", "ray://h:10001", "a=1"]) == ["train", "c.yaml", "a=1"]
    assert strip_ray(["train", "c.yaml", "--ray", "a=1", "--resume"]) == ["train", "c.yaml", "a=1", "--resume"]
    assert strip_ray(["train", "c.yaml", "--ray=auto", "--nproc=2"]) == ["train", "c.yaml"]


def test_a_stopped_overlap_run_resumes_with_the_prompts_it_had_not_trained_on(ray_cluster, tmp_path):
    """rollout.overlap=1, stopped after step 1 while step 2's batch was in flight: the checkpoint keeps the
    prompt stream before that batch, so the resumed run trains steps 2 and 3 on the prompts the
    uninterrupted run trained them on (step 2 generated again from the checkpoint's weights: staleness 0)."""

    cfg = _cfg("rollout.workers=1", "rollout.overlap=1", "train.steps=4", "run.checkpoint_every=1")
    assert train_in_run_dir(build_setup(cfg), tmp_path / "whole") == 0
    stop_after_step_1_and_resume(cfg, tmp_path / "run")

    def staleness(run):
        return [json.loads(x)["rollout/staleness"] for x in (run / "metrics.jsonl").read_text().splitlines()]

    assert sample_prompts(tmp_path / "run") == sample_prompts(tmp_path / "whole")
    assert staleness(tmp_path / "whole") == [0, 1, 1, 1]
    assert staleness(tmp_path / "run") == [0, 1, 0, 1]


def test_a_reward_the_workers_cannot_build_is_named_at_setup(ray_cluster):
    reward = f'rewards=[{{name: "slow_rewards:only_in", kwargs: {{pid: {os.getpid()}}}}}]'
    with pytest.raises(ValueError, match=r"rollout.reward_workers: a reward worker could not build the rewards "
                                         r"\['slow_rewards:only_in'\].*cannot be built outside process"):
        build_setup(_cfg("rollout.reward_workers=1", reward))


@pytest.mark.parametrize("how", ["rollout-ray.kill", "rollout-process-killed", "reward-ray.kill"])
def test_a_worker_that_dies_ends_the_run_with_one_grpolab_message(ray_cluster, tmp_path, monkeypatch, capsys, how):
    """A rollout or reward worker that dies before a step (ray.kill, or its process SIGKILLed) ends
    `grpolab train` with one grpolab message naming the worker and --resume, exit code 1, no Ray
    traceback; --resume then finishes the run with new workers."""
    import signal

    from grpolab import cli
    from grpolab.rewards import pool
    from grpolab.rollout import ray_engine

    kind = how.split("-")[0]
    module, build = (ray_engine, "build_ray_engine") if kind == "rollout" else (pool, "build_reward_pool")
    real = getattr(module, build)

    def build_then_kill(*a, **k):
        built = real(*a, **k)
        victim = built.workers[-1]
        if how == "rollout-process-killed":
            os.kill(ray.get(victim.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
        else:
            ray.kill(victim)
        return built

    monkeypatch.setattr(module, build, build_then_kill)
    argv = ["train", "grpo", *TINY, "train.steps=2", f"rollout.{'workers' if kind == 'rollout' else 'reward_workers'}=2",
            f"run.out_dir={tmp_path / 'run'}"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("grpolab: error:") == 1 and "--resume" in err, err
    assert f"{kind} worker 1 of 2" in err and "died during" in err, err
    if how == "rollout-ray.kill":
        assert "(Ray actor grpolab-" in err and "killed by `ray.kill`" in err, err
    assert "Traceback" not in err and "ActorDiedError" not in err, err
    monkeypatch.setattr(module, build, real)
    assert cli.main([*argv, "--resume"]) == 0
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2
