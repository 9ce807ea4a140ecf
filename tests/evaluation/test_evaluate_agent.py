"""grpolab.evaluation.episodes: an agent's held-out metrics, counted on forced (scripted) episodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpolab.agents.agent import AgentSpec
from grpolab.agents.builtin import CalculatorTask
from grpolab.agents.episode import Episode
from grpolab.data.arith import PromptItem
from grpolab.evaluation.episodes import episode_metrics, evaluate_agent, run_agent_episodes
from grpolab.models.tiny import build_tiny_model
from grpolab.models.tiny_chat import TOOLS_TEMPLATE, build_char_chat_tokenizer
from grpolab.rewards.registry import register_reward
from grpolab.rollout.hf import HFEngine


@pytest.fixture(scope="module")
def tok():
    return build_char_chat_tokenizer(TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, max_positions=2048, seed=0).eval()


class Force:
    """Forces each episode's scripted turns (text, then <|im_end|>), one id per call; episode index -> turns."""

    def __init__(self, tok, scripts):
        eos = tok.eos_token_id
        self.queue = {i: [x for turn in turns for x in tok.encode(turn, add_special_tokens=False) + [eos]]
                      for i, turns in scripts.items()}

    def __call__(self, rows, logits):
        out = torch.full_like(logits, float("-inf"))
        for r, i in enumerate(rows):
            out[r, self.queue[i].pop(0)] = 0.0
        return out


def _call(name, key, value):
    return f'<tool_call>{{"name": "{name}", "arguments": {{"{key}": "{value}"}}}}</tool_call>'


def test_calculator_counts(tok, model):
    items = [{"seed": s} for s in range(6)]
    ops = []
    for it in items:
        env = CalculatorTask(digits=3)
        env.reset(it)
        ops.append(env.operands)
    good = [_call("calculator", "expression", f"{a} * {b}") for a, b in ops]
    product = [str(a * b) for a, b in ops]
    scripts = {
        0: [good[0], product[0]],                                   # solved in 2 turns, 1 good call
        1: ["42"],                                                  # a wrong answer at once
        2: ['<tool_call>{"name": "calc"}</tool_call>', "1"],        # malformed call, wrong answer
        3: [_call("calc", "expression", "1"), product[3]],          # unknown tool, then the right answer
        4: [good[4], _call("calculator", "expr", "1"), product[4]],  # good call, bad arguments, solved in 3
        5: ["x" * 200],                                             # cut by max_turn_tokens
    }
    spec = AgentSpec(environment="grpolab.agents.builtin:CalculatorTask", environment_kwargs={"digits": 3},
                     tools=("grpolab.agents.builtin:calculator",), max_turns=3, max_episode_tokens=1024,
                     max_turn_tokens=120)
    engine = HFEngine(tok, max_new_tokens=8)
    with spec.build() as agent:  # batch_items=4: two generate_episodes calls, episode indices continue
        m = evaluate_agent(engine, agent, items, model=model, batch_items=4, logits_processor=Force(tok, scripts))
    assert m["episodes"] == 6
    assert m["solved"] == m["accuracy"] == m["reward/mean"] == 0.5
    assert m["turns/mean"] == pytest.approx(11 / 6) and m["turns_to_solve/mean"] == pytest.approx(7 / 3)
    assert (m["tool_calls/count"], m["tool_calls/mean"], m["tool_use/frac"]) == (5, 5 / 6, 4 / 6)
    assert m["tool_calls/well_formed"] == pytest.approx(2 / 5)
    assert (m["tool_errors/malformed"], m["tool_errors/unknown_tool"], m["tool_errors/bad_arguments"]) == (1, 1, 1)
    assert m["truncated/frac"] == pytest.approx(1 / 6) and m["env_error/frac"] == 0.0


def test_guess_number_sampled_groups(tok, model):
    spec = AgentSpec(environment="grpolab.agents.builtin:GuessNumber", environment_kwargs={"n": 10, "max_turns": 4},
                     max_turns=4, max_episode_tokens=1024, max_turn_tokens=4)
    scripts = {0: ["5", "2", "3"], 1: ["3"], 2: ["1", "2", "4", "5"], 3: ["8"]}
    engine = HFEngine(tok, max_new_tokens=8, temperature=1.0)
    with spec.build() as agent:
        episodes = run_agent_episodes(engine, agent, [{"secret": 3}, {"secret": 8}], model=model, greedy=False,
                                      seed=3, samples_per_item=2, logits_processor=Force(tok, scripts))
    assert [e.turns for e in episodes] == [3, 1, 4, 1] and [e.reward for e in episodes] == [1.0, 1.0, 0.0, 1.0]
    m = episode_metrics(episodes)
    assert (m["solved"], m["turns/mean"], m["turns_to_solve/mean"]) == (0.75, 2.25, 5 / 3)
    assert (m["tool_calls/count"], m["tool_calls/well_formed"], m["truncated/frac"]) == (0, 1.0, 0.0)
    assert not any(k.startswith("tool_errors/") for k in m)


def test_episodes_without_a_reward_count_as_zero_and_nothing_solved_gives_none():
    cut = Episode([1, 2], turns=2).finish("max_turns", truncated=True)
    failed = Episode([1, 2], turns=1, rewards=[(0, 0.0)]).finish("done", truncated=False)
    m = episode_metrics([cut, failed])
    assert (m["reward/mean"], m["solved"], m["turns_to_solve/mean"], m["truncated/frac"]) == (0.0, 0.0, None, 0.5)
    with pytest.raises(ValueError):
        episode_metrics([])


