"""grpolab.agents.adapters.textarena: TextArena's GuessTheNumber-v0 (offline) through TextArenaEnv."""

from __future__ import annotations

import random
import re
import sys

import pytest

ta = pytest.importorskip("textarena")

from grpolab.agents.adapters.textarena import TextArenaEnv  # noqa: E402
from grpolab.agents.agent import AgentSpec  # noqa: E402
from grpolab.agents.protocol import as_step_result, load_environment  # noqa: E402
from grpolab.config import from_preset  # noqa: E402
from grpolab.errors import ConfigError  # noqa: E402
from grpolab.models.tiny_chat import build_char_chat_tokenizer  # noqa: E402
from grpolab.sft.episodes import scripted_episodes  # noqa: E402

SPEC = "grpolab.agents.adapters.textarena:TextArenaEnv"
GAME = "GuessTheNumber-v0"  # 1..20, TextArena's hints "higher" / "lower"


def bisect(messages, item=None) -> str:
    """A scripted player: halves the range that the game's hints so far leave, guess in "[n]" form."""
    lo, hi, guess = 1, 20, None
    for m in messages:
        if m["role"] == "assistant":
            guess = int(re.search(r"\[(\d+)\]", m["content"]).group(1))
        elif guess is not None and "higher" in m["content"]:
            lo = guess + 1
        elif guess is not None and "lower" in m["content"]:
            hi = guess - 1
    return f"My guess: [{(lo + hi) // 2}]"


def play(env, seed, max_steps=10):
    """The transcript and step results of `bisect` playing env from `seed`."""
    messages = env.reset({"seed": seed})
    results = []
    for _ in range(max_steps):
        action = {"role": "assistant", "content": bisect(messages)}
        result = as_step_result(env.step(action), "TextArenaEnv")
        messages = messages + [action] + result.messages
        results.append(result)
        if result.done:
            break
    return messages, results


def library_game(seed, actions, max_turns=10):
    """TextArena run directly, as its users do (its "-raw" id: the game's own observation list): the
    observations after the actions, and (rewards, game info) when the game ended."""
    env = ta.make(GAME + "-raw", max_turns=max_turns)
    env.reset(num_players=1, seed=seed)
    for action in actions:
        done, _ = env.step(action)
        if done:
            return env.get_observation(), env.close()
    return env.get_observation(), None


def test_a_seed_always_opens_the_same_game():
    first, second = play(TextArenaEnv(GAME), seed=7), play(TextArenaEnv(GAME), seed=7)
    assert first == second
    assert first[0][0]["role"] == "user" and "Guess The Number" in first[0][0]["content"]
    openings = {tuple(r.messages[0]["content"] for r in play(TextArenaEnv(GAME), seed)[1]) for seed in range(6)}
    assert len(openings) > 1  # other seeds, other secrets


def test_a_solved_game_ends_with_the_library_reward_and_reason():
    messages, results = play(TextArenaEnv(GAME), seed=7)
    assert [r.done for r in results] == [False] * (len(results) - 1) + [True]
    assert all(r.reward is None for r in results[:-1]) and results[-1].reward == 1.0
    assert "Congratulations" in messages[-1]["content"]
    actions = [m["content"] for m in messages if m["role"] == "assistant"]
    _, (rewards, info) = library_game(7, actions)
    assert rewards == {0: 1} and info[0]["reason"] in messages[-1]["content"]


def test_the_turn_limit_gives_the_library_partial_reward():
    env = TextArenaEnv(GAME, env_kwargs={"max_turns": 2})
    messages, results = play(env, seed=7)
    assert results[-1].done and len(results) == 3  # TextArena checks the limit before counting the turn
    actions = [m["content"] for m in messages if m["role"] == "assistant"]
    _, (rewards, info) = library_game(7, actions, max_turns=2)
    assert results[-1].reward == pytest.approx(rewards[0]) and 0.0 < rewards[0] < 1.0
    assert info[0]["reason"] in messages[-1]["content"] and "turn limit" in messages[-1]["content"]


def test_an_invalid_move_reaches_the_model_as_the_library_message():
    env = TextArenaEnv(GAME)
    env.reset({"seed": 3})
    reply, reward, done = env.step({"role": "assistant", "content": "no brackets here"})
    (_, observations), _ = library_game(3, ["no brackets here"])
    notice = [text for _, text, kind in observations if kind == ta.ObservationType.GAME_ADMIN]
    assert reward is None and not done and reply == [{"role": "user", "content": notice[0]}]
    assert "invalid move" in notice[0]
    # a second invalid move in a row ends the game, with the library's reason and reward
    reply, reward, done = env.step({"role": "assistant", "content": "[99]"})
    _, (rewards, info) = library_game(3, ["no brackets here", "[99]"])
    assert done and reward == rewards[0] and info[0]["reason"] in reply[-1]["content"]
    with pytest.raises(RuntimeError, match="step after the game ended"):
        env.step({"role": "assistant", "content": "[5]"})


def test_the_global_random_state_is_left_alone():
    random.seed(123)
    expected = [random.random() for _ in range(3)]
    random.seed(123)
    play(TextArenaEnv(GAME), seed=7)
    assert [random.random() for _ in range(3)] == expected


def test_episodes_through_the_driver_and_the_config():
    cfg = from_preset("grpo", [f"environment.name={SPEC}", f"environment.kwargs={{env_id: {GAME}}}",
                               "rollout.max_turns=8"])
    spec = AgentSpec.from_config(cfg)
    spec = AgentSpec(spec.environment, spec.environment_kwargs, max_turns=8, max_episode_tokens=4000,
                     max_turn_tokens=40)
    with spec.build() as agent:
        episodes = scripted_episodes(build_char_chat_tokenizer(), agent, [{"seed": 7}, {"seed": 8}], bisect)
    for ep, seed in zip(episodes, (7, 8)):
        assert ep.done and ep.stop_reason == "done" and ep.reward == 1.0
        assert ep.messages[:-1] == play(TextArenaEnv(GAME), seed)[0][:len(ep.messages) - 1]


def test_bad_kwargs_and_a_missing_library_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="bad kwargs"):
        load_environment(SPEC, {"game": GAME})
    monkeypatch.setitem(sys.modules, "textarena", None)
    with pytest.raises(ConfigError, match=r"grpolab\[envs\]"):
        TextArenaEnv(GAME)
