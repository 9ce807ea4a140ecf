"""Checkpoints: exact in-process resume, atomic writes (an interrupted write leaves the previous
checkpoint usable), keep-last-K, resume resolution, no unpickling, graceful SIGTERM/SIGINT."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpolab import config as C
from grpolab.data.arith import PromptItem
from grpolab.data.stream import ListStream
from grpolab.rewards.base import register_reward, reward_names
from grpolab.rundir import checkpoint as ck
from grpolab.grpo.checkpoint_hook import CheckpointHook
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup
from grpolab.grpo.signals import StopSignal

REPO = Path(__file__).resolve().parents[2]
TIMING = ("time/", "tokens_per_s/", "mfu")
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "rollout.prompts_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=5",
        "train.minibatch_size=4", "train.microbatch_size=2", "train.lr=1e-2",
        "train.lr_schedule=cosine", "train.warmup_steps=2", "loss.entropy_coef=0.01",
        "run.progress=false", "run.tensorboard=false"]


def _cfg(*ov):
    return C.from_preset("grpo", TINY + list(ov))


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)} for x in lines]


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


_FLAKY = {"calls": 0, "fail_at": None}


class _Flaky:
    """The refusal reward, raising on call number _FLAKY["fail_at"] (call 0 is the start-up probe)."""

    name = "t_flaky_ck"

    def __call__(self, prompts, completions, metadata):
        from grpolab.rewards.rules import Refusal

        _FLAKY["calls"] += 1
        if _FLAKY["calls"] - 1 == _FLAKY["fail_at"]:
            raise ConnectionError("the reward server went away")
        return Refusal()(prompts, completions, metadata)


if "t_flaky_ck" not in reward_names():
    register_reward("t_flaky_ck")(_Flaky)


def test_a_crash_before_the_update_saves_the_step_boundary_and_resume_is_exact(tmp_path, capsys):
    """In process: a reward that fails in step 2's scoring; the run saves step-2 (RNGs and data
    cursor put back to the step's start) and, once fixed, resumes to the uninterrupted result."""
    cfg = _cfg("train.steps=3", "run.checkpoint_every=0", "rewards=[t_flaky_ck]")
    ref, run = tmp_path / "ref", tmp_path / "run"
    _FLAKY.update(calls=0, fail_at=None)
    s_ref = build_setup(cfg)
    assert train_in_run_dir(s_ref, ref) == 0
    _FLAKY.update(calls=0, fail_at=3)  # probe, step 0, step 1, then step 2's scoring fails
    with pytest.raises(RuntimeError, match="reward 't_flaky_ck' raised ConnectionError"):
        train_in_run_dir(build_setup(cfg), run)
    assert "the state before the failed step is saved in" in capsys.readouterr().err
    assert [p.name for p in ck.complete_checkpoints(run / "checkpoints")] == ["step-2"]
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward/m')  # as a kill in the middle of a write would leave it
    _FLAKY.update(calls=0, fail_at=None)  # the cause is fixed: resume
    s = build_setup(cfg)
    assert train_in_run_dir(s, run, resume_from=run / "checkpoints" / "step-2") == 0
    assert s.start_step == 2
    assert _rows(run) == _rows(ref)
    assert (run / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()
    for k, v in s_ref.models.policy.state_dict().items():
        assert torch.equal(v, s.models.policy.state_dict()[k]), k


def test_a_crash_during_the_update_saves_no_half_step(tmp_path, capsys):
    s = build_setup(_cfg("train.steps=2", "run.checkpoint_every=0"))
    real, calls = s.optim.objective, []

    class Boom:
        normalizer = real.normalizer

        def __call__(self, *args):
            calls.append(1)
            if len(calls) == 3:  # step 0, second minibatch: one optimizer step already taken
                raise MemoryError("out of memory")
            return real(*args)

    s.optim.objective = Boom()
    with pytest.raises(MemoryError):
        train_in_run_dir(s, tmp_path)
    assert ck.complete_checkpoints(tmp_path / "checkpoints") == []
    err = capsys.readouterr().err
    assert "is saved in" not in err and "saved checkpoint" not in err, err


def test_checkpoint_round_trip_restores_every_state(tmp_path):
    cfg = _cfg("train.steps=1", "loss.kl_coef=0.04")
    s = build_setup(cfg)
    s.consecutive_skips = 2
    items = [PromptItem(f"{i}+1=", {"answer": str(i + 1), "answerable": True}) for i in range(5)]
    s.data.prompts = ListStream(items, seed=3)
    s.data.prompts.next_batch(7)  # second pass, position 2
    path = ck.save_checkpoint(s, tmp_path, step=5, keep=2)
    weights, ref = _weights(s.models.policy), _weights(ck.reference_model(s))
    s.seed_step(5)  # the loop's streams are seeded per (seed, rank, step), not saved
    draws = (torch.rand(3), torch.randint(0, 10**6, (3,), generator=s.data.sample_gen),
             torch.randperm(8, generator=s.optim.shuffle_gen), s.data.prompts.next_batch(3))

    t = build_setup(cfg)
    t.data.prompts = ListStream(items, seed=3)
    with torch.no_grad():
        for p in list(t.models.policy.parameters()) + list(ck.reference_model(t).parameters()):
            p.add_(1.0)  # make sure loading really overwrites
    assert ck.load_checkpoint(t, path) == 5 and t.start_step == 5 and t.consecutive_skips == 2
    assert all(torch.equal(weights[k], v) for k, v in t.models.policy.state_dict().items())
    assert all(torch.equal(ref[k], v) for k, v in ck.reference_model(t).state_dict().items())
    assert t.optim.scheduler.state_dict() == s.optim.scheduler.state_dict()
    t.seed_step(5)
    again = (torch.rand(3), torch.randint(0, 10**6, (3,), generator=t.data.sample_gen),
             torch.randperm(8, generator=t.optim.shuffle_gen), t.data.prompts.next_batch(3))
    assert all(torch.equal(a, b) for a, b in zip(draws[:3], again[:3])) and draws[3] == again[3]


def test_interrupted_write_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    s = build_setup(_cfg("train.steps=1"))
    root = tmp_path / "checkpoints"
    good = ck.save_checkpoint(s, root, step=1, keep=3)
    saved = _weights(s.models.policy)
    with torch.no_grad():
        for p in s.models.policy.parameters():
            p.add_(0.5)

    real_save = torch.save
    calls = []

    def fail_after_first(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(ck.torch, "save", fail_after_first)
    with pytest.raises(OSError, match="No space"):
        ck.save_checkpoint(s, root, step=2, keep=3)
    monkeypatch.undo()
    assert len(calls) == 2  # model.safetensors and optimizer.pt were written, then it failed
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]  # no step-2, no temp folder left
    # a SIGKILL mid-write leaves a temp folder; a damaged step folder fails its manifest check
    (root / ".tmp-step-2-999").mkdir()
    (root / ".tmp-step-2-999" / "model.safetensors").write_bytes(b"partial")
    shutil.copytree(good, root / "step-3")
    with (root / "step-3" / "model.safetensors").open("r+b") as f:
        f.truncate(100)
    assert ck.latest_checkpoint(root) == good
    assert ck.resolve_resume("auto", tmp_path) == good
    t = build_setup(_cfg("train.steps=1"))
    ck.load_checkpoint(t, ck.latest_checkpoint(root))
    assert all(torch.equal(saved[k], v) for k, v in t.models.policy.state_dict().items())
    assert [p.name for p in ck.remove_stale_tmp(root)] == [".tmp-step-2-999"]


def test_keep_last_k_and_replacing_a_step(tmp_path):
    s = build_setup(_cfg("train.steps=1"))
    (tmp_path / "step-0").mkdir(parents=True)  # an old checkpoint whose deletion was cut short
    for step in range(1, 5):
        ck.save_checkpoint(s, tmp_path, step=step, keep=2)
    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == ["step-3", "step-4"]
    assert not (tmp_path / "step-0").exists()
    s.consecutive_skips = 1
    ck.save_checkpoint(s, tmp_path, step=4, keep=2)  # the same step again: replaced whole
    assert json.loads((tmp_path / "step-4" / "state.json").read_text())["consecutive_skips"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]


def test_resolve_resume(tmp_path):
    assert ck.resolve_resume("", tmp_path) is None
    assert ck.resolve_resume("auto", tmp_path) is None  # nothing yet: a fresh start
    with pytest.raises(ck.CheckpointError, match="nothing-here"):
        ck.resolve_resume(str(tmp_path / "nothing-here"), tmp_path)
    (tmp_path / "checkpoints" / "step-7").mkdir(parents=True)
    with pytest.raises(ck.CheckpointError, match=r"step-7 is incomplete \(no COMPLETE marker\)"):
        ck.resolve_resume(str(tmp_path / "checkpoints" / "step-7"), tmp_path)
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint.*incomplete: \\['step-7'\\]"):
        ck.resolve_resume(str(tmp_path), tmp_path)
    s = build_setup(_cfg("train.steps=1"))
    good = ck.save_checkpoint(s, tmp_path / "checkpoints", step=3, keep=2)
    assert ck.resolve_resume(str(tmp_path), tmp_path) == good
    assert ck.resolve_resume(str(good), tmp_path) == good


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_checkpoint_files_are_never_unpickled(tmp_path):
    s = build_setup(_cfg("train.steps=1"))
    path = ck.save_checkpoint(s, tmp_path, step=1, keep=1)

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    data = pickle.dumps(Payload())  # a hostile optimizer.pt of the same size as the manifest says
    target = path / "optimizer.pt"
    size = target.stat().st_size
    target.write_bytes(data + b"\0" * (size - len(data)))
    with pytest.raises(ck.CheckpointError, match=r"optimizer\.pt is damaged \(its content does not match the SHA-256"):
        ck.load_checkpoint(build_setup(_cfg("train.steps=1")), path)
    # past the hash check too (verify=False), the file is read without unpickling
    with pytest.raises(ck.CheckpointError, match=r"optimizer\.pt cannot be read"):
        ck.load_checkpoint(build_setup(_cfg("train.steps=1")), path, verify=False)
    assert not (tmp_path / "pwned").exists()


def test_truncate_jsonl_keeps_earlier_complete_lines(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "x": ')
    assert ck.truncate_jsonl(f, 2) == 2
    assert f.read_text() == '{"step": 0}\n{"step": 1}\n'
    assert ck.truncate_jsonl(tmp_path / "missing.jsonl", 0) == 0


def test_config_changes_are_listed_except_run_fields(tmp_path):
    s = build_setup(_cfg("train.steps=1"))
    path = ck.save_checkpoint(s, tmp_path, step=1, keep=1)
    changed = _cfg("train.steps=1", "train.lr=0.5", "run.checkpoint_every=3")
    assert ck.config_changes(path, changed) == ["train.lr: 0.01 -> 0.5"]
    fsdp2 = _cfg("train.steps=1", "train.parallel=fsdp2")  # a one-process checkpoint resumed under FSDP2
    assert ck.config_changes(path, fsdp2) == []


def test_stop_signal_sets_a_flag_then_a_second_one_interrupts():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested and stop.signame == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_signal_after_the_step_hook_looked_still_saves_that_step(tmp_path, monkeypatch, capsys):
    """The race of a SIGTERM landing after the checkpoint hook checked for a stop but before the
    loop did: the loop ends, and the completed step is saved all the same."""
    real_call = CheckpointHook.__call__

    def call_then_signal(self, step, *rest):
        real_call(self, step, *rest)
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)

    monkeypatch.setattr(CheckpointHook, "__call__", call_then_signal)
    s = build_setup(_cfg("train.steps=5", "run.checkpoint_every=0"))
    assert train_in_run_dir(s, tmp_path) == 128 + signal.SIGTERM
    assert [p.name for p in ck.complete_checkpoints(tmp_path / "checkpoints")] == ["step-2"]
    assert "stopped by SIGTERM after 2 of 5 steps; checkpoint" in capsys.readouterr().err


def test_sigterm_finishes_the_step_saves_and_exits(tmp_path):
    """A real `grpolab train` process gets SIGTERM mid-run: it finishes the step, checkpoints it,
    says so and exits 128 + 15; --resume then continues from that step."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "grpolab.cli", "train", "grpo", *TINY, "train.steps=30",
           "run.checkpoint_every=0", f"run.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().count("\n"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    text = log.read_text()
    done = (out / "metrics.jsonl").read_text().count("\n")
    assert 1 <= done < 30
    assert "got SIGTERM; finishing the current step" in text
    assert f"stopped by SIGTERM after {done} of 30 steps" in text and "--resume" in text
    assert [p.name for p in ck.complete_checkpoints(out / "checkpoints")] == [f"step-{done}"]
    assert not (out / "final").exists()
