"""Agent episodes on the vLLM engine: one `LLM.generate` call per round of turns, on the episodes' token ids.

On CPU, vLLM is a fake: `ScriptedLLM` answers each request from a script of its prompt ids; the HF
engine's turn sampler is forced to the same turns for the comparison. The test marked gpu runs the real
vLLM (skipped without a CUDA GPU and the vllm extra).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from grpolab import config as C
from grpolab.models.tiny import build_tiny_model
from grpolab.models.tiny_chat import build_char_chat_tokenizer
from grpolab.rollout import vllm_engine as V
from grpolab.rollout.hf import HFEngine
from grpolab.rollout.multiturn import generate_episodes
from multiturn_helpers import Countdown, tiny_with_eos_bias

HAS_VLLM_GPU = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


class FakeSamplingParams:
    def __init__(self, n=1, seed=None, **kw):
        self.n, self.seed = n, seed
        self.__dict__.update(kw)


def _output(tokens, logps, stop_ids, max_tokens):
    """A vLLM CompletionOutput: `tokens` cut after the first stop id or at max_tokens."""
    out, lps = [], []
    for t, lp in zip(tokens, logps):
        out.append(t)
        lps.append(lp)
        if t in stop_ids or len(out) == max_tokens:
            break
    reason = "stop" if out[-1] in stop_ids else "length"
    steps = [{t: SimpleNamespace(logprob=lp), -1: SimpleNamespace(logprob=-99.0)} for t, lp in zip(out, lps)]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(out), logprobs=steps, finish_reason=reason)])


class ScriptedLLM:
    """Each request's turn is `script(prompt ids)`; the log-prob of its k-th token is `logp(k)` (default
    -(k + 1) / 8). Records every generate call: (the prompts' token ids, the SamplingParams)."""

    def __init__(self, script, logp=lambda k: -(k + 1) / 8):
        self.script, self.logp, self.calls = script, logp, []

    def generate(self, requests, sampling_params, use_tqdm):
        assert not use_tqdm and all(set(r) == {"prompt_token_ids"} for r in requests)
        prompts = [list(r["prompt_token_ids"]) for r in requests]
        self.calls.append((prompts, sampling_params))
        outs = []
        for ids, p in zip(prompts, sampling_params):
            assert p.n == 1 and p.logprobs == 0 and p.detokenize is False
            turn = self.script(ids)
            outs.append(_output(turn, [self.logp(k) for k in range(len(turn))], p.stop_token_ids, p.max_tokens))
        return outs

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))


@pytest.fixture()
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.SamplingParams = FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)


@pytest.fixture(scope="module")
def tok():
    return build_char_chat_tokenizer()


EOS_BIAS = 3.5


def _engine(llm, tok, **kw):
    return V.VLLMEngine(llm, tok, max_new_tokens=4, temperature=0.7, top_k=5, device="cpu", **kw)


def _chars(tok, text):
    """`text` as one id per character (never the tokenizer's whole-word tokens)."""
    return [tok.convert_tokens_to_ids(c) for c in text]


def _prefixes(episode):
    """The ids the driver holds before each of the episode's policy turns."""
    ids, out = list(episode.prompt_ids), []
    for s in episode.segments:
        if s.policy:
            out.append(list(ids))
        ids += s.ids
    return out


