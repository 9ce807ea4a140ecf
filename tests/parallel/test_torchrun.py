"""`grpolab train --nproc 2` (torchrun, 2 gloo ranks on this CPU): a rank killed with SIGKILL mid-run
ends the run, `--resume` finishes it with the metrics and samples of an uninterrupted 2-rank run,
the 2-rank checkpoint resumes in one process, and that one's checkpoint on 2 ranks again. DDP and
FSDP2 (with a sharded reference)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TIMING = ("time/", "tokens_per_s/", "mfu")
STEPS = 4

KILLER = '''
import os, signal
from pathlib import Path

CALLS = 0


def reward(prompts, completions, metadata):
    """Longer is better (a signal even for an untrained model); rank 1 kills itself with SIGKILL in
    its 4th call (1 probe + steps 0 and 1, so step 2 dies) unless the marker file exists."""
    global CALLS
    CALLS += 1
    marker = Path(os.environ["KILL_MARKER"])
    if os.environ.get("RANK") == "1" and CALLS == 4 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return [min(len(c), 6) / 6 for c in completions]
'''

CONFIG = """\
preset: grpo
model: {hidden_size: 32, num_layers: 2, num_heads: 2}
rollout: {prompts_per_step: 4, group_size: 4, max_new_tokens: 6}
train: {minibatch_size: 8, microbatch_size: 2, lr: 0.01, lr_schedule: cosine, warmup_steps: 1, parallel: %s}
loss: {kl_coef: %s}
rewards: [{name: "killer:reward", weight: 1.0}]
run: {checkpoint_every: 1, progress: false, tensorboard: false}
"""


def _train(tmp: Path, out: Path, nproc: int, marker: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(Path(__file__).resolve().parents[2])]), "KILL_MARKER": str(marker), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "grpolab", "train", str(tmp / "cfg.yaml"), f"train.steps={STEPS}",
           f"run.out_dir={out}", *extra, "--nproc", str(nproc)]
    return subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)


def _rows(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)} for x in lines]


# FSDP2 with a KL (sharded policy and reference, DCP) in CI; DDP's kill and resume under torchrun is the same
# path with replicated weights (run it with -k ddp after changing the launch or checkpoint code), and
# tests/parallel/test_ray_cli.py resumes DDP ranks under torchrun in CI. Both together take two minutes.
@pytest.mark.parametrize("parallel,kl", [pytest.param("ddp", 0.0, marks=pytest.mark.skipif(
    not os.environ.get("GRPOLAB_ALL_DIST"), reason="DDP variant: set GRPOLAB_ALL_DIST=1 (FSDP2 runs in CI)")),
    ("fsdp2", 0.04)])
def test_a_killed_rank_resumes_exactly_and_the_checkpoint_resumes_in_one_process(tmp_path, parallel, kl):
    (tmp_path / "killer.py").write_text(KILLER)
    (tmp_path / "cfg.yaml").write_text(CONFIG % (parallel, kl))
    no_kill = tmp_path / "never"
    no_kill.touch()
    full = _train(tmp_path, tmp_path / "full", 2, no_kill)
    assert full.returncode == 0, full.stderr[-3000:]

    killed = _train(tmp_path, tmp_path / "killed", 2, tmp_path / "marker")
    assert killed.returncode == 128 + 9 and (tmp_path / "marker").exists(), killed.stderr[-3000:]
    assert "rank 1 of 2" in killed.stderr and "killed by SIGKILL" in killed.stderr and "--resume" in killed.stderr
    assert "ChildFailedError" not in killed.stderr and "torch/distributed/run.py" not in killed.stderr  # no launcher
    assert sorted(p.name for p in (tmp_path / "killed/checkpoints").iterdir() if p.name.startswith("step-")) \
        == ["step-1", "step-2"]  # rank 1 died in step 2: its checkpoint was never written
    shutil.copytree(tmp_path / "killed", tmp_path / "one")

    resumed = _train(tmp_path, tmp_path / "killed", 2, tmp_path / "marker", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _rows(tmp_path / "killed") == _rows(tmp_path / "full")
    assert (tmp_path / "killed/samples.jsonl").read_text() == (tmp_path / "full/samples.jsonl").read_text()
    assert len((tmp_path / "full/samples.jsonl").read_text().splitlines()) == STEPS * 4  # both ranks' groups
    rewards = [r["reward/mean"] for r in _rows(tmp_path / "full")]
    assert len(set(rewards)) > 1  # the runs compared are not trivially equal

    one = _train(tmp_path, tmp_path / "one", 1, tmp_path / "marker", "--resume")  # DCP reshards to 1 rank
    assert one.returncode == 0, one.stderr[-3000:]
    assert [r["step"] for r in _rows(tmp_path / "one")] == list(range(STEPS))
    assert _rows(tmp_path / "one")[:2] == _rows(tmp_path / "full")[:2]
    # and back: the one-process checkpoint of step 4 (safetensors) continues on 2 ranks
    two = _train(tmp_path, tmp_path / "one", 2, tmp_path / "marker", f"train.steps={STEPS + 1}", "--resume")
    assert two.returncode == 0, two.stderr[-3000:]
    assert [r["step"] for r in _rows(tmp_path / "one")] == list(range(STEPS + 1))

    from transformers import AutoModelForCausalLM

    from grpolab.rundir.export import export_run

    final = AutoModelForCausalLM.from_pretrained(tmp_path / "full/final")  # gathered from the shards
    exported = AutoModelForCausalLM.from_pretrained(export_run(tmp_path / "full", tmp_path / "export", step=STEPS))
    extra = exported.state_dict().keys() - final.state_dict().keys()  # written as the equivalent Llama:
    assert final.state_dict().keys() <= exported.state_dict().keys()  # o_proj biases, zero (models/serving.py)
    assert all(k.endswith("o_proj.bias") and not exported.state_dict()[k].any() for k in extra)
    for name, weight in final.state_dict().items():  # the last checkpoint (DCP) holds the final weights
        torch.testing.assert_close(exported.state_dict()[name], weight, rtol=0, atol=0)
