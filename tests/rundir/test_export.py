"""`grpolab export`: a run's policy as a standalone HF folder giving the same greedy tokens, with and without LoRA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from grpolab.cli import main

PROMPTS = ["12+7=", "3-1=", "45+45=", "9/0="]


def _train(tmp_path, *overrides) -> Path:
    out = tmp_path / "run"
    code = main(["train", "grpo", "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=2",
                 "train.minibatch_size=8", "train.microbatch_size=8", "model.hidden_size=32", "model.num_layers=2",
                 "train.lr=1e-2", "run.checkpoint_every=1", "run.tensorboard=false", "run.progress=false",
                 "model.dtype=float32",  # greedy tokens compared exactly: float32 numerics on every CPU kind
                 f"run.out_dir={out}", *overrides])
    assert code == 0
    return out


def _greedy(model, tok):
    from grpolab.rollout.hf import HFEngine

    eng = HFEngine(tok, max_new_tokens=6)
    return eng.generate_with(model, PROMPTS, 1, greedy=True).completion_ids


@pytest.mark.parametrize("lora", [False, True])
def test_exported_folder_loads_with_transformers_and_gives_the_runs_greedy_tokens(tmp_path, lora):
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpolab import config as C
    from grpolab.models.policy import load_policy

    if lora and importlib.util.find_spec("peft") is None:
        pytest.skip("LoRA needs the lora extra: pip install -e '.[lora]'")
    run = _train(tmp_path, *(["model.lora_rank=4", "loss.kl_coef=0.0"] if lora else []))
    for step in (None, 1):
        out = tmp_path / f"export-{step}"
        assert main(["export", str(run), "--out", str(out)] + (["--step", str(step)] if step else [])) == 0
        model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
        assert not (out / "adapter_config.json").exists()
        # the run's own policy at that point: the config's model with the checkpoint's (or final) weights
        policy, ptok = load_policy(C.load(str(run / "config.yaml")))
        load_model(policy, str(run / "checkpoints" / f"step-{step or 2}" / "model.safetensors"), strict=True)
        want = _greedy(policy.eval(), ptok)
        assert torch.equal(_greedy(model, tok), want)
    if lora:  # the adapters learned something: the merged weights differ from the base
        base, _ = load_policy(C.load(str(run / "config.yaml")).replace(**{"model.lora_rank": 0}))
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export-None", local_files_only=True)
        name = next(k for k in merged.state_dict() if "q_proj.weight" in k)
        assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])


def test_export_errors_are_one_message(tmp_path, capsys):
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "is not a grpolab run directory" in capsys.readouterr().err
    run = _train(tmp_path)
    assert main(["export", str(run), "--out", str(tmp_path / "y"), "--step", "7"]) == 2
    assert "no checkpoint step-7 (complete ones: step-1, step-2)" in capsys.readouterr().err
