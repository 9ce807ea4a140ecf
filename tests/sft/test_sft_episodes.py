"""grpolab.sft.episodes: scripted episodes in the sampled layout, and SFT on their policy tokens only."""

from __future__ import annotations

import pytest
import torch

from grpolab.agents.agent import AgentSpec
from grpolab.agents.episode import Episode, Segment, to_tensors
from grpolab.forward.layouts import padded_completion_logprobs
from grpolab.models.tiny import build_tiny_model
from grpolab.models.tiny_chat import TOOLS_TEMPLATE, build_char_chat_tokenizer
from grpolab.sft.episodes import episode_nll, scripted_episodes, sft_on_episodes

GUESS = AgentSpec(environment="grpolab.agents.builtin:GuessNumber", environment_kwargs={"n": 10, "max_turns": 4},
                  max_turns=4, max_episode_tokens=600, max_turn_tokens=8)


@pytest.fixture(scope="module")
def tok():
    return build_char_chat_tokenizer(TOOLS_TEMPLATE)


def _tiny(tok, seed=0):
    return build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, max_positions=1024, seed=seed)


def _count_up(messages, item):
    """Guesses 1, 2, 3, ... (the number of assistant turns so far, plus one)."""
    return str(1 + sum(m["role"] == "assistant" for m in messages))


def test_policy_mask_is_exactly_the_scripted_turns(tok):
    seen = []

    def script(messages, item):
        seen.append([m["role"] for m in messages])
        return _count_up(messages, item)

    with GUESS.build() as agent:
        episodes = scripted_episodes(tok, agent, [{"secret": 3}, {"secret": 9}], script)
    solved, failed = episodes
    assert (solved.turns, solved.stop_reason, solved.reward) == (3, "done", 1.0)
    assert (failed.turns, failed.stop_reason, failed.reward) == (4, "done", 0.0)
    assert seen[:3] == [["user"], ["user", "assistant", "user"], ["user", "assistant", "user", "assistant", "user"]]
    eos = tok.eos_token_id
    for ep in episodes:
        policy = [s for s in ep.segments if s.policy]
        assert [list(s.ids) for s in policy] == [tok.encode(str(k + 1), add_special_tokens=False) + [eos]
                                                 for k in range(ep.turns)]
        assert all(s.logps == (0.0,) * len(s.ids) for s in policy)
        env = [s for s in ep.segments if not s.policy]
        assert len(env) == ep.turns - 1 and all(tok.decode(s.ids).startswith("\n<|im_start|>user\n") for s in env)
        assert tok.decode(env[0].ids) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
        mask = ep.policy_mask
        body = ep.body_ids
        assert [i for i, m in zip(body, mask) if m] == [i for s in policy for i in s.ids]
        # the sampled layout: the ids are the template's rendering of the transcript (which ends with
        # the last policy turn: the environment's final reply is never appended)
        assert tok.decode(ep.ids) + "\n" == tok.apply_chat_template(ep.messages, tokenize=False)


def test_a_turn_longer_than_the_cap_is_cut_and_the_episode_truncated(tok):
    spec = AgentSpec(environment=GUESS.environment, environment_kwargs=dict(GUESS.environment_kwargs),
                     max_turns=4, max_episode_tokens=600, max_turn_tokens=3)
    with spec.build() as agent:
        (ep,) = scripted_episodes(tok, agent, [{"secret": 5}], lambda messages, item: "12345")
    assert (ep.turns, ep.truncated, ep.stop_reason) == (1, True, "max_turn_tokens")
    assert list(ep.segments[0].ids) == tok.encode("123", add_special_tokens=False)


def _episodes(tok):
    with GUESS.build() as agent:
        return scripted_episodes(tok, agent, [{"secret": s} for s in (2, 4, 7, 10)], _count_up)


def test_the_loss_is_the_mean_nll_of_policy_tokens_only(tok):
    model = _tiny(tok)
    episodes = _episodes(tok)
    t = to_tensors(episodes, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = padded_completion_logprobs(model, t.input_ids, t.attention_mask, t.prompt_len)
        expected = -(logp * t.policy_mask).sum() / t.policy_mask.sum()
        torch.testing.assert_close(episode_nll(model, episodes, tok.pad_token_id), expected)
        packed = episode_nll(model, episodes, tok.pad_token_id, padding_free=True)
        torch.testing.assert_close(packed, expected, rtol=1e-4, atol=1e-5)
    # environment tokens are never targets: an episode ending with an environment turn scores the
    # same whatever that turn's ids are (nothing comes after them, so they are no one's context)
    ep = episodes[0]
    env = next(s for s in ep.segments if not s.policy)
    a = Episode(ep.prompt_ids, [ep.segments[0], env])
    b = Episode(ep.prompt_ids, [ep.segments[0], Segment(tuple(reversed(env.ids)), False)])
    with torch.no_grad():
        assert episode_nll(model, [a], tok.pad_token_id) == episode_nll(model, [b], tok.pad_token_id)
    logits_grad = []
    model.lm_head.register_full_backward_hook(lambda m, gi, go: logits_grad.append(go[0]))
    episode_nll(model, [a], tok.pad_token_id).backward()
    # rows of the logits that predict an environment token get no gradient
    (grad,) = logits_grad
    n_policy = len(ep.segments[0].ids)
    assert grad[0, :n_policy].abs().sum() > 0 and grad[0, n_policy:].abs().sum() == 0


def test_sft_lowers_the_nll_of_the_scripted_turns_deterministically(tok):
    episodes = _episodes(tok)
    model, twin = _tiny(tok), _tiny(tok)
    with torch.no_grad():
        before = float(episode_nll(model, episodes, tok.pad_token_id))
    losses = sft_on_episodes(model, episodes, tok.pad_token_id, steps=8, batch_size=4, microbatch_size=2, lr=1e-2,
                             seed=1)
    again = sft_on_episodes(twin, episodes, tok.pad_token_id, steps=8, batch_size=4, lr=1e-2, seed=1)
    with torch.no_grad():
        after = float(episode_nll(model, episodes, tok.pad_token_id))
    assert len(losses) == 8 and after < 0.6 * before
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(again), rtol=1e-4, atol=1e-5)  # microbatching too
