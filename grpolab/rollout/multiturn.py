"""Multi-turn agent episodes: a batch of episodes, turn by turn; on the HF engine the KV cache is kept across turns.

`generate_episodes(engine, items, group_size, ...)` runs N = P × G episodes (G per item, rows grouped
by item as in a Rollout) with the policy an engine samples from, and returns an `EpisodeBatch`:
the agents package's `Episode` records (agents/episode.py), their trainer tensors (`to_tensors`, or a
`Rollout`), per-episode counters and the engine's own compute counters. The rounds of turns below
are the same for every engine; what samples a round is the engine's turn sampler: this module's
`_TurnSampler` for an `HFEngine` (the rest of this docstring), or one the engine provides
(`episode_turns`: `VLLMEngine` sends each round to vLLM on token ids, rollout/vllm_engine.py).

What happens between turns is the agents package's, unchanged: each episode is run by ONE
`EpisodeDriver.run(item)` (agents/driver.py): opening messages, tool calls answered by the tools,
else `env.step`, rewards, stop reasons, max_turns / max_episode_tokens / max_turn_tokens, control-text
stripping and the template deltas (`env_delta_ids`). Nothing of it is re-implemented here. The driver
calls `generate(ids, max_new_tokens)` once per policy turn and blocks on it; to batch those calls
across episodes, each episode's `run` executes in a thread of its own, and the threads are used as
coroutines: exactly ONE runs at a time, in episode order, until it asks for its next turn (or its
episode ends). When every live episode has asked, the turns of all of them are sampled together
(one batched decode), each episode gets its turn back, and so on. Environments, tools and the
tokenizer are therefore never used concurrently, and the order of their calls is the same on every
run (episode 0's step, then episode 1's, ...): a batch is as reproducible as the sequential driver.
Environments on env workers (rollout.env_workers, agents/envworkers.py) are the exception: a round's
calls start in that order and run at the same time, each episode's environment on its own instance.

Token in, token out. The driver hands `generate` the episode's whole id list; the engine checks that
it starts with what it saw last (the previous ids and the turn it sampled, as sampled) and feeds
only the rest: the last sampled id of the previous turn (never fed yet: nothing was generated after
it) followed by the environment's delta ids as `env_delta_ids` made them. A RuntimeError names any
episode whose ids were changed.

The KV cache across turns (one "round" = one policy turn of every live episode):

- Between rounds, an episode's cache is PARKED compacted: per layer, the keys and values of its real
  tokens only [H, n, D], in order (n = its ids so far minus the last sampled one). Parked rows have
  no padding, so their positions are implicit: the k-th real token has position k.
- A round builds one batch cache for the episodes that asked for a turn (episode order) and lays
  each row out as [left padding | parked tokens (n_i) | left padding | new ids (q_i)]: the parked
  tokens right-aligned to the longest (W columns), the new ids right-aligned to the longest feed
  (Q columns), so every row's last real token is in the last column and one forward of [B, Q] new
  ids (logits_to_keep=1) gives every row's next-token logits. The padding inside a row (between its
  parked tokens and its new ids) is a HOLE: attention_mask is 0 there, as on the left padding, and
  position_ids = cumsum(attention_mask) - 1 (`batch.position_ids`) skip it, so the real
  tokens have positions 0, 1, 2, ... without gaps: exactly the positions of the trainer's single
  forward over the `to_tensors` layout ([left padding | prompt | body | right padding]). Keys carry
  their rotary position from when they were written, so a key is the same vector in both layouts
  and the sampler's log-probs equal the trainer's recomputed ones up to float rounding.
- The turn is then decoded like `HFEngine._decode`: one column per step; a row that ends its turn
  (end-of-turn id, or its token cap) leaves the decode batch (the cache is compacted), and its real
  tokens are parked first, unless the driver is certain to end the episode after this turn (the
  turn was cut, max_turns reached, or no room left): then nothing is copied.
- Round 0 is the same with nothing parked (W = 0): a prefill of the prompts, each distinct prompt
  ONCE, its cache then shared by the episodes that have it (the G episodes of an item, when the
  environment's opening does not depend on chance), like HFEngine's group prefill.

Costs: an ended episode costs nothing after its last turn; a row that ends its turn early stops
costing compute at once. No history is ever re-fed: the model sees each real id once (prompts once
per distinct prompt; each sampled id once, except each episode's very last one, which is never fed),
plus the padding of each round's [B, Q] feed. Per round, the parked tokens of the live episodes are
copied into the round's cache once (memory traffic of about one decode step; no compute).

Sampling is the HF engine's: temperature, top-k, top-p (`sampling.sample_tokens`, log-probs of the
temperature-scaled unfiltered distribution), greedy (`greedy_tokens`), an explicit torch.Generator,
compute-dtype autocast around the whole call, `bf16_weights` and `packed_weights`. With one turn per
episode and the same prompts and generator, the samples equal `HFEngine.generate_with`'s bit for
bit (tests/rollout/test_multiturn.py). Not supported: `compile` (the static-cache loop; ignored
here) and models whose cache is not plain full attention (sliding windows, linear attention:
ValueError), because parked caches are re-laid out by position.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from grpolab.agents.driver import EpisodeDriver
from grpolab.agents.episode import EpisodeBatch
from grpolab.forward.attention import autocast, use_fast_cpu_attention
from grpolab.rollout.cache import new_decode_cache
from grpolab.agents.coroutines import Coroutines
from grpolab.rollout.hf import cache_kwarg
from grpolab.rollout.sampling import greedy_tokens, sample_tokens
from grpolab.batch import position_ids

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""(episode index of each decode row [B], next-token logits [B, V] float32) -> logits [B, V] to sample
from. Called once per sampled token of every row. The recorded sampler log-probs are those of the
processed logits (e.g. a processor that forces a token records log-prob 0 for it)."""


