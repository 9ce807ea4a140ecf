"""model.gradient_checkpointing on 2 gloo ranks (`grpolab train --nproc 2`): under DDP (with LoRA) and under
FSDP2 (per-layer sharding wraps the checkpointed decoder layers) two GRPO steps give the same metrics and
final weights as the same run without checkpointing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
TIMING = ("time/", "tokens_per_s/", "mfu")
CONFIG = """\
preset: grpo
model: {hidden_size: 32, num_layers: 2, num_heads: 2, lora_rank: %d}
rollout: {prompts_per_step: 4, group_size: 2, max_new_tokens: 4}
train: {steps: 2, minibatch_size: 4, microbatch_size: 1, lr: 0.01, parallel: %s}
loss: {entropy_coef: 0.01}
run: {progress: false, tensorboard: false}
"""


def _train(tmp: Path, out: Path, checkpointing: bool) -> Path:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "grpolab", "train", str(tmp / "cfg.yaml"), f"run.out_dir={out}",
           f"model.gradient_checkpointing={str(checkpointing).lower()}", "--nproc", "2"]
    done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _rows(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(TIMING)} for x in lines]


@pytest.mark.parametrize("parallel,lora", [("ddp", 4), ("fsdp2", 0)])
def test_checkpointing_on_two_ranks_changes_nothing(tmp_path, parallel, lora):
    if lora:
        pytest.importorskip("peft", reason="peft is not installed (grpolab[lora])")
    (tmp_path / "cfg.yaml").write_text(CONFIG % (lora, parallel))
    plain = _train(tmp_path, tmp_path / "plain", False)
    ckpt = _train(tmp_path, tmp_path / "ckpt", True)
    assert _rows(plain) == _rows(ckpt)
    weights = "final/adapter_model.safetensors" if lora else "final/model.safetensors"  # LoRA: the adapters
    a, b = load_file(plain / weights), load_file(ckpt / weights)
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k])
