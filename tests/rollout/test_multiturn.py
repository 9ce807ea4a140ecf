"""grpolab.rollout.multiturn: batches of agent episodes on the HF engine, turn by turn, KV cache kept across turns."""

from __future__ import annotations

import threading

import pytest
import torch


from grpolab.models.tiny_chat import TOOLS_TEMPLATE, build_char_chat_tokenizer as build_chat_tokenizer  # noqa: E402
from grpolab.agents.builtin import CalculatorTask, GuessNumber  # noqa: E402
from grpolab.agents.delta import prompt_ids, render  # noqa: E402
from grpolab.agents.driver import EpisodeDriver  # noqa: E402
from grpolab.agents.tools import load_tools  # noqa: E402
from grpolab.algo.logprobs import token_logprobs  # noqa: E402
from grpolab.rollout.hf import HFEngine  # noqa: E402
from grpolab.rollout.multiturn import generate_episodes  # noqa: E402
from grpolab.batch import position_ids  # noqa: E402
from multiturn_helpers import Countdown, tiny_with_eos_bias  # noqa: E402


@pytest.fixture(scope="module")
def chat_tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def model(chat_tok):
    """Turns of a few ids, most ending with <|im_end|> (some cut by a 6-id cap at temperature 1.5)."""
    return tiny_with_eos_bias(chat_tok, 3.5)


@pytest.fixture(scope="module")
def talker(chat_tok):
    """Turns of 1 to 12 ids and more: longer decodes, rows leaving the batch at different steps."""
    return tiny_with_eos_bias(chat_tok, 2.0)


class Mixed:
    """GuessNumber for items with a "secret", Countdown for the others: one batch, two environments."""

    def reset(self, item):
        self.env = GuessNumber(n=100, max_turns=5) if "secret" in item else Countdown()
        return self.env.reset(item)

    def step(self, message):
        return self.env.step(message)


class Force:
    """A logits processor that forces each episode's scripted turns (text, then <|im_end|>), one id per call."""

    def __init__(self, tok, scripts):
        eos = tok.eos_token_id
        self.queue = {i: [x for turn in turns for x in tok.encode(turn, add_special_tokens=False) + [eos]]
                      for i, turns in scripts.items()}

    def __call__(self, rows, logits):
        out = torch.full_like(logits, float("-inf"))
        for r, i in enumerate(rows):
            out[r, self.queue[i].pop(0)] = 0.0
        return out


class Script:
    """The sequential driver's fake policy for the same scripted turns (log-prob 0.0, as when forced)."""

    def __init__(self, tok, turns):
        self.tok, self.turns = tok, list(turns)

    def __call__(self, ids, max_new_tokens):
        out = (self.tok.encode(self.turns.pop(0), add_special_tokens=False) + [self.tok.eos_token_id])[:max_new_tokens]
        return out, [0.0] * len(out)


def _recomputed(model, t, temperature=1.0):
    """Per-token log-probs of the body ids from ONE padded forward over the to_tensors layout [N, Lb]."""
    with torch.no_grad():
        logits = model(input_ids=t.input_ids, attention_mask=t.attention_mask.long(),
                       position_ids=position_ids(t.attention_mask)).logits
    lp = t.prompt_len
    return token_logprobs(logits[:, lp - 1 : -1], t.input_ids[:, lp:], temperature)