def generate_episodes(
    engine: Any,
    items: Sequence[Any],
    group_size: int,
    *,
    make_environment: Callable[[], Any] | None = None,
    tools: Any = None,
    max_turns: int = 1,
    max_episode_tokens: int = 1024,
    max_turn_tokens: int | None = None,
    end_of_turn: str | None = None,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    model: torch.nn.Module | None = None,
    logits_processor: LogitsProcessor | None = None,
) -> EpisodeBatch:
    """G = group_size episodes for each item, sampled turn by turn by `engine`.

    engine: an HFEngine (this module's turn sampler: its tokenizer, sampling settings (temperature,
    top_k, top_p), compute_dtype, bf16_weights, packed_weights and weight_version are used; its
    max_new_tokens is not: turns are capped by max_turn_tokens and max_episode_tokens), or an engine
    with a turn sampler of its own (`episode_turns`, e.g. `VLLMEngine`: one vLLM generate call per
    round on the episodes' token ids). make_environment, tools, max_turns, max_episode_tokens,
    max_turn_tokens, end_of_turn: as `agents.driver.EpisodeDriver`'s (the episodes are that
    driver's); a make_environment with an `end_batch()` method (agents.envworkers.EnvPool) is told
    when every episode of the batch has ended, and one with a `start()` method is started first (a
    failure to start raises here instead of ending each episode as an environment error). generator / greedy: as HFEngine.generate_with's.
    model (default: engine.model) and logits_processor (see `LogitsProcessor`; None: sample from
    the model's logits): the HF turn sampler's only; an engine with its own turn sampler samples
    from its own weights and refuses them.

    An engine's `episode_turns(driver, rows, generator=, greedy=)` is a context manager that yields
    the round's sampler for `rows` episodes: an object with `sample(requests) -> replies` (episode ->
    (its ids so far, max new tokens) -> episode -> (sampled ids, their log-probs), as `_TurnSampler.
    sample`) and `stats` (the counters kept in EpisodeBatch.stats).
    """
    if group_size < 1 or not items:
        raise ValueError(f"generate_episodes: need items and group_size >= 1, got {len(items)} items, "
                         f"group_size={group_size}")
    own = getattr(engine, "episode_turns", None)
    if own is not None and (model is not None or logits_processor is not None):
        raise ValueError(f"generate_episodes: {type(engine).__name__} samples from its own weights; model= and "
                         "logits_processor= are the HF engine's")
    turns_of = own if own is not None else functools.partial(_hf_turns, engine, model, logits_processor)
    coroutines = Coroutines()
    driver = EpisodeDriver(engine.tokenizer, coroutines.generate, make_environment, tools, max_turns,
                           max_episode_tokens, max_turn_tokens, end_of_turn)
    n = len(items) * group_size
    getattr(make_environment, "start", _nothing)()  # env workers: a failed start is an error, not an episode's
    try:
        with turns_of(driver, n, generator=generator, greedy=greedy) as turns:
            episodes = coroutines.run(driver, [items[i // group_size] for i in range(n)], turns.sample)
            stats = dict(turns.stats)
    finally:
        coroutines.close()
        getattr(make_environment, "end_batch", _nothing)()
    from grpolab.rollout.hf import pad_id

    return EpisodeBatch(episodes, group_size, pad_id(engine.tokenizer), getattr(engine, "weight_version", 0), stats)


@contextlib.contextmanager
def _hf_turns(engine, model, logits_processor, driver: EpisodeDriver, rows: int, *, generator, greedy: bool):
    """The HF engine's turn sampler (`_TurnSampler`) on `model` (default: engine.model), in eval mode,
    under no_grad, the compute dtype's autocast and `packed_weights`; the model's mode is restored after."""
    model = model if model is not None else getattr(engine, "model", None)
    if model is None:
        raise ValueError("generate_episodes: no model to sample from (engine.model is None and no model= given)")
    if model is getattr(engine, "model", None) and getattr(engine, "released", False):
        raise RuntimeError("generate_episodes: the engine's weights were released; load_weights must come first")
    device = next(model.parameters()).device
    dtype = getattr(engine, "compute_dtype", None)
    was_training = model.training
    model.eval()
    use_fast_cpu_attention(model, dtype, device)
    sampler, turns = model, None
    try:
        if getattr(engine, "bf16_weights", False) and dtype == torch.bfloat16:
            from grpolab.models.loading import frozen_copy

            sampler = frozen_copy(model, torch.bfloat16)  # freed when the batch ends
        turns = _TurnSampler(engine, sampler, driver, generator, greedy, logits_processor)
        with torch.no_grad(), autocast(dtype, device.type), _packing(engine, sampler, dtype, rows):
            yield turns
    finally:
        model.train(was_training)
        sampler = None
        if turns is not None:
            turns.parked.clear()
            turns.model = None
    if device.type == "cpu":
        from grpolab.memory import release_free_memory

        release_free_memory()  # the KV caches are gone: hand their pages back before learning


def _nothing() -> None:
    pass


def _packing(engine, model, dtype, rows: int):
    """HFEngine's `packed_weights` (oneDNN-packed linears, float32 on a CPU), else a no-op context."""
    if getattr(engine, "packed_weights", False) and dtype in (None, torch.float32):
        from grpolab.rollout.packed import packed_linears

        return packed_linears(model, rows)
    return contextlib.nullcontext()


class _Parked(NamedTuple):
    """An episode's cache between turns: per layer, the keys and values of its real tokens [H, n, D]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int


class _TurnSampler:
    """Samples one policy turn for each requesting episode, in one batch (module docstring: the cache)."""

    def __init__(self, engine, model, driver: EpisodeDriver, generator, greedy: bool,
                 logits_processor: LogitsProcessor | None):
        self.engine, self.model, self.driver = engine, model, driver
        self.generator, self.greedy, self.processor = generator, greedy, logits_processor
        self.end_id = int(driver.end_id)
        from grpolab.rollout.hf import pad_id

        self.pad = pad_id(engine.tokenizer)
        self.parked: dict[int, _Parked] = {}
        self.seen: dict[int, list[int]] = {}
        """Episode -> its ids after its last turn (the request's ids + the sampled ones)."""
        self.turns: dict[int, int] = {}
        self.stats = {"forwards": 0, "rounds": 0, "fed_tokens": 0, "fed_real_tokens": 0, "parked_tokens": 0}

    def _forward(self, cache, input_ids, attention_mask, position_ids):
        self.stats["forwards"] += 1
        self.stats["fed_tokens"] += input_ids.numel()
        self.stats["fed_real_tokens"] += int(attention_mask[:, -input_ids.shape[1]:].sum())
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{cache_kwarg(type(self.model)): cache})
        return getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1].float()

    def _next_tokens(self, logits, slots: list[int], active: torch.Tensor):
        """(tokens [B], log-probs [B]) for the decode rows `active` (indices into `slots`)."""
        if self.processor is not None:
            logits = self.processor([slots[r] for r in active.tolist()], logits)
        if self.greedy:
            return greedy_tokens(logits)
        e = self.engine
        return sample_tokens(logits, e.temperature, e.top_k, e.top_p, self.generator)

    def _feeds(self, requests: dict[int, tuple[list[int], int]]) -> list[list[int]]:
        """Each request's ids not yet fed to the model (checked: token in, token out)."""
        feeds = []
        for i, (ids, _) in requests.items():
            seen = self.seen.get(i)
            if seen is None:
                feeds.append(ids)
                continue
            if ids[: len(seen)] != seen:
                at = next(k for k in range(len(seen)) if k >= len(ids) or ids[k] != seen[k])
                raise RuntimeError(f"generate_episodes: episode {i}'s ids changed at position {at} since its "
                                   "last turn (the ids sampled, and those before them, must be kept as they are)")
            if i not in self.parked:
                raise RuntimeError(f"generate_episodes: episode {i} asked for a turn after one its cache was "
                                   "dropped for (the driver ended episodes in a way this engine did not expect)")
            feeds.append(ids[len(seen) - 1 :])
        return feeds

    def _build(self, slots: list[int], feeds: list[list[int]], extra: int, device):
        """The round's cache, with the parked rows in place, and the first forward's inputs."""
        b, q = len(slots), max(len(f) for f in feeds)
        parked = [self.parked.pop(i, None) for i in slots]
        w = max((p.length for p in parked if p is not None), default=0)
        cache = new_decode_cache(self.model, extra + (q if w else 0))
        if cache is None:
            raise ValueError("generate_episodes: the model's KV cache is not plain full attention (sliding "
                             "windows, linear attention, ...); multi-turn generation keeps per-layer key/value "
                             "tensors across turns and does not support it")
        if w:
            layers = next(p for p in parked if p is not None)
            for layer in range(len(layers.keys)):
                k0, v0 = layers.keys[layer], layers.values[layer]
                keys = k0.new_zeros(b, k0.shape[0], w, k0.shape[-1])
                values = v0.new_zeros(b, v0.shape[0], w, v0.shape[-1])
                for row, p in enumerate(parked):
                    if p is not None and p.length:
                        keys[row, :, w - p.length :] = p.keys[layer]
                        values[row, :, w - p.length :] = p.values[layer]
                cache.update(keys, values, layer)
        ids = torch.full((b, q), self.pad, dtype=torch.long)
        mask = torch.zeros((b, w + q), dtype=torch.bool)
        for row, (p, f) in enumerate(zip(parked, feeds)):
            ids[row, q - len(f) :] = torch.tensor(f, dtype=torch.long)
            mask[row, w + q - len(f) :] = True
            if p is not None:
                mask[row, w - p.length : w] = True
        return cache, ids.to(device), mask.to(device), w

    def _park(self, cache, rows: torch.Tensor, attn: torch.Tensor, slots: list[int]) -> None:
        """Copies the real tokens of batch rows `rows` (slots: their episodes) out of the round's cache."""
        for row, i in zip(rows.tolist(), slots):
            real = attn[row].nonzero().squeeze(-1)  # the columns of its real tokens (not padding, not holes)
            keys = [layer.keys[row].index_select(1, real) for layer in cache.layers]
            values = [layer.values[row].index_select(1, real) for layer in cache.layers]
            self.parked[i] = _Parked(keys, values, len(real))
            self.stats["parked_tokens"] += len(real)

    def _continues(self, i: int, last: int, length: int) -> bool:
        """False when the driver is certain to end episode i after this turn (then its cache is not kept)."""
        return (last == self.end_id and self.turns[i] < self.driver.max_turns
                and length < self.driver.max_episode_tokens)

    def sample(self, requests: dict[int, tuple[list[int], int]]) -> dict[int, tuple[list[int], list[float]]]:
        """One turn for each request (episode -> (its ids so far, max new tokens)); episode -> (ids, log-probs)."""
        self.stats["rounds"] += 1
        for i in [i for i in self.parked if i not in requests]:  # ended after its last turn: free its cache
            del self.parked[i]
        slots = sorted(requests)
        requests = {i: requests[i] for i in slots}
        device = next(self.model.parameters()).device
        feeds = self._feeds(requests)
        caps = torch.tensor([requests[i][1] for i in slots], dtype=torch.long, device=device)
        max_cap = int(caps.max())
        fresh = all(i not in self.parked for i in slots)
        groups = _distinct(feeds) if fresh else None
        if groups is not None:  # the first turn: each distinct prompt prefilled once
            firsts, expand = groups
            cache, ids, mask, w = self._build([slots[k] for k in firsts], [feeds[k] for k in firsts], max_cap, device)
        else:
            cache, ids, mask, w = self._build(slots, feeds, max_cap, device)
        attn = mask.long()
        pos = position_ids(attn)
        cache, logits = self._forward(cache, ids, attn, pos[:, w:])
        next_pos = pos[:, -1] + 1
        if groups is not None and len(firsts) < len(slots):
            expand = expand.to(device)
            cache.batch_select_indices(expand)
            logits, attn, next_pos = logits[expand], attn[expand], next_pos[expand]
        n = len(slots)
        tokens = torch.full((n, max_cap), self.pad, dtype=torch.long, device=device)
        logps = torch.zeros((n, max_cap), dtype=torch.float32, device=device)
        steps = torch.zeros(n, dtype=torch.long, device=device)
        active = torch.arange(n, device=device)  # rows still decoding, in cache order
        for i in slots:
            self.turns[i] = self.turns.get(i, 0) + 1
        for t in range(max_cap):
            tok, lp = self._next_tokens(logits, slots, active)
            tokens[active, t], logps[active, t] = tok, lp
            done = (tok == self.end_id) | (caps[active] <= t + 1)
            steps[active[done]] = t + 1
            if bool(done.any()):
                # rows ending their turn leave the batch; their real tokens are parked first when the
                # episode may go on (the just-sampled id is not in the cache: it is fed next round)
                ended = done.nonzero().squeeze(-1)
                keep_rows = [r for r in ended.tolist() if self._continues(
                    slots[int(active[r])], int(tok[r]), len(requests[slots[int(active[r])]][0]) + t + 1)]
                if keep_rows:
                    rows = torch.tensor(keep_rows, dtype=torch.long, device=device)
                    self._park(cache, rows, attn, [slots[int(active[r])] for r in keep_rows])
                if bool(done.all()):
                    break
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
            cache, logits = self._forward(cache, tok[:, None], attn, next_pos[:, None])
            next_pos = next_pos + 1
        replies = {}
        tokens, logps, steps = tokens.tolist(), logps.tolist(), steps.tolist()
        for row, i in enumerate(slots):
            out = tokens[row][: steps[row]]
            replies[i] = (out, logps[row][: steps[row]])
            self.seen[i] = requests[i][0] + out
        return replies


def _distinct(feeds: list[list[int]]) -> tuple[list[int], torch.Tensor]:
    """(index of the first of each distinct feed, in order; [len(feeds)] the distinct feed of each)."""
    first: dict[tuple[int, ...], int] = {}
    firsts, expand = [], []
    for k, f in enumerate(feeds):
        key = tuple(f)
        if key not in first:
            first[key] = len(firsts)
            firsts.append(k)
        expand.append(first[key])
    return firsts, torch.tensor(expand, dtype=torch.long)