@register_reward("test_eval_says_answer", verifier=True)
def _says_answer():
    """1.0 when the last reply is the item's answer."""
    return lambda prompts, completions, metadata: [float(c == m["answer"]) for c, m in zip(completions, metadata)]


def _tool_episode(answer: str, calls: int = 0, errors: int = 0, turns: int = 1) -> Episode:
    e = Episode([1, 2], messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}],
                turns=turns, tool_calls=calls)
    if errors:
        e.tool_errors["raised"] = errors
    return e.finish("done", truncated=False)


def test_tools_only_episodes_are_scored_by_the_config_rewards(monkeypatch):
    """Without an environment, held-out episodes are scored as training scores them: each reward's mean,
    the weighted sum, `solved` from the verifier, and one completions record per item with its samples."""
    import grpolab.evaluation.episodes as ev
    from grpolab import config as C
    from grpolab.evaluation.evaluate import evaluate_episodes

    greedy_eps = [_tool_episode("7", calls=1, turns=2), _tool_episode("5"),
                  _tool_episode("9", calls=2, errors=1, turns=3)]
    sampled_eps = [_tool_episode(a, calls=c) for a, c in (("7", 0), ("1", 1), ("5", 1), ("5", 0), ("0", 0), ("9", 1))]
    monkeypatch.setattr(ev, "run_agent_episodes", lambda *a, greedy=True, **k: greedy_eps if greedy else sampled_eps)
    overlong = "{name: overlong, weight: 0.0, kwargs: {buffer_len: 4}}"  # reads rollout.max_new_tokens
    cfg = C.from_preset("grpo", ["rollout.tools=[grpolab.agents.builtin:calculator]",
                                 f"rewards=[test_eval_says_answer:1.0, tool_use:0.5, {overlong}]"])
    items = [PromptItem(f"q{i}", {"answer": a}) for i, a in enumerate(("7", "6", "9"))]
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=str))
    res = evaluate_episodes(None, engine, items, cfg, samples=2)
    g, s = res["greedy"], res["sampled"]
    assert "reward/mean" not in g  # no environment
    assert g["reward/test_eval_says_answer"] == pytest.approx(2 / 3) and g["reward/tool_use"] == pytest.approx(0.5)
    assert g["reward"] == pytest.approx((1.5 + 0.0 + 1.25) / 3)
    assert g["solved"] == pytest.approx(2 / 3) and g["accuracy"] == pytest.approx(2 / 3)
    assert g["turns_to_solve/mean"] == pytest.approx(2.5)
    assert s["samples"] == 2 and s["solved"] == pytest.approx(2 / 6) and s["reward/tool_use"] == pytest.approx(0.5)
    recs = res["completions"]
    assert [r["completion"] for r in recs] == ["7", "5", "9"] and [r["meta"]["answer"] for r in recs] == ["7", "6", "9"]
    assert recs[2]["scores"] == {"test_eval_says_answer": 1.0, "tool_use": 0.5, "overlong": 0.0}
    assert recs[2]["reward"] == 1.25
    assert recs[2]["tool_errors"] == {"raised": 1} and recs[0]["messages"][-1]["content"] == "7"
    assert [r["correct"] for r in recs] == [1.0, 0.0, 1.0]
    assert [[x["completion"] for x in r["samples"]] for r in recs] == [["7", "1"], ["5", "5"], ["0", "9"]]


def test_held_out_episodes_with_an_environment_score_its_reward_beside_the_functions(monkeypatch):
    """With an environment its reward is reward/environment (× environment.reward_weight in `reward`) and
    `solved` stays the environment's; without an environment or a verifier nothing says solved."""
    import grpolab.evaluation.episodes as ev
    from grpolab import config as C
    from grpolab.evaluation.evaluate import evaluate_episodes

    episodes = [_tool_episode("3", calls=1, turns=2), _tool_episode("5", turns=3)]
    episodes[0].rewards.append((1, 1.0))
    episodes[1].rewards.append((2, 0.0))
    monkeypatch.setattr(ev, "run_agent_episodes", lambda *a, **k: episodes)
    engine = SimpleNamespace(tokenizer=SimpleNamespace(decode=str))
    items = [PromptItem("q0", {"secret": 3}), PromptItem("q1", {"secret": 4})]
    cfg = C.from_preset("grpo", ["environment.name=grpolab.agents.builtin:GuessNumber", "environment.reward_weight=2.0",
                                 "rewards=[tool_use:0.5]"])
    g = evaluate_episodes(None, engine, items, cfg)["greedy"]
    assert "reward/mean" not in g and g["reward/environment"] == 0.5 and g["reward/tool_use"] == 0.5
    assert g["reward"] == pytest.approx((2.0 + 0.5 + 0.0) / 2) and g["solved"] == 0.5 and g["turns_to_solve/mean"] == 2
    no_verifier = cfg.replace(**{"environment.name": "", "rollout.tools": ["grpolab.agents.builtin:calculator"]})
    g = evaluate_episodes(None, engine, items, no_verifier)["greedy"]
    assert g["reward"] == 0.25 and not {"solved", "accuracy", "turns_to_solve/mean"} & set(g)
