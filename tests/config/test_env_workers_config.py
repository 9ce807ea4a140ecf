"""rollout.env_workers / env_timeout_s / env_worker_threads: validation and the AgentSpec they make."""

from __future__ import annotations

import importlib.util
import functools

import pytest

from grpolab import config as C
from grpolab.agents.agent import AgentSpec

ENV = ["environment.name=grpolab.agents.builtin:GuessNumber", "data.source=builtin:seeds", "rewards=[]"]


def test_env_workers_need_an_environment():
    with pytest.raises(C.ConfigError, match=r"rollout.env_workers=2 .* no environment is named"):
        C.from_preset("grpo", ["rollout.env_workers=2", "rollout.tools=[grpolab.agents.builtin:calculator]"])


def test_env_workers_need_ray(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(C.ConfigError, match=r"rollout.env_workers=1 .* ray is not installed"):
        C.from_preset("grpo", ENV + ["rollout.env_workers=1"])


@pytest.mark.parametrize("override, named", [("rollout.env_workers=-1", "rollout.env_workers=-1"),
                                             ("rollout.env_timeout_s=0", "rollout.env_timeout_s=0"),
                                             ("rollout.env_worker_threads=0", "rollout.env_worker_threads=0")])
def test_env_worker_fields_are_range_checked(override, named):
    with pytest.raises(C.ConfigError, match=named):
        C.from_preset("grpo", ENV + [override])


def test_the_spec_carries_the_fields_and_zero_keeps_the_in_process_factory():
    cfg = C.from_preset("grpo", ENV + ["rollout.env_timeout_s=2.5", "rollout.env_worker_threads=4"])
    spec = AgentSpec.from_config(cfg)
    assert (spec.env_workers, spec.env_timeout_s, spec.env_worker_threads) == (0, 2.5, 4)
    with spec.build() as agent:
        assert isinstance(agent.make_environment, functools.partial)
    if importlib.util.find_spec("ray") is not None:
        spec = AgentSpec.from_config(C.from_preset("grpo", ENV + ["rollout.env_workers=3"]))
        with spec.build() as agent:  # no actor starts before the first episode
            pool = agent.make_environment
            assert (pool.size, pool.timeout_s, pool.actors) == (3, 60.0, [])
