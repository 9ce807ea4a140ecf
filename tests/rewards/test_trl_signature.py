"""Rewards with TRL's signature, `fn(prompts, completions, completion_ids, **columns)`, beside grpolab's
`fn(prompts, completions, metadata)`: told apart once at build time, each data field a keyword list,
a bad signature or a missing column reported at start-up naming the reward (and never with advice to
set train.on_reward_error), and the verifier flag declared in code or in YAML."""

import itertools
import json
import textwrap

import pytest

from grpolab import config as C
from grpolab.errors import ConfigError
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup
from grpolab.rewards.base import RewardSetupError, probe_reward
from grpolab.rewards.registry import build_reward, build_rewards
from grpolab.rewards.signature import KEYWORD, POSITIONAL, KeywordReward, reward_style

USER_MODULE = '''
seen = []

def exact_match(completions, answer, **kw):  # the issue's TRL reward, as written for TRL
    seen.append({"answer": answer, **kw})
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]
exact_match.verifier = True

def by_name(prompts, completions, kind=None):  # no **kwargs: only the keywords it names
    return [1.0 if k == "word" else 0.0 for k in kind]

def lengths(completions, completion_ids, **kw):
    seen.append({"ids": completion_ids, "tokens": kw.get("completion_tokens")})
    return [float(len(i)) for i in completion_ids]

def needs_solution(completions, solution, **kw):
    return [0.0] * len(completions)

def positional_only(a, b, /):
    return [0.0]
'''

_counter = itertools.count()


@pytest.fixture
def mod(tmp_path, monkeypatch):
    name = f"t_trl_rewards_{next(_counter)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_the_style_is_read_from_the_signature():
    def grpo3(p, c, m): ...
    def meta_kw(prompts, completions, metadata=None, **kw): ...
    def trl(completions, **kwargs): ...
    def kwonly(prompts, completions, *, answer): ...
    def named(completions, answer): ...
    def ids(prompts, completions, completion_ids): ...

    def wrapper(*args, **kwargs): ...

    class Callable3:
        def __call__(self, prompts, completions, metas): ...

    assert [reward_style(f, "r") for f in (grpo3, meta_kw, Callable3(), wrapper)] == [POSITIONAL] * 4
    assert [reward_style(f, "r") for f in (trl, kwonly, named, ids)] == [KEYWORD] * 4

    def bad(a, b, /): ...
    with pytest.raises(ConfigError, match=r"reward 'mine' has the signature \(a, b, /\), which fits neither"):
        reward_style(bad, "mine")


def test_a_trl_reward_gets_each_column_as_a_keyword_list(mod):
    fn = build_reward(f"{mod}:exact_match")
    assert isinstance(fn, KeywordReward) and fn.verifier is True  # declared in code
    rows = [{"answer": "ab", "kind": "word"}, {"answer": 7}]
    assert fn(["p1", "p2"], ["ab", "8"], rows) == [1.0, 0.0]
    seen = __import__(mod).seen[-1]
    assert seen == {"answer": ["ab", 7], "prompts": ["p1", "p2"], "kind": ["word", None]}
    by_name = build_reward(f"{mod}:by_name")  # only the keywords it names: no TypeError on `answer`
    assert by_name(["p", "p"], ["x", "y"], rows) == [1.0, 0.0]
    assert not isinstance(build_reward("exact_match"), KeywordReward)  # built-ins stay positional


def test_a_missing_column_is_found_by_the_probe_and_names_the_reward(mod):
    fn = build_reward(f"{mod}:needs_solution")
    with pytest.raises(RewardSetupError) as e:
        probe_reward(fn, ["p"], [{"answer": "1"}])
    msg = str(e.value)
    assert f"reward '{mod}:needs_solution' takes solution" in msg and "fields: answer" in msg
    assert "on_reward_error" not in msg


def test_a_bad_signature_is_a_config_error_naming_the_reward(mod):
    with pytest.raises(ConfigError, match=f"rewards: reward '{mod}:positional_only' has the signature"):
        build_reward(f"{mod}:positional_only")


def test_the_verifier_flag_from_yaml(mod, tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(f"preset: grpo\nrewards:\n  - {{name: '{mod}:by_name', weight: 0, verifier: true}}\n"
                 f"  - {{name: '{mod}:exact_match', verifier: false}}\n  - {{name: refusal}}\n")
    flags = [fn.verifier for fn, _w in build_rewards(C.load(str(p)))]
    assert flags == [True, False, False]


TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "rollout.max_new_tokens=4", "train.steps=1", "train.minibatch_size=4",
        "train.microbatch_size=4", "run.progress=false", "run.tensorboard=false"]


def _data(tmp_path):
    p = tmp_path / "words.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"w{i}", "answer": f"{i}", "kind": "word"}) + "\n" for i in range(8)))
    return f"data.source=jsonl:{p}"


def test_a_missing_column_stops_the_run_at_start_up_whatever_on_reward_error(mod, tmp_path):
    cfg = C.from_preset("grpo", TINY + [_data(tmp_path), f"rewards=[{mod}:needs_solution]",
                                        "train.on_reward_error=zero"])
    with pytest.raises(RewardSetupError, match="takes solution.*found at start-up"):
        build_setup(cfg)


def test_a_trl_reward_trains_and_gets_the_sampled_ids(mod, tmp_path):
    cfg = C.from_preset("grpo", TINY + [_data(tmp_path), f"rewards=[{mod}:lengths, {mod}:exact_match]"])
    assert train_in_run_dir(build_setup(cfg), tmp_path / "run") == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row[f"reward/{mod}:lengths/mean"] > 0  # completion lengths in tokens, from the ids
    calls = [s for s in __import__(mod).seen if "ids" in s and s["ids"] and s["ids"][0]]
    assert calls and all(len(i) == t for c in calls for i, t in zip(c["ids"], c["tokens"]))
    assert all(isinstance(x, int) for c in calls for i in c["ids"] for x in i)
