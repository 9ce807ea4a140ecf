"""The reward registry: built-in names and their verifier flags, register_reward, and rewards loaded
from user code as 'module:attr' (a module written into tmp_path and put on sys.path)."""

import itertools
import sys
import textwrap

import pytest

from grpolab import config as C
from grpolab.errors import ConfigError
from grpolab.rewards import base, registry
from grpolab.rewards.registry import FunctionReward, build_reward, is_verifier, register_reward, reward_names

BUILTIN_VERIFIERS = {"exact_match": True, "refusal": False, "format": False, "answer_format": False,
                     "reasoning_gym": True, "math_verify": True, "code_tests": True, "reward_model": False,
                     "reward_model_ensemble": False, "self_likelihood": False, "overlong": False,
                     "tool_use": False}

USER_MODULE = '''
calls = []

def length_penalty(prompts, completions, metadata):
    """Shorter is better."""
    return [-len(c) / 10 for c in completions]

def exact(prompts, completions, metadata):
    return [1.0] * len(completions)
exact.verifier = True

def make_threshold(limit):
    def fn(prompts, completions, metadata):
        return [float(len(c) <= limit) for c in completions]
    return fn

def make_nothing(limit):
    return 42

class Contains:
    name = "contains"
    verifier = True

    def __init__(self, needle="x"):
        self.needle = needle

    def __call__(self, prompts, completions, metadata):
        return [float(self.needle in c) for c in completions]

NOT_CALLABLE = 3
'''


