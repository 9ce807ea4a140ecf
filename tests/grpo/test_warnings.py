"""Degraded behaviour is never silent: a reward replaced after an error shows on the console
(rate-limited), in RUN/warnings.jsonl and in the report."""

from __future__ import annotations

import json

from grpolab import config as C
from grpolab.report.html import write_report
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "train.minibatch_size=8", "train.microbatch_size=4",
        "train.steps=4", "train.on_reward_error=zero", "run.progress=false", "run.tensorboard=false"]


class Flaky:
    """Raises on every other call (steps 0 and 2 of the run)."""

    name, verifier, timeout_s = "flaky", False, 0

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, completions, metadata):
        self.calls += 1
        if self.calls % 2:
            raise ValueError("the judge is down")
        return [1.0] * len(completions)


def test_a_replaced_reward_is_on_the_console_once_in_warnings_jsonl_and_in_the_report(tmp_path, capsys):
    s = build_setup(C.from_preset("grpo", TINY))
    s.data.rewards.append((Flaky(), 1.0))
    assert train_in_run_dir(s, tmp_path) == 0
    err = capsys.readouterr().err
    message = "reward 'flaky' raised ValueError: the judge is down (train.on_reward_error=zero: scored 0 on this batch)"
    assert err.count(f"grpolab: warning: step 0: {message}") == 1
    assert "step 2:" not in err  # within 30 s of the first: counted, not printed ...
    assert "grpolab: warning: 1 warning(s) not shown yet" in err  # ... until the run ends
    logged = [json.loads(x) for x in (tmp_path / "warnings.jsonl").read_text().splitlines()]
    assert logged == [{"step": 0, "message": message}, {"step": 2, "message": message}]
    assert [json.loads(x)["reward_errors"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 0, 1, 0]
    html = write_report(tmp_path).read_text()
    assert 'id="warnings"' in html and "reward_errors: 2" in html and "the judge is down" in html


def test_a_wandb_project_logs_every_step_there(tmp_path, monkeypatch):
    import sys
    import types

    logged = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")
    fake.init = lambda project, dir: types.SimpleNamespace(project=project, log=lambda d, step: logged.append(step),
                                                           finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: fake.__spec__ if name == "wandb" else real(name, *a))
    cfg = C.from_preset("grpo", TINY + ["train.steps=2", "run.wandb_project=grpolab-test"])
    assert train_in_run_dir(build_setup(cfg), tmp_path) == 0
    assert logged == [0, 1]


def test_a_wandb_project_without_wandb_is_a_config_error(monkeypatch):
    import pytest

    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(C.ConfigError, match=r"run.wandb_project='p'.*pip install wandb"):
        C.from_preset("grpo", ["run.wandb_project=p"])