def test_sampler_logprobs_equal_one_forward_over_episodes_of_different_turn_counts(chat_tok, talker):
    """The test of record: sampled turn by turn with the cache kept across turns (parked, re-laid out,
    holes), the recorded log-probs equal the trainer's single forward over the final episodes."""
    engine = HFEngine(chat_tok, max_new_tokens=8, temperature=0.9, top_k=40, top_p=0.95)
    items = [{"secret": 37}, {"turns": 1}, {"turns": 3}]
    batch = generate_episodes(engine, items, 2, make_environment=Mixed, max_turns=4, max_turn_tokens=12,
                              max_episode_tokens=800, generator=torch.Generator().manual_seed(0), model=talker)
    eps = batch.episodes
    assert len(eps) == 6 and len({e.turns for e in eps}) >= 3  # different turn counts in one batch
    assert [e.turns for e in eps[2:4]] == [1, 1] and all(e.turns == 4 for e in eps[:2] if e.stop_reason == "max_turns")
    assert any(not s.policy for e in eps for s in e.segments)  # environment turns were appended
    assert max(len(s.ids) for e in eps for s in e.segments if s.policy) >= 8 and batch.stats["parked_tokens"] > 0
    assert "max_turn_tokens" in {e.stop_reason for e in eps}  # a cut turn too
    t = batch.tensors()
    recomputed = _recomputed(talker, t, temperature=0.9)
    torch.testing.assert_close(recomputed[t.policy_mask], t.sampler_logp[t.policy_mask])
    # the same from the Rollout view the trainer reads
    ro = batch.rollout()
    assert torch.equal(ro.loss_mask, t.policy_mask) and torch.equal(ro.sampler_logp, t.sampler_logp)
    counters = batch.counters
    assert [c.turns for c in counters] == [e.turns for e in eps]
    assert all(c.policy_tokens + c.env_tokens == len(e.body_ids) for c, e in zip(counters, eps))
    assert all(c.policy_tokens == int(m.sum()) for c, m in zip(counters, t.policy_mask))


@pytest.mark.parametrize("greedy", [False, True])
def test_one_turn_without_environment_is_hf_engines_rollout(chat_tok, talker, greedy):
    items = [{"messages": [{"role": "user", "content": q}]} for q in ("2+2?", "12+345?", "Hi")]
    prompts = [render(chat_tok, it["messages"], add_generation_prompt=True) for it in items]
    engine = HFEngine(chat_tok, max_new_tokens=10, temperature=0.9, top_k=60, top_p=0.95)
    ro = engine.generate_with(talker, prompts, 3, generator=torch.Generator().manual_seed(1), greedy=greedy)
    batch = generate_episodes(engine, items, 3, max_turn_tokens=10, max_episode_tokens=4096, model=talker,
                              generator=torch.Generator().manual_seed(1), greedy=greedy)
    mine = batch.rollout()
    if not greedy:
        assert ro.truncated.any() and not ro.truncated.all()  # both ends of a turn are covered
    assert mine.prompt_len == ro.prompt_len and mine.group_size == ro.group_size == 3
    assert torch.equal(mine.input_ids, ro.input_ids)
    assert torch.equal(mine.attention_mask, ro.attention_mask)
    assert torch.equal(mine.loss_mask, ro.loss_mask)
    assert torch.equal(mine.truncated, ro.truncated)
    torch.testing.assert_close(mine.sampler_logp, ro.sampler_logp, rtol=0, atol=0)
    assert batch.stats["rounds"] == 1 and batch.stats["parked_tokens"] == 0  # nothing kept for a next turn