def test_each_round_sends_the_live_episodes_ids_as_held_and_ended_ones_are_not_sent_again(tok, fake_vllm):
    """Token in, token out: a turn sampled as the single characters of "cannot" (a whole-word token when
    encoded) comes back in the next round's prompt as those characters; the environment's delta follows.
    The episodes of the item with one turn leave after round 0, the others go on alone."""
    end = tok.eos_token_id
    llm = ScriptedLLM(lambda ids: _chars(tok, "cannot") + [end])
    assert tok.encode("cannot", add_special_tokens=False) != _chars(tok, "cannot")
    batch = generate_episodes(_engine(llm, tok), [{"turns": 1}, {"turns": 3}], 2, make_environment=Countdown,
                              max_turns=5, max_episode_tokens=2048, generator=torch.Generator().manual_seed(0))
    eps = batch.episodes
    assert [e.turns for e in eps] == [1, 1, 3, 3] and {e.stop_reason for e in eps} == {"done"}
    rounds = [prompts for prompts, _ in llm.calls]
    assert [len(r) for r in rounds] == [4, 2, 2]  # episodes 0 and 1 ended after their first turn
    assert rounds[1:] == [[_prefixes(eps[i])[k] for i in (2, 3)] for k in (1, 2)]
    assert rounds[0] == [list(e.prompt_ids) for e in eps]
    for e in eps:
        assert [list(s.ids) for s in e.segments if s.policy] == [_chars(tok, "cannot") + [end]] * e.turns
    e = eps[2]
    sent = rounds[1][0]
    turn = e.segments[0]
    assert sent[len(e.prompt_ids) : len(e.prompt_ids) + len(turn.ids)] == list(turn.ids)  # verbatim, not re-encoded
    assert sent[len(e.prompt_ids) + len(turn.ids) :] == list(e.segments[1].ids) and not e.segments[1].policy
    assert batch.stats == {"rounds": 3, "requests": 8, "sent_tokens": sum(len(p) for r in rounds for p in r),
                           "sampled_tokens": 8 * 7}


def test_sampled_turns_carry_vllms_logprobs_and_the_rollout_masks_the_policys_tokens(tok, fake_vllm):
    end = tok.eos_token_id
    llm = ScriptedLLM(lambda ids: _chars(tok, "ok") + [end])
    batch = generate_episodes(_engine(llm, tok, weight_version=4), [{"turns": 2}], 2, make_environment=Countdown,
                              max_turns=4, generator=torch.Generator().manual_seed(0))
    t, ro = batch.tensors(), batch.rollout()
    assert batch.weight_version == 4 and ro.group_size == 2 and torch.equal(ro.loss_mask, t.policy_mask)
    for row, e in enumerate(batch.episodes):
        assert [list(s.logps) for s in e.segments if s.policy] == [[-1 / 8, -2 / 8, -3 / 8]] * 2
        body = t.input_ids[row, t.prompt_len :]
        assert body[t.policy_mask[row]].tolist() == (_chars(tok, "ok") + [end]) * 2
        assert t.sampler_logp[row][t.policy_mask[row]].tolist() == [-1 / 8, -2 / 8, -3 / 8] * 2
    assert not (t.sampler_logp[~t.policy_mask] != 0).any()


def test_seeds_are_drawn_per_request_from_the_generator_with_the_engines_sampling_settings(tok, fake_vllm):
    end = tok.eos_token_id

    def run(seed):
        llm = ScriptedLLM(lambda ids: [end])
        generate_episodes(_engine(llm, tok), [{"turns": 2}, {"turns": 1}], 2, make_environment=Countdown,
                          max_turns=3, generator=torch.Generator().manual_seed(seed))
        return llm.calls

    calls = run(0)
    seeds = [[p.seed for p in params] for _, params in calls]
    first = torch.randint(0, 2**31 - 1, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    assert seeds[0] == first and len(seeds[1]) == 2 and len({s for r in seeds for s in r}) == 6
    assert [[p.seed for p in params] for _, params in run(0)] == seeds  # reproducible
    assert [[p.seed for p in params] for _, params in run(1)] != seeds
    p = calls[0][1][0]
    assert (p.temperature, p.top_p, p.top_k, p.stop_token_ids) == (0.7, 1.0, 5, [end])
    llm, gen = ScriptedLLM(lambda ids: [end]), torch.Generator().manual_seed(0)
    generate_episodes(_engine(llm, tok), [{"turns": 2}], 2, make_environment=Countdown, max_turns=3, generator=gen,
                      greedy=True)  # evaluation: temperature 0, no seed, nothing drawn
    assert all((p.temperature, p.seed) == (0.0, None) for _, params in llm.calls for p in params)
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(0).get_state())


