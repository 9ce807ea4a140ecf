"""GRPO on agent episodes: Phase A samples multi-turn episodes, Phase B trains the policy's tokens only."""

from __future__ import annotations

import math

import pytest
import torch

from grpolab import config as C
from grpolab.agents.agent import Agent, AgentSpec
from grpolab.data.arith import ArithTask
from grpolab.data.stream import ArithStream
from grpolab.grpo import loop as grpo
from grpolab.grpo.setup import build_setup
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.models.tiny_chat import TOOLS_TEMPLATE, build_char_chat_tokenizer
from grpolab.rewards.base import RewardError

GUESS = "grpolab.agents.builtin:GuessNumber"
TIMING = ("time/", "tokens_per_s/", "mfu")


def _cfg(*ov):
    base = ["environment.name=" + GUESS, "environment.kwargs={n: 9, max_turns: 3}", "data.source=builtin:seeds",
            "rewards=[]", "rollout.max_turns=3", "rollout.max_new_tokens=3", "rollout.max_episode_tokens=400",
            "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.temperature=1.5",
            "train.steps=2", "train.minibatch_size=8", "train.microbatch_size=8", "train.epochs=2",
            "train.lr=1e-3", "run.tensorboard=false", "run.progress=false",
            "model.dtype=float32"]  # exactness and invariance are float32 checks
    return C.from_preset("grpo", base + list(ov))


def _digits_model(seed=0):
    """A tiny chat model biased to answer with a digit and end its turn soon, so that episodes run
    several turns (and end at different turns: some guesses are right)."""
    tok = build_char_chat_tokenizer(TOOLS_TEMPLATE)
    model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, max_positions=2048, seed=seed)
    with torch.no_grad():
        bias = torch.full((len(tok),), -4.0)
        bias[[tok.convert_tokens_to_ids(str(d)) for d in range(1, 10)]] = 2.0
        bias[tok.eos_token_id] = 3.0
        head = torch.nn.Linear(32, len(tok), bias=True)
        head.weight = model.get_input_embeddings().weight
        head.bias.copy_(bias)
        model.lm_head = head
    return model, tok


def _setup(cfg, seed=0):
    model, tok = _digits_model(seed)
    return build_setup(cfg, policy=model, tokenizer=tok)


def test_episodes_train_and_report_their_metrics():
    s = _setup(_cfg("loss.entropy_coef=0.01"))  # a gradient even when every group's rewards are equal
    before = {k: v.clone() for k, v in s.models.policy.state_dict().items()}
    rows = grpo.train(s)
    s.close()
    assert len(rows) == 2
    r = rows[-1]
    assert 1.0 <= r["episode/turns"] <= 3.0 and r["episode/env_tokens"] > 0
    assert r["episode/policy_tokens"] == pytest.approx(r["len/mean"])  # lengths count the policy's tokens only
    assert 0.0 <= r["episode/solved"] <= 1.0 and "reward/environment/mean" in r and "accuracy" in r
    assert r["mismatch/max"] < 1e-4  # the trainer's log-probs over whole episodes are the sampler's
    assert any(not torch.equal(before[k], v) for k, v in s.models.policy.state_dict().items())


def _logit_grads(s):
    """One Phase A on s, then one microbatch's loss backward; returns (rollout, d loss / d logits [N, T, V])."""
    from grpolab.grpo.dynamic_sampling import draw_batch
    from grpolab.grpo.stats import StepStats

    st = StepStats(0)
    s.seed_step(0)
    with torch.no_grad():
        batch = draw_batch(s, st)
        ro = grpo.record_logprobs(s, batch.rollout)  # log π_ref: the KL term is in the loss too
    adv = torch.linspace(-1, 1, ro.num_sequences)
    ro = ro.replace(advantages=adv, rewards=batch.rewards)
    captured = {}
    head = s.models.policy.lm_head

    def keep(_module, _inp, out):
        out.retain_grad()
        captured["logits"] = out
    handle = head.register_forward_hook(keep)
    try:
        loss, _ = s.optim.objective(s.models.train_model, ro, s.optim.objective.normalizer(ro.loss_mask))
        loss.backward()
    finally:
        handle.remove()
    return ro, captured["logits"].grad


def test_environment_tokens_get_exactly_zero_gradient():
    s = _setup(_cfg("train.steps=1", "model.padding_free=false", "model.shared_prompt=false"))
    ro, grad = _logit_grads(s)
    s.close()
    body_real = ro.attention_mask[:, ro.prompt_len:]
    env = body_real & ~ro.loss_mask  # environment / tool tokens of the episodes
    assert env.any() and ro.loss_mask.any()
    assert grad.shape[:2] == env.shape  # the forward keeps the logits that predict body tokens: [N, Lb, V]
    assert torch.count_nonzero(grad[env]) == 0
    assert torch.count_nonzero(grad[ro.loss_mask].abs().sum(-1)) == int(ro.loss_mask.sum())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"])
def test_microbatch_size_does_not_change_the_update_with_episodes(agg):
    """Episodes of different turn counts: one GRPO step with microbatch 1 and with the whole minibatch
    give the same weights, for every aggregation mode."""
    results, turns = [], None
    for micro in (16, 1):
        cfg = _cfg(f"train.microbatch_size={micro}", "train.minibatch_size=16", "train.epochs=1", "train.steps=1",
                   f"loss.loss_agg={agg}", "loss.kl_coef=0.04", "train.max_grad_norm=0")
        s = _setup(cfg)
        s.models.policy.double()  # fp64: the sums differ only by float rounding of the accumulation order
        if s.models.reference is not None:
            s.models.reference().__enter__().double()
        rows = grpo.train(s)
        s.close()
        turns = turns or rows[0]["episode/turns"]
        results.append({k: v.clone() for k, v in s.models.policy.state_dict().items()})
    assert 1.0 < turns < 3.0  # the episodes ended at different turns
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k])


