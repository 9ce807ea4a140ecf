"""The Python API is what the command line runs: one config through `grpolab.train` in this process and
through `python -m grpolab train` in another gives the same metrics.jsonl (but wall-clock fields) and the
same final weights; config from preset / YAML / dict with overrides; rows and reward callables as objects."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import grpolab
from grpolab.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TIMING_KEYS = ("time/", "tokens_per_s/", "mfu")
TINY = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "rollout.prompts_per_step": 2,
        "rollout.group_size": 4, "rollout.max_new_tokens": 4, "train.steps": 2, "train.minibatch_size": 4,
        "train.microbatch_size": 2, "train.lr": 1e-2, "loss.entropy_coef": 0.01, "run.progress": False,
        "run.tensorboard": False, "run.threads": 1}


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


def test_api_and_cli_give_identical_metrics_and_weights(tmp_path):
    config = tmp_path / "run.yaml"
    data = {}
    for k, v in TINY.items():
        section, name = k.split(".")
        data.setdefault(section, {})[name] = v
    config.write_text(yaml.safe_dump({"preset": "grpo", **data}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cli = subprocess.run([sys.executable, "-m", "grpolab", "train", str(config), f"run.out_dir={tmp_path / 'cli'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-2000:]
    res = grpolab.train(str(config), [f"run.out_dir={tmp_path / 'api'}"])
    assert res.exit_code == 0 and res.final_model == tmp_path / "api" / "final" and not res.stopped_by
    assert len(res.metrics) == TINY["train.steps"]
    assert _rows(tmp_path / "api") == _rows(tmp_path / "cli")
    a = load_file(tmp_path / "api" / "final" / "model.safetensors")
    b = load_file(tmp_path / "cli" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    from grpolab.models.policy import load_policy

    pi0 = load_policy(grpolab.make_config(str(config)))[0].state_dict()
    assert any(not torch.equal(pi0[k], a[k]) for k in a)  # trained: equal weights are not equal by default


def test_config_from_preset_yaml_dict_and_overrides_agree(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: dapo\ntrain:\n  steps: 7\n")
    from_yaml = grpolab.make_config(str(f), ["rollout.group_size=4"])
    from_dict = grpolab.make_config({"preset": "dapo", "train": {"steps": 7}}, {"rollout.group_size": 4})
    from_preset = grpolab.make_config("dapo", {"train.steps": 7, "rollout.group_size": 4})
    assert from_yaml == from_dict == from_preset
    assert from_preset.train.steps == 7 and from_preset.preset == "dapo"
    assert grpolab.make_config(from_preset, {"train.steps": 3}).train.steps == 3
    with pytest.raises(ConfigError, match="train.stepz"):
        grpolab.make_config("grpo", {"train.stepz": 3})
    with pytest.raises(ConfigError, match=r"c2.yaml:2"):
        (tmp_path / "c2.yaml").write_text("train:\n  steps: -1x\n  steps2: 1\n")
        grpolab.make_config(str(tmp_path / "c2.yaml"))


def test_rows_and_a_reward_callable_as_python_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path / "cache"))
    calls = []

    def ends_in_digit(prompts, completions, metadata):
        calls.append((list(prompts), [m["answer"] for m in metadata]))
        return [float(c[-1:].isdigit()) for c in completions]

    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]
    res = grpolab.train("grpo", {**TINY, "train.steps": 1, "run.out_dir": str(tmp_path / "run")},
                        rewards=[(ends_in_digit, 0.5)], data=rows)
    assert res.exit_code == 0
    assert {"reward/ends_in_digit/mean", "reward/mean"} <= set(res.metrics[0])
    assert calls and all(p.endswith("=") for p in calls[-1][0])  # the rows' prompts, their metadata
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rewards"] == [{"name": "ends_in_digit", "weight": 0.5, "kwargs": {}, "label": "", "verifier": None}]
    source = saved["data"]["source"]
    assert source.startswith(f"jsonl:{tmp_path / 'cache'}") and len(Path(source[6:]).read_text().splitlines()) == 8
    with pytest.raises(ConfigError, match=r"data\[1\]"):
        grpolab.train("grpo", TINY, data=[{"prompt": "x"}, "not a dict"])


def test_import_is_cheap_and_the_names_resolve():
    code = ("import sys, grpolab; assert 'torch' not in sys.modules, 'torch imported'; "
            "import grpolab.sft.sft, grpolab.api; assert grpolab.train_sft is grpolab.api.sft; "
            "assert callable(grpolab.train) and grpolab.Callback and grpolab.evaluate and grpolab.export; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