def test_max_tokens_is_the_drivers_turn_budget_and_a_cut_turn_ends_its_episode(tok, fake_vllm):
    end = tok.eos_token_id
    hi = _chars(tok, "hi") + [end]
    first = generate_episodes(_engine(ScriptedLLM(lambda ids: hi), tok), [{"turns": 9}], 1,
                              make_environment=Countdown, max_turns=2).episodes[0]
    prompt, delta = len(first.prompt_ids), len(first.segments[1].ids)
    limit = prompt + len(hi) + delta + 2  # the second turn has room for 2 ids
    llm = ScriptedLLM(lambda ids: hi)
    batch = generate_episodes(_engine(llm, tok), [{"turns": 9}], 1, make_environment=Countdown, max_turns=9,
                              max_episode_tokens=limit, generator=torch.Generator().manual_seed(0))
    sent = [(ids, p.max_tokens) for prompts, params in llm.calls for ids, p in zip(prompts, params)]
    assert [m for _, m in sent] == [limit - len(ids) for ids, _ in sent] == [limit - prompt, 2]
    e = batch.episodes[0]
    assert e.stop_reason == "max_episode_tokens" and e.truncated and e.length == limit
    assert list(e.segments[-1].ids) == hi[:2]
    long_turn = _chars(tok, "abcdefghij") + [end]
    llm = ScriptedLLM(lambda ids: long_turn)
    batch = generate_episodes(_engine(llm, tok), [{"turns": 2}], 1, make_environment=Countdown, max_turns=3,
                              max_turn_tokens=4, max_episode_tokens=1024)
    assert [p.max_tokens for p in llm.calls[0][1]] == [4] and len(llm.calls) == 1
    cut = batch.episodes[0]
    assert cut.stop_reason == "max_turn_tokens" and list(cut.segments[0].ids) == long_turn[:4]


SCRIPTS = {1: ["12"], 2: ["a", "bcd"], 3: ["xyz", "", "hello world"]}
"""Item {"turns": n}'s policy turns (texts; the last one of item 3 is cut by a 6-id turn budget)."""


def _turn_ids(tok, text):
    return _chars(tok, text) + [tok.eos_token_id]


def _script_of_prompt(tok):
    """The scripted turn for a request: its item read from the prompt, its turn from the assistant headers."""
    def script(ids):
        text = tok.decode(ids, skip_special_tokens=False)
        n = int(text.split("Say something ")[1].split(" ")[0])
        return _turn_ids(tok, SCRIPTS[n][text.count("<|im_start|>assistant") - 1])
    return script


class Force:
    """The HF turn sampler's logits processor forcing each episode's scripted ids (log-prob 0), one per call."""

    def __init__(self, tok, items):
        self.queue = {i: [x for t in SCRIPTS[it["turns"]] for x in _turn_ids(tok, t)] for i, it in enumerate(items)}

    def __call__(self, rows, logits):
        out = torch.full_like(logits, float("-inf"))
        for r, i in enumerate(rows):
            out[r, self.queue[i].pop(0)] = 0.0
        return out


def test_the_episodes_and_rollout_equal_the_hf_turn_samplers_for_the_same_turns(tok, fake_vllm):
    """Both engines emit the same scripted turns (log-prob 0): the same episodes, tensors and Rollout,
    episodes ending at different turns (done, and cut by the turn budget)."""
    items = [{"turns": 1}, {"turns": 2}, {"turns": 3}]
    kw = dict(make_environment=Countdown, max_turns=3, max_turn_tokens=6, max_episode_tokens=600)
    llm = ScriptedLLM(_script_of_prompt(tok), logp=lambda k: 0.0)
    mine = generate_episodes(_engine(llm, tok), items, 1, generator=torch.Generator().manual_seed(0), **kw)
    hf = generate_episodes(HFEngine(tok, max_new_tokens=6), items, 1, model=tiny_with_eos_bias(tok, EOS_BIAS),
                           logits_processor=Force(tok, items), generator=torch.Generator().manual_seed(0), **kw)
    assert [(e.turns, e.stop_reason) for e in mine.episodes] == [(1, "done"), (2, "done"), (3, "max_turn_tokens")]
    assert [len(prompts) for prompts, _ in llm.calls] == [3, 2, 1]
    for a, b in zip(mine.episodes, hf.episodes):
        assert (a.prompt_ids, a.stop_reason, a.truncated) == (b.prompt_ids, b.stop_reason, b.truncated)
        assert a.segments == b.segments and a.messages == b.messages
    ta, tb = mine.tensors(), hf.tensors()
    for name in ("input_ids", "attention_mask", "policy_mask", "sampler_logp", "turn_index", "truncated"):
        assert torch.equal(getattr(ta, name), getattr(tb, name)), name
    ra, rb = mine.rollout(), hf.rollout()
    for name in ("input_ids", "attention_mask", "loss_mask", "truncated", "sampler_logp"):
        assert torch.equal(getattr(ra, name), getattr(rb, name)), name
    assert (ra.prompt_len, ra.group_size) == (rb.prompt_len, rb.group_size)
    assert mine.counters == hf.counters