def test_the_kv_cache_is_not_prefilled_again(chat_tok, talker):
    """Every real id reaches the model once: each distinct prompt, then each body id but an episode's
    last; later forwards are one decode column or one turn's new ids (last sampled id + delta)."""
    fed = []

    def count(module, args, kwargs):
        ids, am = kwargs["input_ids"], kwargs["attention_mask"]
        fed.append((ids.shape[1], ids.numel(), int(am[:, -ids.shape[1]:].sum()), am.shape[1]))

    engine = HFEngine(chat_tok, max_new_tokens=8)
    items = [{"turns": 1}, {"turns": 2}, {"turns": 4}]
    hook = talker.register_forward_pre_hook(count, with_kwargs=True)
    try:
        batch = generate_episodes(engine, items, 2, make_environment=Countdown, max_turns=4, max_turn_tokens=16,
                                  max_episode_tokens=800, generator=torch.Generator().manual_seed(0), model=talker)
    finally:
        hook.remove()
    eps = batch.episodes
    assert len({e.turns for e in eps}) >= 2 and max(e.turns for e in eps) >= 3
    prompts = {tuple(e.prompt_ids) for e in eps}
    assert len(prompts) == 3  # the G episodes of an item share one prefill
    real = sum(len(p) for p in prompts) + sum(len(e.body_ids) - 1 for e in eps)
    assert sum(f[2] for f in fed) == real
    assert fed[0][0] == max(len(p) for p in prompts)  # the prefill
    widest_delta = max(len(s.ids) for e in eps for s in e.segments if not s.policy)
    assert all(width <= widest_delta + 1 for width, *_ in fed[1:])  # never the history again
    # the cache only grows by what is fed: each forward's mask is the cache before it plus its new ids,
    # and no row ever holds more columns than (longest prompt + turns' widths) allows
    assert max(f[3] for f in fed) < max(e.length for e in eps) + 2 * max(e.turns for e in eps) * widest_delta
    assert batch.stats["fed_real_tokens"] == real and batch.stats["forwards"] == len(fed)
    assert batch.stats["fed_tokens"] == sum(f[1] for f in fed)
    assert batch.stats["rounds"] == max(e.turns for e in eps)