_counter = itertools.count()


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A fresh module name per test (imports are cached by name)."""
    name = f"t_user_rewards_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_builtin_names_and_verifier_flags():
    assert set(BUILTIN_VERIFIERS) == set(registry.builtin_rewards())
    assert set(BUILTIN_VERIFIERS) <= set(reward_names())
    for name in ("exact_match", "refusal", "format", "answer_format"):
        fn = build_reward(name)
        assert fn.name == name and fn.verifier is BUILTIN_VERIFIERS[name] and is_verifier(fn) is BUILTIN_VERIFIERS[name]
    for name, flag in BUILTIN_VERIFIERS.items():  # without building (optional packages, model files)
        assert registry.builtin_rewards()[name].factory.verifier is flag


def test_base_reexports_the_registry():
    assert base.build_reward is build_reward and base.register_reward is register_reward
    assert base.reward_names is reward_names
    assert not hasattr(base, "WeightedReward")


def test_the_verifier_kwarg_overrides_and_is_not_passed_on():
    assert build_reward("refusal", verifier=True).verifier is True
    assert build_reward("exact_match", verifier=False).verifier is False
    assert build_reward("format", refusal="no", verifier=True).refusal == "no"
    with pytest.raises(ConfigError, match="kwargs.verifier must be true or false"):
        build_reward("exact_match", verifier="yes")


def test_register_reward_stores_the_flag():
    name = f"t_registered_{next(_counter)}"
    register_reward(name, verifier=True)(lambda: lambda p, c, m: [1.0] * len(c))
    fn = build_reward(name)
    assert name in reward_names() and fn.name == name and fn.verifier is True
    assert isinstance(fn, FunctionReward) and fn(["p"], ["c"], [{}]) == [1.0]
    assert registry.registered_rewards()[name].verifier is True
    with pytest.raises(ValueError, match="registered twice"):
        register_reward(name)(lambda: None)
    with pytest.raises(ValueError, match="registered twice"):
        register_reward("exact_match")(lambda: None)
    with pytest.raises(ValueError, match="reserved for 'module:attr'"):
        register_reward("a:b")


def test_unknown_name_suggests_and_mentions_module_attr():
    with pytest.raises(ConfigError, match=r"'exact_macth'\. Did you mean 'exact_match'\?.*'module:attr'"):
        build_reward("exact_macth")


def test_a_plain_function_is_the_reward_itself(user_module):
    fn = build_reward(f"{user_module}:length_penalty")
    assert isinstance(fn, FunctionReward) and fn.name == f"{user_module}:length_penalty" and fn.verifier is False
    assert fn(["p", "p"], ["ab", "abcd"], [{}, {}]) == [-0.2, -0.4]
    # its own `verifier` attribute counts; the YAML kwarg overrides it
    assert build_reward(f"{user_module}:exact").verifier is True
    assert build_reward(f"{user_module}:exact", verifier=False).verifier is False
    assert build_reward(f"{user_module}:length_penalty", verifier=True).verifier is True


def test_two_entries_of_one_function_do_not_share_attributes(user_module):
    a, b = build_reward(f"{user_module}:length_penalty"), build_reward(f"{user_module}:length_penalty")
    a.name, b.name = "short", "shorter"
    a.timeout_s = 3
    assert (a.name, b.name) == ("short", "shorter") and not hasattr(b, "timeout_s")
    assert a.fn is b.fn and not hasattr(a.fn, "name")


def test_a_function_with_kwargs_is_a_factory(user_module):
    fn = build_reward(f"{user_module}:make_threshold", limit=2)
    assert fn(["p", "p"], ["ab", "abc"], [{}, {}]) == [1.0, 0.0]
    assert isinstance(fn, FunctionReward) and fn.name == f"{user_module}:make_threshold"
    with pytest.raises(ConfigError, match=f"reward '{user_module}:make_nothing'.*returned int, not a callable"):
        build_reward(f"{user_module}:make_nothing", limit=1)
    with pytest.raises(ConfigError, match=f"reward '{user_module}:make_threshold' got bad arguments"):
        build_reward(f"{user_module}:make_threshold", nope=1)


def test_a_class_is_a_factory_with_or_without_kwargs(user_module):
    fn = build_reward(f"{user_module}:Contains", needle="z")
    assert fn.needle == "z" and fn.name == "contains" and fn.verifier is True
    assert fn(["p", "p"], ["az", "b"], [{}, {}]) == [1.0, 0.0]
    assert build_reward(f"{user_module}:Contains").needle == "x"


def test_module_attr_errors_name_the_entry(user_module, tmp_path):
    with pytest.raises(ConfigError, match=r"reward 'no_such_mod_xyz:f': no module named 'no_such_mod_xyz'"):
        build_reward("no_such_mod_xyz:f")
    with pytest.raises(ConfigError, match=f"reward '{user_module}:missing': module '{user_module}' has no attribute"):
        build_reward(f"{user_module}:missing")
    with pytest.raises(ConfigError, match=f"reward '{user_module}:NOT_CALLABLE'.*is a int, not a callable"):
        build_reward(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="expected 'module:attr'"):
        build_reward(f"{user_module}:")
    # a real ImportError inside the user's module is reported as such, not as a missing module
    (tmp_path / "t_broken_rewards.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match="importing module 't_broken_rewards' failed.*no_such_dependency_xyz") as e:
        build_reward("t_broken_rewards:f")
    assert isinstance(e.value.__cause__, ImportError)
    (tmp_path / "t_raising_rewards.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="importing module 't_raising_rewards' failed: RuntimeError: boom"):
        build_reward("t_raising_rewards:f")


def test_yaml_module_attr_entries(user_module, tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(f'rewards:\n  - {{name: "{user_module}:length_penalty", weight: 0.5}}\n'
                 f'  - {{name: "{user_module}:Contains", kwargs: {{needle: q, verifier: false}}, label: has_q}}\n')
    cfg = C.load(str(p))
    assert [(r.name, r.weight, r.display_name) for r in cfg.rewards] == [
        (f"{user_module}:length_penalty", 0.5, f"{user_module}:length_penalty"), (f"{user_module}:Contains", 1.0, "has_q")]
    fns = [build_reward(s.name, **s.kwargs) for s in cfg.rewards]
    assert fns[1].needle == "q" and fns[1].verifier is False and cfg.rewards[1].kwargs == {"needle": "q", "verifier": False}
    # the "name:weight" shorthand keeps the module path
    short = C.from_preset("grpo", [f"rewards=[{user_module}:length_penalty:0.25, {user_module}:exact, exact_match:2]"])
    assert [(r.name, r.weight) for r in short.rewards] == [
        (f"{user_module}:length_penalty", 0.25), (f"{user_module}:exact", 1.0), ("exact_match", 2.0)]


def test_a_module_in_the_working_directory_imports_without_it_on_sys_path(tmp_path, monkeypatch):
    """A `grpolab` console script starts without the working directory on sys.path; a config's own
    reward module lying there still imports."""
    (tmp_path / "cwd_rewards_mod.py").write_text(
        "def brevity(prompts, completions, metadata):\n    return [1.0 / (1 + len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_rewards_mod", raising=False)
    fn = build_reward("cwd_rewards_mod:brevity")
    assert fn([""], ["abc"], [{}]) == [0.25]