def test_colocated_mode_wakes_before_the_batch_and_sleeps_once_after_it(tok, fake_vllm):
    end = tok.eos_token_id
    llm = ScriptedLLM(lambda ids: [end])
    eng = _engine(llm, tok, sleep=True)
    eng._sleeping = {"weights", "kv_cache"}
    generate_episodes(eng, [{"turns": 2}], 1, make_environment=Countdown, max_turns=3)
    kinds = ["generate" if isinstance(c[0], list) else c for c in llm.calls]
    assert kinds == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), "generate", "generate",
                     "reset_prefix_cache", ("sleep", 1)]


def test_the_hf_turn_samplers_model_and_logits_processor_are_refused(tok, fake_vllm):
    eng = _engine(ScriptedLLM(lambda ids: [tok.eos_token_id]), tok)
    with pytest.raises(ValueError, match="VLLMEngine samples from its own weights"):
        generate_episodes(eng, [{"turns": 1}], 1, make_environment=Countdown, model=torch.nn.Linear(1, 1))


def test_an_agent_config_takes_the_vllm_engine_and_gives_vllm_room_for_an_episode(tok):
    cfg = C.from_preset("grpo", ["rollout.engine=vllm", "model.device=cuda",
                                 "environment.name=grpolab.agents.builtin:GuessNumber",
                                 "rollout.max_turns=4", "rollout.max_episode_tokens=3000", "rollout.max_new_tokens=64",
                                 "data.max_prompt_tokens=100"])  # validated: no refusal of vllm with episodes
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
    assert V.max_model_len(cfg, model) == 3000


# --------------------------------------------------------------------------- the real vLLM (CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs a CUDA GPU and vLLM (pip install 'grpolab[vllm]')")
def test_vllm_episodes_sampler_logprobs_are_the_trainers():
    """bf16 vLLM on a tiny chat policy, episodes of several turns: each round's prompt is the episode so
    far, and the recorded sampler log-probs match the trainer's forward over the final Rollout."""
    from grpolab.forward import batched_logprobs
    from grpolab.rollout.engine import build_engine

    tok = build_char_chat_tokenizer()
    model = build_tiny_model(tok, hidden_size=128, num_layers=2, num_heads=2, max_positions=1024, seed=0).cuda().eval()
    cfg = C.from_preset("grpo", ["rollout.engine=vllm", "model.device=cuda", "model.dtype=bfloat16",
                                 "rollout.temperature=0.7", "rollout.vllm_gpu_memory_utilization=0.3",
                                 "data.max_prompt_tokens=512", "rollout.max_new_tokens=16"])
    eng = build_engine(cfg, model, tok, torch.bfloat16)
    try:
        batch = generate_episodes(eng, [{"turns": 1}, {"turns": 3}], 3, make_environment=Countdown, max_turns=3,
                                  max_turn_tokens=16, max_episode_tokens=512,
                                  generator=torch.Generator(device="cuda").manual_seed(0))
        assert batch.stats["rounds"] >= 1 and batch.stats["requests"] == sum(e.turns for e in batch.episodes)
        ro = batch.rollout()
        ro = ro.replace(**{k: getattr(ro, k).cuda() for k in ("input_ids", "attention_mask", "loss_mask",
                                                               "truncated", "sampler_logp")})
        err = (ro.sampler_logp - batched_logprobs(model, ro, 0.7, 6, torch.bfloat16)).abs()[ro.loss_mask]
        assert err.mean() < 0.02 and err.max() < 0.25
    finally:
        eng.close()
