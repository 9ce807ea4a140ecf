"""grpolab.agents.adapters.gymnasium: Gymnasium's FrozenLake-v1 (Discrete actions, "ansi" text
rendering) and a Text-action environment through GymnasiumEnv."""

from __future__ import annotations

import string
import sys

import pytest

gym = pytest.importorskip("gymnasium")

from grpolab.agents.adapters.gymnasium import GymnasiumEnv  # noqa: E402
from grpolab.agents.agent import AgentSpec  # noqa: E402
from grpolab.agents.protocol import as_step_result  # noqa: E402
from grpolab.config import from_preset  # noqa: E402
from grpolab.errors import ConfigError  # noqa: E402
from grpolab.models.tiny_chat import build_char_chat_tokenizer  # noqa: E402
from grpolab.sft.episodes import scripted_episodes  # noqa: E402

SPEC = "grpolab.agents.adapters.gymnasium:GymnasiumEnv"
LAKE = {"render_mode": "ansi", "is_slippery": False}
PATH = [1, 1, 2, 1, 2, 2]  # down, down, right, down, right, right: S to G on the 4x4 map, past the holes


def play(env, seed, actions):
    messages = env.reset({"seed": seed})
    results = []
    for action in actions:
        message = {"role": "assistant", "content": f"I move {action}"}
        result = as_step_result(env.step(message), "GymnasiumEnv")
        messages, results = messages + [message] + result.messages, results + [result]
        if result.done:
            break
    return messages, results


def library_run(seed, actions, **kwargs):
    """FrozenLake run directly: (reward, terminated, truncated) of each step."""
    env = gym.make("FrozenLake-v1", **kwargs)
    env.reset(seed=seed)
    return [env.step(a)[1:4] for a in actions]


def test_a_seed_always_opens_the_same_episode():
    slippery = {"render_mode": "ansi", "is_slippery": True}
    runs = [play(GymnasiumEnv("FrozenLake-v1", slippery), seed, [1] * 8)[0] for seed in (0, 0, 1, 2, 3, 4)]
    assert runs[0] == runs[1]
    assert len({str(r) for r in runs[1:]}) > 1  # the slippery lake moves otherwise for other seeds
    opening = runs[0][0]["content"]
    assert opening.startswith("Reply with an action: an integer from 0 to 3.") and "SFFF" in opening
    assert "Observation: 0" in opening and "\x1b" not in opening


def test_a_scripted_path_reaches_the_goal_with_the_library_reward():
    messages, results = play(GymnasiumEnv("FrozenLake-v1", LAKE), 5, PATH)
    expected = library_run(5, PATH, **LAKE)
    assert [(r.reward, r.done) for r in results] == [(float(rew), term or trunc) for rew, term, trunc in expected]
    assert results[-1].reward == 1.0 and results[-1].done
    assert messages[-1]["content"].endswith("Observation: 15") and "(Right)" in messages[-1]["content"]


def test_an_invalid_action_is_answered_with_the_action_space_and_not_played():
    env = GymnasiumEnv("FrozenLake-v1", LAKE, instructions="Reach G.")
    assert env.reset({"seed": 0})[0]["content"].startswith("Reach G.\n\n")
    for text in ("left", "7", "-1", "99999999999999999999"):
        reply, reward, done = env.step({"role": "assistant", "content": text})
        assert reply == [{"role": "user", "content": f"Invalid action {text!r}: the action space is Discrete(4)."}]
        assert reward is None and not done
    reply, reward, done = env.step({"role": "assistant", "content": "1"})
    assert reply[0]["content"].endswith("Observation: 4") and reward == 0.0 and not done  # the first real move


class WordEnv(gym.Env):
    """A Text-action environment: say the target word (reward 1.0), two tries."""

    def __init__(self):
        self.action_space = gym.spaces.Text(max_length=8)
        self.observation_space = gym.spaces.Text(max_length=40, charset=string.ascii_lowercase + " ")

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.target, self.tries = ["apple", "pear", "plum"][int(self.np_random.integers(3))], 0
        return f"say the word {self.target}", {}

    def step(self, action):
        self.tries += 1
        won = action == self.target
        return ("well done" if won else "no"), float(won), won or self.tries >= 2, False, {}


gym.register("grpolab-tests/Word-v0", entry_point=WordEnv)


def test_a_text_action_space_gets_the_message_text():
    env = GymnasiumEnv("grpolab-tests/Word-v0")
    opening = env.reset({"seed": 2})[0]["content"]
    assert opening == env.reset({"seed": 2})[0]["content"] and "Text(" in opening
    word = opening.rsplit(" ", 1)[1]
    reply, reward, done = env.step({"role": "assistant", "content": "two words"})  # " " is not in the charset
    assert "Invalid action 'two words'" in reply[0]["content"] and reward is None and not done
    assert env.step({"role": "assistant", "content": word}) == ([{"role": "user", "content": "well done"}], 1.0, True)


def test_episodes_through_the_driver_and_the_config():
    cfg = from_preset("grpo", [f"environment.name={SPEC}", "environment.kwargs={env_id: FrozenLake-v1, "
                               "env_kwargs: {render_mode: ansi, is_slippery: false}}", "rollout.max_turns=8"])
    spec = AgentSpec.from_config(cfg)
    spec = AgentSpec(spec.environment, spec.environment_kwargs, max_turns=8, max_episode_tokens=2000,
                     max_turn_tokens=20)

    def script(messages, item):
        return str(PATH[sum(m["role"] == "assistant" for m in messages)])

    with spec.build() as agent:
        (ep,) = scripted_episodes(build_char_chat_tokenizer(), agent, [{"seed": 1}], script)
    assert ep.done and ep.stop_reason == "done" and ep.turns == len(PATH) and ep.reward == 1.0


def test_unsupported_spaces_and_a_missing_library_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="neither Text nor Discrete"):
        GymnasiumEnv("Pendulum-v1")
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ConfigError, match=r"grpolab\[envs\]"):
        GymnasiumEnv("FrozenLake-v1")