class Flaky:
    """GuessNumber whose step raises for odd seeds."""

    def __init__(self):
        from grpolab.agents.builtin import GuessNumber

        self.game = GuessNumber(n=9, max_turns=3)

    def reset(self, item):
        self.breaks = item["seed"] % 2 == 1
        return self.game.reset(item)

    def step(self, message):
        if self.breaks:
            raise KeyError("no such room")
        return self.game.step(message)


def test_an_environment_error_follows_on_reward_error():
    spec = "test_grpo_episodes:Flaky"
    with pytest.raises(RewardError, match=r"environment: Flaky raised KeyError: 'no such room' \(item \{'seed'"):
        s = _setup(_cfg(f"environment.name={spec}", "environment.kwargs={}", "train.steps=1"))
        try:
            grpo.train(s)
        finally:
            s.close()
    for mode in ("zero", "skip_group"):
        s = _setup(_cfg(f"environment.name={spec}", "environment.kwargs={}", "train.steps=1",
                        f"train.on_reward_error={mode}"))
        ro_rows = grpo.train(s)
        s.close()
        row = ro_rows[0]
        assert row["reward_errors"] == row["episode/env_errors"] > 0
    assert math.isfinite(row["loss"])


def test_a_one_turn_episode_is_the_completion_run_bit_for_bit():
    """The arithmetic task (no chat template) as one-turn episodes without environment or tools: the
    same metrics and weights as the completion path."""
    cfg = C.from_preset("grpo", ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=5",
                                 "train.steps=3", "train.minibatch_size=8", "train.microbatch_size=4",
                                 "train.lr=1e-3", "run.tensorboard=false", "run.progress=false",
                                 "model.dtype=float32", "loss.kl_coef=0.04"])
    out = []
    for episodes in (False, True):
        tok = build_char_tokenizer()
        model = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
        s = build_setup(cfg, policy=model, tokenizer=tok, prompts=ArithStream(ArithTask(ops="+*"), seed=0))
        if episodes:
            s.data.agent = Agent(AgentSpec(max_turns=1, max_episode_tokens=10_000, max_turn_tokens=5), None, None)
        rows = grpo.train(s)
        out.append(([{k: v for k, v in r.items() if not k.startswith(TIMING) and not k.startswith("episode/")}
                     for r in rows], s.models.policy.state_dict()))
    assert out[0][0] == out[1][0]
    for k, v in out[0][1].items():
        assert torch.equal(v, out[1][1][k]), k


def boom(text: str) -> str:
    """Always raises.

    Args:
        text: Anything.
    """
    raise ValueError(f"cannot handle {text}")


def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    import time

    time.sleep(seconds)
    return "awake"


def test_tool_errors_reach_the_model_and_are_counted():
    """A raising tool, a call past its time limit and a malformed call: each comes back to the model as
    an error message in the next environment turn, and the step's metrics count them."""
    from grpolab.agents.driver import EpisodeDriver
    from grpolab.agents.tools import load_tools
    from grpolab.grpo.episodes import episode_metrics, episode_rows
    from grpolab.agents.episode import EpisodeBatch

    tok = build_char_chat_tokenizer(TOOLS_TEMPLATE)
    turns = ['<tool_call>{"name": "boom", "arguments": {"text": "x"}}</tool_call>',
             '<tool_call>{"name": "nap", "arguments": {"seconds": 30}}</tool_call>',
             '<tool_call>{"name": "nap", "arguments": </tool_call>', "done"]

    def script(ids, max_new_tokens):
        out = tok.encode(turns.pop(0), add_special_tokens=False) + [tok.eos_token_id]
        return out, [0.0] * len(out)

    with load_tools(["test_grpo_episodes:boom", "test_grpo_episodes:nap"], timeout_s=1.0) as box:
        ep = EpisodeDriver(tok, script, tools=box, max_turns=5, max_episode_tokens=4000).run(
            {"messages": [{"role": "user", "content": "go"}]})
    env_texts = [tok.decode(list(s.ids)) for s in ep.segments if not s.policy]
    assert "boom raised ValueError: cannot handle x" in env_texts[0]
    assert "nap timed out after 1 s" in env_texts[1]
    assert "malformed tool call" in env_texts[2]
    assert (ep.turns, ep.tool_calls, dict(ep.tool_errors)) == (4, 3, {"raised": 1, "timeout": 1, "malformed": 1})
    assert ep.stop_reason == "done"
    rows = episode_rows(EpisodeBatch([ep], 1, tok.pad_token_id), tok.decode)
    metrics = episode_metrics(rows)
    assert (metrics["episode/tool_calls"], metrics["episode/tool_errors"], metrics["episode/turns"]) == (3, 3, 4)
    assert [s["source"] for s in rows[0]["segments"]] == ["prompt"] + ["policy", "env"] * 3 + ["policy"]


def test_dynamic_sampling_keeps_episode_groups_whose_rewards_differ():
    s = _setup(_cfg("rollout.dynamic_sampling=true", "rollout.max_generation_batches=3", "train.steps=1"))
    records = []
    s.services.hooks.append(lambda step, row, record: records.append((row, record)))
    grpo.train(s)
    s.close()
    row, record = records[0]
    assert 1 <= row["rollout/gen_batches"] <= 3 and len(record.episodes) == 16
    spread = record.rewards.view(-1, 4).std(-1) > 0
    assert bool(spread.all()) or row["rollout/gen_batches"] == 3
