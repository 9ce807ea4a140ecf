"""The Python API's objects: a PreTrainedModel with its tokenizer trains as the folder it was loaded from; a
datasets.Dataset is read as the same rows in a list; train_rm returns the reward model's figures."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import grpolab

TIMING_KEYS = ("time/", "tokens_per_s/", "mfu")
TINY = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "rollout.prompts_per_step": 2,
        "rollout.group_size": 4, "rollout.max_new_tokens": 4, "train.steps": 2, "train.minibatch_size": 4,
        "train.microbatch_size": 4, "train.lr": 1e-2, "loss.entropy_coef": 0.01, "run.progress": False,
        "run.tensorboard": False}


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


def test_a_model_object_trains_as_the_folder_it_came_from(tmp_path):
    from grpolab.models.loading import load_model
    from grpolab.models.policy import load_policy

    model, tok = load_policy(grpolab.make_config("grpo", TINY))
    model.save_pretrained(tmp_path / "pi0")
    tok.save_pretrained(tmp_path / "pi0")
    by_path = grpolab.train("grpo", {**TINY, "run.out_dir": str(tmp_path / "a")}, model=str(tmp_path / "pi0"))
    obj = load_model(tmp_path / "pi0")
    by_object = grpolab.train("grpo", {**TINY, "run.out_dir": str(tmp_path / "b")}, model=obj)
    assert by_path.exit_code == by_object.exit_code == 0
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")
    a, b = (load_file(p / "final" / "model.safetensors") for p in (tmp_path / "a", tmp_path / "b"))
    for k in a:
        torch.testing.assert_close(b[k], a[k])
    with pytest.raises(grpolab.api.configs.ConfigError, match="tokenizer"):
        grpolab.train("grpo", TINY, model=obj[0])
    small = {**TINY, "data.eval_prompts": 8}
    by_folder = grpolab.evaluate(str(tmp_path / "a"), "grpo", small)  # its final/
    from_object = grpolab.evaluate(load_model(tmp_path / "a" / "final"), "grpo", small)
    assert by_folder.greedy == from_object.greedy and "accuracy" in by_folder.greedy


def test_a_dataset_is_read_as_its_rows(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from grpolab.api.inputs import data_source

    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path))
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)]
    assert data_source(datasets.Dataset.from_list(rows)) == data_source(rows)  # one file, by its contents
    assert data_source(rows) != data_source(rows[:5])
    (tmp_path / "p.jsonl").write_text("")
    assert data_source(str(tmp_path / "p.jsonl")) == f"jsonl:{tmp_path / 'p.jsonl'}"
    assert data_source("hf:org/name") == "hf:org/name"
    with pytest.raises(FileNotFoundError, match="no_such"):
        data_source(str(tmp_path / "no_such.jsonl"))


def test_train_rm_returns_the_reward_models_figures(tmp_path):
    res = grpolab.train_rm("builtin:accuracy", tmp_path / "rm", steps=3, pairs=24, heldout_pairs=16,
                           hidden_size=16, num_layers=1)
    assert res.path == tmp_path / "rm" and (tmp_path / "rm" / "grpolab_rm.json").is_file()
    assert 0.0 <= res.heldout_accuracy <= 1.0 and res.info["train_pairs"] == 24
    with pytest.raises(grpolab.api.configs.ConfigError, match="stepz"):
        grpolab.train_rm("builtin:accuracy", tmp_path / "rm2", stepz=3)