def test_episodes_end_at_different_turns_and_by_the_token_budget(chat_tok, model):
    engine = HFEngine(chat_tok, max_new_tokens=8)
    items = [{"turns": 1}, {"turns": 5}]
    scripts = {0: ["a"], 1: ["bb"], 2: ["c1", "c2", "c3"], 3: ["d1", "d22", "d333"]}
    batch = generate_episodes(engine, items, 2, make_environment=Countdown, max_turns=3, max_episode_tokens=800,
                              model=model, logits_processor=Force(chat_tok, scripts))
    eps = batch.episodes
    assert [(e.turns, e.stop_reason, e.truncated, e.done) for e in eps] == [
        (1, "done", False, True)] * 2 + [(3, "max_turns", True, False)] * 2
    assert [e.reward for e in eps] == [1.0, 1.0, None, None]
    assert len(eps[3].segments) == 5 and eps[3].segments[-1].policy  # the last reply is not appended
    assert [chat_tok.decode(s.ids) for s in eps[3].segments if s.policy] == [
        "d1<|im_end|>", "d22<|im_end|>", "d333<|im_end|>"]
    assert all(x == 0.0 for e in eps for x in e.sampler_logp)  # a forced token has log-prob 0
    # the same episodes as the sequential driver with the same turns
    seq = [EpisodeDriver(chat_tok, Script(chat_tok, scripts[i]), Countdown, max_turns=3,
                         max_episode_tokens=800).run(items[i // 2]) for i in range(4)]
    assert eps == seq

    # max_episode_tokens: the second turn gets only what is left (5 ids; 4 for the other episode, whose
    # prompt is one id longer: per-row caps in one decode), is cut, and ends the episode
    lp = len(prompt_ids(chat_tok, Countdown().reset({"turns": 5})))
    delta = 25  # "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n" in char tokens
    scripts = {0: ["ab", "xxxxxxxxxx"], 1: ["ab", "x"]}
    batch = generate_episodes(engine, [{"turns": 5}, {"turns": 12}], 1, make_environment=Countdown, max_turns=2,
                              max_episode_tokens=lp + 3 + delta + 5, model=model,
                              logits_processor=Force(chat_tok, scripts))
    cut, other = batch.episodes
    assert len(cut.segments[1].ids) == delta and len(other.prompt_ids) == lp + 1
    budget = lp + 3 + delta + 5
    assert (cut.stop_reason, cut.truncated, cut.turns, cut.length) == ("max_episode_tokens", True, 2, budget)
    assert chat_tok.decode(cut.segments[2].ids) == "xxxxx"
    assert (other.stop_reason, other.turns, other.length) == ("max_turns", 2, lp + 1 + 3 + delta + 2)
    t = batch.tensors()
    assert t.truncated.tolist() == [True, True]
    assert batch.counters[0] == (2, 0, 0, 3 + 5, delta, "max_episode_tokens", True)


@pytest.mark.parametrize("template", [None, TOOLS_TEMPLATE], ids=["default-tool-format", "template-tools"])
def test_a_tool_call_reaches_the_calculator_and_its_result_is_appended(template, model):
    tok = build_chat_tokenizer() if template is None else build_chat_tokenizer(template)
    env = CalculatorTask()
    env.reset({"seed": 3})
    a, b = env.operands
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'
    scripts = {0: [call, f"The answer is {a * b}."], 1: ["42"], 2: ['<tool_call>{"name": "calc"}</tool_call>', "1"]}
    items = [{"seed": 3}, {"seed": 4}, {"seed": 5}]
    engine = HFEngine(tok, max_new_tokens=8, temperature=0.7)
    with load_tools(["grpolab.agents.builtin:calculator"]) as tools:
        batch = generate_episodes(engine, items, 1, make_environment=CalculatorTask, tools=tools, max_turns=3,
                                  max_episode_tokens=4096, model=model, logits_processor=Force(tok, scripts),
                                  generator=torch.Generator().manual_seed(0))
        seq = [EpisodeDriver(tok, Script(tok, scripts[i]), CalculatorTask, tools, max_turns=3,
                             max_episode_tokens=4096).run(items[i]) for i in range(3)]
    solved, direct, bad = batch.episodes
    assert (solved.turns, solved.tool_calls, solved.reward, solved.stop_reason) == (2, 1, 1.0, "done")
    assert not solved.tool_errors
    reply = tok.decode(solved.segments[1].ids)
    assert reply.startswith("\n<|im_start|>user\n<tool_response>\n") and str(a * b) in reply
    assert reply.endswith("<|im_start|>assistant\n")
    assert (direct.turns, direct.tool_calls, direct.reward) == (1, 0, 0.0)
    assert (bad.turns, bad.tool_calls, dict(bad.tool_errors)) == (2, 1, {"malformed": 1})
    assert [c.tool_calls for c in batch.counters] == [1, 0, 1] and [c.tool_errors for c in batch.counters] == [0, 0, 1]
    assert batch.episodes == seq  # what the sequential driver makes of the same turns


def test_an_environment_error_ends_its_episode_only_and_no_episode_thread_is_left(chat_tok, model):
    class Breaks(Countdown):
        def step(self, message):
            if self.left == 1 and self.breaks:
                raise RuntimeError("environment broke")
            return super().step(message)

        def reset(self, item):
            self.breaks = item["turns"] == 3
            return super().reset(item)

    engine = HFEngine(chat_tok, max_new_tokens=4)
    scripts = {i: ["a", "b", "c"] for i in range(4)}
    batch = generate_episodes(engine, [{"turns": 3}, {"turns": 1}], 2, make_environment=Breaks, max_turns=3,
                              model=model, logits_processor=Force(chat_tok, scripts))
    stops = [e.stop_reason for e in batch.episodes]
    assert stops[2:] == ["done", "done"]  # the environment of the second item does not break
    assert stops[:2] == ["env_error", "env_error"]
    assert all("Breaks raised RuntimeError: environment broke" in e.env_error for e in batch.episodes[:2])
    assert not any(e.done or e.truncated for e in batch.episodes[:2])
    assert not [t for t in threading.enumerate() if t.name.startswith("grpolab-episode-")]
    assert not model.training
    # an error while sampling (here: the forced script runs out) ends the waiting episodes too
    with pytest.raises(IndexError):
        generate_episodes(engine, [{"turns": 3}], 2, make_environment=Countdown, max_turns=3, model=model,
                          logits_processor=Force(chat_tok, {0: ["a"], 1: ["b", "c"]}))
    assert not [t for t in threading.enumerate() if t.name.startswith("grpolab-episode-")]
