"""SFT on agent episodes: scripted transcripts in the exact token layout of sampled episodes, and
supervised training on their policy tokens only.

    with agent_spec.build() as agent:
        episodes = scripted_episodes(tokenizer, agent, items, script)
    losses = sft_on_episodes(model, episodes, pad_id, steps=300, batch_size=32, lr=1e-3, seed=0)

`scripted_episodes` runs the agents package's `EpisodeDriver` (agents/driver.py) with a scripted
policy instead of a model: each policy turn is `script(messages so far, item)` encoded, then the
end-of-turn id. Environment replies and tool results are appended by the driver as the chat
template's deltas, exactly as when a model samples, so SFT on these episodes trains the same token
sequences (and the same turn boundaries) that GRPO later samples and scores.

`sft_on_episodes` minimises the negative log-likelihood of the policy tokens (Episode.policy_mask):
prompt, environment and tool tokens are context only and get no loss.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import torch

from grpolab.agents.driver import EpisodeDriver
from grpolab.agents.episode import Episode, to_tensors
from grpolab.algo.losses import agg_normalizer, aggregate
from grpolab.algo.optim import adamw, lr_lambda
from grpolab.forward.layouts import completion_logprobs

Script = Callable[[list[dict[str, Any]], Any], str]
"""(the episode's messages so far, the item) -> the text of the next assistant turn (no end-of-turn
token: it is added). The messages are the driver's transcript (Episode.messages): the opening
messages, then each assistant turn and environment or tool reply; the last one is what the policy
answers now."""


class _ScriptedDriver(EpisodeDriver):
    """An EpisodeDriver that remembers the item and the episode it is running, so that the scripted
    `generate` (which the driver hands only the ids) can read the episode's messages."""

    item: Any = None
    current: Episode | None = None

    def _policy_turn(self, ep: Episode, max_new_tokens: int) -> list[int]:
        self.current = ep
        return super()._policy_turn(ep, max_new_tokens)


def scripted_episodes(tokenizer: Any, agent: Any, items: Sequence[Any], script: Script,
                      end_of_turn: str | None = None) -> list[Episode]:
    """One episode per item, run by `agents.driver.EpisodeDriver` with `script` as the policy.

    agent: an `agents.agent.Agent` (its environment factory, tools and limits: `driver_kwargs()`).
    Each policy turn is tokenizer.encode(script(messages, item)) followed by the end-of-turn id
    (end_of_turn: its text; default tokenizer.eos_token), with sampler log-prob 0.0 per id; a turn
    longer than the driver's max_new_tokens is cut to it (the driver then records the episode as
    truncated, stop_reason "max_turn_tokens" or "max_episode_tokens"). Deterministic when `script`
    and the environment are. Returns the episodes in item order.
    """
    def generate(ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        text = script([dict(m) for m in driver.current.messages], driver.item)
        out = (list(tokenizer.encode(text, add_special_tokens=False)) + [driver.end_id])[:max_new_tokens]
        return out, [0.0] * len(out)

    driver = _ScriptedDriver(tokenizer, generate, end_of_turn=end_of_turn, **agent.driver_kwargs())
    episodes = []
    for item in items:
        driver.item = item
        episodes.append(driver.run(item))
        driver.current = None
    return episodes


def episode_nll(model, episodes: Sequence[Episode], pad_id: int, loss_agg: str = "token-mean",
                normalizer: torch.Tensor | None = None, compute_dtype=None, padding_free: bool = False) -> torch.Tensor:
    """The SFT loss of `episodes`: the negative log-likelihood of their policy tokens under `model`.

    The episodes go through one forward in the trainer's layout (agents.episode.to_tensors:
    input_ids [n, Lp + Lb]; forward.layouts.completion_logprobs, padding_free: the real tokens
    packed into one row, padding not computed, same values); the log-prob of each body token
    [n, Lb] is taken where policy_mask [n, Lb] is True and aggregated by `loss_agg`
    (algo.losses.AGGREGATIONS). "token-mean" (the mean over all policy tokens) is the maximum-
    likelihood fit of the transcripts' turn distributions; "seq-mean-token-mean" (each episode's
    mean, then the mean over episodes) down-weights every token of a long episode, which skews
    choices between turns of different lengths (e.g. a long tool call against a short answer).
    normalizer: the divisor for the whole batch when this is one microbatch of it
    (algo.losses.agg_normalizer over the whole batch's mask); default: this batch's own. Returns a
    differentiable scalar.
    """
    t = to_tensors(episodes, pad_id)
    device = next(model.parameters()).device
    logp, _ = completion_logprobs(model, t.input_ids.to(device), t.attention_mask.to(device), t.prompt_len,
                                  compute_dtype=compute_dtype, padding_free=padding_free)
    mask = t.policy_mask.to(device)
    if normalizer is None:
        normalizer = agg_normalizer(mask, loss_agg)
    return aggregate(-logp, mask, loss_agg, normalizer.to(device))


def sft_on_episodes(model, episodes: Sequence[Episode], pad_id: int, *, steps: int, batch_size: int, lr: float,
                    seed: int = 0, microbatch_size: int | None = None, loss_agg: str = "token-mean",
                    warmup_steps: int | None = None, lr_schedule: str = "cosine", weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), max_grad_norm: float = 1.0, compute_dtype=None, padding_free: bool = False,
                    on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Trains `model` in place on the policy tokens of `episodes`; returns each optimizer step's loss.

    One AdamW step per batch of `batch_size` episodes, drawn by walking seeded shuffles of
    `episodes` (random.Random(seed); reshuffled each pass). Loss: `episode_nll` (loss_agg as there),
    accumulated over microbatches of `microbatch_size` episodes (default: the whole batch) with the
    batch's normalizer fixed first, so the gradient does not depend on the microbatch size.
    Environment, tool and prompt tokens are context only: no loss, no gradient through their targets.
    padding_free: see `episode_nll` (it switches the model to grpolab's SDPA attention, which needs
    a model on SDPA attention).
    LR: linear warm-up over `warmup_steps` (default: steps // 20), then `lr_schedule`
    (algo.optim.LR_SCHEDULES); AdamW's `betas` and `weight_decay`. Gradients are clipped to `max_grad_norm`. Deterministic given `seed`
    and the model's initial weights. on_step(step, loss) is called after every step.
    """
    if not episodes or steps < 1 or batch_size < 1:
        raise ValueError(f"sft_on_episodes: need episodes, steps >= 1 and batch_size >= 1; got {len(episodes)} "
                         f"episodes, steps={steps}, batch_size={batch_size}")
    micro = microbatch_size or batch_size
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, lr=lr, weight_decay=weight_decay, betas=betas)
    warmup = steps // 20 if warmup_steps is None else warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(lr_schedule, warmup, steps))
    rng = random.Random(seed)
    order: list[int] = []
    losses = []
    was_training = model.training
    model.train()
    try:
        for step in range(steps):
            batch = []
            while len(batch) < batch_size:
                if not order:
                    order = list(range(len(episodes)))
                    rng.shuffle(order)
                batch.append(episodes[order.pop()])
            normalizer = agg_normalizer(to_tensors(batch, pad_id).policy_mask, loss_agg)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for start in range(0, batch_size, micro):
                loss = episode_nll(model, batch[start : start + micro], pad_id, loss_agg, normalizer, compute_dtype,
                                   padding_free)
                loss.backward()
                total += float(loss.detach())
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            sched.step()
            losses.append(total)
            if on_step is not None:
                on_step(step, total)
    finally:
        model.train(was_training)
    return losses
