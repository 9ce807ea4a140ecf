"""grpolab.agents.protocol: loading an environment by 'pkg.mod:Class', and checking what it returns."""

import math
import re

import pytest

from agents_fixtures import EchoEnv
from grpolab.agents.builtin import CalculatorTask, GuessNumber
from grpolab.agents.protocol import Environment, StepResult, as_step_result, check_messages, load_environment
from grpolab.errors import ConfigError


def test_load_environment_returns_a_factory_of_fresh_environments():
    make = load_environment("agents_fixtures:EchoEnv", {"turns": 3})
    a, b = make(), make()
    assert isinstance(a, EchoEnv) and a is not b and a.turns == 3
    assert isinstance(a, Environment)
    assert a.reset({"question": "q"}) == [{"role": "user", "content": "q"}]


def test_load_environment_builtin_by_spec():
    env = load_environment("grpolab.agents.builtin:GuessNumber", {"n": 10})()
    assert isinstance(env, GuessNumber) and env.n == 10


@pytest.mark.parametrize("spec, kwargs, message", [
    ("no_such_pkg_xyz.envs:Env", {}, "environment 'no_such_pkg_xyz.envs:Env': no module named 'no_such_pkg_xyz'"),
    ("agents_fixtures:Missing", {},
     "environment 'agents_fixtures:Missing': module 'agents_fixtures' has no attribute 'Missing'"),
    ("agents_fixtures:not_a_class", {}, "environment 'agents_fixtures:not_a_class': is a function, not a class"),
    ("agents_fixtures:NOT_CALLABLE", {}, "is a int, not a class"),
    ("agents_fixtures:NoStep", {}, "class NoStep has no method step"),
    ("agents_fixtures:EchoEnv", {"turnz": 2}, "environment 'agents_fixtures:EchoEnv': bad kwargs {'turnz': 2}"),
    ("agents_fixtures.EchoEnv", {}, "expected 'module:attr'"),
])
def test_load_environment_errors_name_the_spec(spec, kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_environment(spec, kwargs)


def test_load_environment_import_error_inside_the_module(tmp_path, monkeypatch):
    (tmp_path / "broken_env_mod.py").write_text("raise RuntimeError('bad import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'broken_env_mod:Env': importing module 'broken_env_mod' failed: "
                                          "RuntimeError: bad import"):
        load_environment("broken_env_mod:Env", {})


def test_builtin_environments_satisfy_the_protocol():
    assert isinstance(CalculatorTask(), Environment) and isinstance(GuessNumber(), Environment)


def test_as_step_result_accepts_a_good_step():
    res = as_step_result(([{"role": "user", "content": "x"}], 1, False), "Env")
    assert res == StepResult([{"role": "user", "content": "x"}], 1.0, False)
    assert isinstance(res.reward, float)
    assert as_step_result(([], None, True), "Env").reward is None


@pytest.mark.parametrize("value, message", [
    (([], None), r"Env.step must return \(messages, reward, done\)"),
    (("hi", None, True), "Env.step: expected a list of messages, got str"),
    (([{"role": "user"}], None, True), "Env.step: message 0 must be a dict"),
    (([], math.nan, True), "reward must be a finite number or None"),
    (([], True, True), "reward must be a finite number or None"),
    (([], 1.0, 1), "done must be a bool"),
])
def test_as_step_result_rejects_bad_steps(value, message):
    with pytest.raises(TypeError, match=message):
        as_step_result(value, "Env")


def test_check_messages_copies():
    msgs = [{"role": "user", "content": "a"}]
    out = check_messages(msgs, "x")
    assert out == msgs and out[0] is not msgs[0]
