"""Builds everything a GRPO run needs from a Config, once, before the loop starts.

All choices (model, reference, loss variant, advantage estimator, rewards, prompt source) are
made here; the loop in grpo/loop.py only calls what this hands it. Up-front checks (reward names and
arguments, model path, prompt data) fail here, before any long work.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from dataclasses import dataclass, field
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable

import torch

from grpolab.algo.optim import adamw, lr_lambda
from grpolab.algo.advantages import VALUE_BASED, make_advantage_fn, zero_std_groups
from grpolab.config import Config, ConfigError
from grpolab.parallel.launch import step_seed
from grpolab.parallel.parallel import Parallel
from grpolab.report.progress import Progress
from grpolab.agents.agent import Agent, AgentSpec, probe_meta
from grpolab.agents.episode import EnvironmentReward
from grpolab.rewards.base import probe_rewards
from grpolab.rewards.registry import build_rewards
from grpolab.models.policy import load_policy
from grpolab.models.loading import resolve_compute_dtype
from grpolab.forward import LogProbForward
from grpolab.memory import keep_freed_memory
from grpolab.models.loading import frozen_copy
from grpolab.rollout.engine import Engine, build_engine
from grpolab.grpo.critic import Critic
from grpolab.grpo.compile_cache import use_persistent_cache
from grpolab.reward_models.refresh import RMRefresh
from grpolab.grpo.speed import resolve_speed
from grpolab.grpo.overlap import Prefetcher
from grpolab.grpo.objective import Objective, SkipEmptyRows, build_loss
from grpolab.grpo.critic import ValueLoss
from grpolab.grpo.signals import StopSignal
from grpolab.grpo.speed import Decision
from grpolab.grpo.stats import StepRecord
from grpolab.data.stream import PromptStream
from grpolab.rewards.base import RewardFn
from grpolab.rewards.pool import RewardPool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (e.g. too many non-finite steps); the message says why."""


def reference_factory(cfg: Config, policy, forward: LogProbForward,
                      parallel: Parallel | None = None) -> Callable | None:
    """A context-manager factory yielding the frozen reference model, or None without a KL.

    Full fine-tune: a frozen copy of the initial policy (taken before the policy is sharded), prepared
    for `forward` (with model.compile its torch.compile wrapper; `factory.model` is the plain copy,
    for checkpoints); with FSDP2 on several ranks it is sharded like the policy.
    LoRA: the policy with adapters disabled (no second copy is loaded; never compiled).
    """
    if not cfg.needs_reference:
        return None
    if cfg.model.lora_rank > 0:
        from grpolab.models.lora import reference_context

        return lambda: reference_context(policy)
    ref = frozen_copy(policy)
    if parallel is not None and parallel.shards_parameters:
        parallel.shard_module(ref)
    ref_module = forward.prepare(ref)

    @contextlib.contextmanager
    def ctx():
        yield ref_module

    ctx.model = ref  # type: ignore[attr-defined]
    return ctx


def check_prompt_lengths(cfg: Config, policy, tokenizer, prompts) -> None:
    """Up front: rollout.max_new_tokens fits the model's context, and every prompt of a finite
    source fits data.max_prompt_tokens and the room the completion leaves. Errors name the field,
    or the file and line (JSONL) / row (local dataset) of the first prompt that is too long."""
    ctx = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    limit, why = cfg.data.max_prompt_tokens, f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}"
    if ctx:
        room = ctx - cfg.rollout.max_new_tokens
        if room < 1:
            raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} leaves no room for a prompt in the "
                              f"model's context of {ctx} tokens (max_position_embeddings); lower it")
        if room < limit:
            limit, why = room, f"the model's context of {ctx} tokens minus rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
    items = getattr(prompts, "items", None)  # generated streams (builtin:arith) have no fixed list
    if not items:
        return
    lengths = [len(ids) for ids in tokenizer([it.prompt for it in items], add_special_tokens=False)["input_ids"]]
    bad = next((i for i, n in enumerate(lengths) if n > limit), None)
    if bad is None:
        return
    kind, _, path = cfg.data.source.partition(":")
    if kind in ("jsonl", "hf"):  # the loader's own check names the file and line / row
        from grpolab.data import sources
        from grpolab.data.build import source_options

        load = sources.load_jsonl if kind == "jsonl" else sources.load_hf_dataset
        try:
            load(path, prompt_field=cfg.data.prompt_field, messages_field=cfg.data.messages_field,
                 max_prompt_tokens=limit, **source_options(cfg, tokenizer))
        except ValueError as e:
            raise ValueError(f"{e} ({why})") from None
    raise ValueError(f"data.source={cfg.data.source!r}: prompt {bad} ({items[bad].prompt[:60]!r}) is {lengths[bad]} "
                     f"tokens long, more than {limit} ({why})")


ReferenceFactory = Callable[[], AbstractContextManager[torch.nn.Module]]
"""`reference_factory`'s result: a context manager yielding the frozen reference model."""
Hook = Callable[[int, dict, StepRecord], None]
"""Called after every step with (step, metrics row, the step's StepRecord)."""


@dataclass
class Models:
    """The networks of a run."""

    policy: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    train_model: torch.nn.Module | None = None
    """What the log-prob forwards call (Phase B, and Phase A's π_old pass): the policy, or its compiled
    wrapper (model.compile); same parameters."""
    reference: ReferenceFactory | None = None
    """The frozen reference model (a KL term), or None."""
    critic: Critic | None = None
    """PPO's value head on the policy's trunk (loss.advantage=gae); None otherwise."""

    def __post_init__(self) -> None:
        if self.train_model is None:
            self.train_model = self.policy


@dataclass
class Data:
    """What a step samples and scores (Phase A)."""

    prompts: PromptStream
    engine: Engine
    rewards: list[tuple[RewardFn, float]]
    """The config's reward functions and their weights."""
    sample_gen: torch.Generator
    """The sampling stream, seeded per step (`Setup.seed_step`)."""
    reward_pool: RewardPool | None = None
    """Ray reward workers that score the rollouts (rollout.reward_workers); None = score here."""
    prefetch: Prefetcher | None = None
    """rollout.overlap: the next steps' batches in flight (grpo.overlap.Prefetcher); None otherwise."""
    release_sampler: bool = False
    """FSDP2 with the local HF engine and no overlap: the engine's own weight copy is freed during
    Phase B (`HFEngine.release_weights`) and refilled by the sync after it."""
    agent: Agent | None = None
    """Agent runs (an environment or rollout.tools): the environment and tools episodes run with;
    None: single completions."""


@dataclass
class Optimisation:
    """What learns from a rollout (Phase B)."""

    forward: LogProbForward
    """The log-prob forward of Phase A's π_old / π_ref passes and Phase B's microbatches."""
    objective: Objective | SkipEmptyRows | ValueLoss
    advantage_fn: Callable[..., torch.Tensor]
    """`algo.advantages.make_advantage_fn`'s: [P, G] rewards (and an all-reduce) -> [P, G] advantages."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    shuffle_gen: torch.Generator
    """The minibatch shuffling stream, seeded per step (`Setup.seed_step`)."""


@dataclass
class Services:
    """What the run around the loop provides: ranks, progress, hooks, stop signal, RM refresh, figures."""

    parallel: Parallel = field(default_factory=Parallel)
    """The data-parallel group this rank belongs to (one process by default)."""
    progress: Progress | None = None
    hooks: list[Hook] = field(default_factory=list)
    stop: StopSignal | None = None
    """Its .requested ends the loop after the step."""
    rm_refresh: RMRefresh | None = None
    """rm_refresh.every_steps > 0: the iterated reward-model updates (reward_models.refresh.RMRefresh)."""
    speed: list[Decision] = field(default_factory=list)
    """The `auto` speed switches as decided for this run (grpo.speed.Decision); cfg holds their values."""
    peak_flops: float = 0.0
    n_params: int = 0


@dataclass
class Setup:
    """The components of one GRPO run (built by `build_setup`), in typed groups."""

    cfg: Config
    models: Models
    data: Data
    optim: Optimisation
    services: Services
    start_step: int = 0
    on_reward_error: str = "raise"
    consecutive_skips: int = 0

    def seed_step(self, step: int) -> None:
        """Seeds this step's sampling and shuffling streams from (train.seed, rank, step)."""
        seed, rank = self.cfg.train.seed, self.services.parallel.rank
        self.data.sample_gen.manual_seed(step_seed(seed, rank, step, "sample"))
        self.optim.shuffle_gen.manual_seed(step_seed(seed, rank, step, "shuffle"))

    def train_mask(self, ro, rewards: torch.Tensor) -> torch.Tensor:
        """The loss mask of Phase B: completion tokens, minus truncated completions and zero-std
        groups when the config says so."""
        mask = ro.loss_mask
        if self.cfg.loss.mask_truncated:
            mask = mask & ~ro.truncated.unsqueeze(-1)
        if self.cfg.loss.filter_zero_std_groups:
            flat = zero_std_groups(rewards.view(-1, ro.group_size)).repeat_interleave(ro.group_size)
            mask = mask & ~flat.unsqueeze(-1)
        return mask

    def optimizer_step(self, st, loss_sum: float) -> None:
        """Clip, then step — or skip the step when the loss or gradient is not finite."""
        max_norm = self.cfg.train.max_grad_norm or float("inf")
        params = trainable_parameters(self.models.policy, self.models.critic)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # the global norm, sharded grads included
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not (math.isfinite(norm) and math.isfinite(loss_sum)):
            self.optim.optimizer.zero_grad(set_to_none=True)
            st.skipped += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.cfg.train.max_skipped_steps:
                raise TrainingStopped(
                    f"{self.consecutive_skips} consecutive optimizer steps had a non-finite loss or gradient "
                    f"(loss {loss_sum}, grad norm {norm}); stopping. Lower train.lr or check the rewards "
                    "(train.max_skipped_steps sets the limit)."
                )
        else:
            self.optim.optimizer.step()
            self.consecutive_skips = 0
            st.grad_norms.append(norm)
            st.losses.append(loss_sum)
        self.optim.scheduler.step()

    def after_step(self, step: int, row: dict, record) -> None:
        """Calls every hook as hook(step, row, record): the metrics row and the step's StepRecord
        (every rank's groups)."""
        if self.services.progress is not None:
            self.services.progress.step_done(step + 1, {k: row[k] for k in ("reward/mean", "kl") if k in row})
        for hook in self.services.hooks:
            hook(step, row, record)

    def prompt_state(self) -> dict:
        """The prompt stream's state for a checkpoint: before the prefetched steps' prompts (rollout.overlap)."""
        held = self.data.prefetch.prompt_state if self.data.prefetch is not None else None
        return held if held is not None else self.data.prompts.state_dict()

    def close(self) -> None:
        """Ends what the run started besides this process: the prefetch thread, Ray workers, the tool worker."""
        for part in (self.data.prefetch, self.data.reward_pool, self.data.engine, self.data.agent):
            if hasattr(part, "close"):
                part.close()

    def should_stop(self) -> bool:
        """A stop was requested (SIGTERM/SIGINT) on this rank or any other: all ranks stop together."""
        return self.services.parallel.any(self.services.stop is not None and self.services.stop.requested)

    def mfu(self, row: dict) -> float:
        """Model FLOP utilisation of the step: 2·N FLOPs per generated or scored token forward,
        6·N per trained token (forward + backward), against `peak_flops` (0 → reported as 0)."""
        if not self.services.peak_flops:
            return 0.0
        fwd_tokens = row["len/mean"] * self.cfg.sequences_per_step
        passes = (1 if self.cfg.needs_old_logp_pass else 0) + (1 if self.models.reference is not None else 0)
        train_tokens = fwd_tokens * self.cfg.train.epochs
        flops = 2 * self.services.n_params * fwd_tokens * (1 + passes) + 6 * self.services.n_params * train_tokens
        return flops / max(row["time/step_s"], 1e-9) / self.services.peak_flops


def trainable_parameters(policy, critic: Critic | None = None) -> list[torch.nn.Parameter]:
    """What the optimizer trains and the gradient clip measures: the policy's parameters that need a
    gradient, then the value head's (PPO)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    return params + (list(critic.head.parameters()) if critic is not None else [])


def rollout_engine(cfg: Config, policy, tokenizer, dtype, parallel: Parallel) -> Engine:
    """Phase A's engine: rollout.engine in this process, or on rollout.workers Ray actors."""
    if cfg.rollout.workers:
        from grpolab.rollout.ray_engine import build_ray_engine

        return build_ray_engine(cfg, policy, tokenizer, parallel)
    return build_engine(cfg, policy, tokenizer, dtype)


def reward_pool(cfg: Config, rewards: list, parallel: Parallel):
    """Ray reward workers (rollout.reward_workers), or None: the rewards are scored in this process."""
    if not cfg.rollout.reward_workers:
        return None
    from grpolab.rewards.pool import build_reward_pool

    return build_reward_pool(cfg, rewards, parallel)


def build_setup(cfg: Config, policy=None, tokenizer=None, prompts=None, progress=None,
                parallel: Parallel | None = None) -> Setup:
    """Builds a Setup; pass a policy/tokenizer (e.g. the SFT'd π0) or let cfg.model load one.

    parallel: this rank's data-parallel group (`parallel.launch.init_parallel`); one process without it.
    With DDP, Phase B calls the DDP wrapper; with FSDP2 the policy (and the reference) are sharded in
    place, and the rollout engine samples from a full copy that `engine.load_weights` refreshes."""
    cfg.validate()
    rewards = build_rewards(cfg)
    spec = AgentSpec.from_config(cfg)
    if cfg.environment.name:  # the environment's reward, weighted beside the reward functions
        rewards.append((EnvironmentReward(), cfg.environment.reward_weight))
    agent = spec.build() if spec.active else None  # checked before any model is loaded
    if policy is None:
        policy, tokenizer = load_policy(cfg)
    policy.train()
    dtype = resolve_compute_dtype(cfg.model.dtype, cfg.model.device)
    parallel = parallel or Parallel()
    cfg, speed = resolve_speed(cfg, policy, dtype)  # the `auto` switches, decided once for this run
    if cfg.model.compile or cfg.rollout.compile:
        use_persistent_cache()
    forward = LogProbForward.from_config(cfg, dtype)
    train_model = forward.prepare(policy)  # attention switched now, before any rollout
    reference = reference_factory(cfg, policy, forward, parallel)  # copied before the policy is sharded
    sampler = frozen_copy(policy) if parallel.shards_parameters else policy
    if parallel.active:
        train_model = parallel.wrap(policy)
    if prompts is None:
        from grpolab.data.build import prompt_stream

        prompts = prompt_stream(cfg, tokenizer)
    check_prompt_lengths(cfg, policy, tokenizer, prompts)
    state, first = prompts.state_dict(), prompts.next_batch(2)  # peek: the cursor is put back
    prompts.load_state_dict(state)
    metas = [probe_meta(it, cfg.rollout.max_new_tokens) if cfg.episodes else {**it.meta, "truncated": False}
             for it in first]
    probe_rewards(rewards, [it.prompt for it in first], metas, cfg.train.on_reward_error)
    critic = Critic.from_config(cfg.loss, policy, forward) if cfg.loss.advantage in VALUE_BASED else None
    params = trainable_parameters(policy, critic)
    opt = adamw(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, cfg.train.adam_beta2))
    total = cfg.train.steps * cfg.optimizer_steps_per_step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train.lr_schedule, cfg.train.warmup_steps, total))
    device = next(policy.parameters()).device
    if cfg.train.keep_freed_memory and device.type == "cpu":
        keep_freed_memory()
    engine = rollout_engine(cfg, sampler, tokenizer, dtype, parallel)
    pool = reward_pool(cfg, rewards, parallel)
    prefetch = Prefetcher(cfg.rollout.overlap) if cfg.rollout.overlap else None
    objective = build_loss(cfg.loss, cfg.rollout, forward, critic)
    advantage_fn = make_advantage_fn(cfg.loss.advantage, cfg.loss.std, cfg.loss.std_eps)
    release = parallel.shards_parameters and not cfg.rollout.overlap and not cfg.rollout.workers and cfg.rollout.engine == "hf"
    data = Data(prompts, engine, rewards, torch.Generator(device=device).manual_seed(cfg.train.seed), pool, prefetch,
                release_sampler=release, agent=agent)
    optim = Optimisation(forward, objective, advantage_fn, opt, sched, torch.Generator().manual_seed(cfg.train.seed + 1))
    services = Services(parallel, progress if progress is not None else Progress(cfg.train.steps, enabled=False),
                        peak_flops=cfg.run.peak_tflops * 1e12, n_params=sum(p.numel() for p in policy.parameters()),
                        rm_refresh=build_rm_refresh(cfg, rewards), speed=speed)
    return Setup(cfg=cfg, models=Models(policy, tokenizer, train_model, reference, critic), data=data, optim=optim,
                 services=services, on_reward_error=cfg.train.on_reward_error)


def build_rm_refresh(cfg, rewards: list, run_dir: Path | None = None) -> RMRefresh | None:
    """The run's RMRefresh (None when rm_refresh.every_steps is 0): the reward_model rewards named by
    rm_refresh.rewards (all of them when empty; an ensemble's members each), and the labeler."""
    rc = cfg.rm_refresh
    if not rc.every_steps:
        return None
    from grpolab.rewards.registry import build_reward
    from grpolab.rewards.reward_model import RewardModelEnsemble, RewardModelReward

    targets: dict[str, Any] = {}
    for fn, _w in rewards:
        if rc.rewards and fn.name not in rc.rewards:
            continue
        if isinstance(fn, RewardModelReward):
            if fn.info.get("kind") == "process" and rc.rewards:
                raise ValueError(f"rm_refresh.rewards: {fn.name!r} is a process RM (a label per step); rm_refresh "
                                 "trains pairwise reward models")
            if fn.info.get("kind") != "process":
                targets[fn.name] = fn
        elif isinstance(fn, RewardModelEnsemble):
            targets.update({f"{fn.name}/{i}": m for i, m in enumerate(fn.members)})
    missing = [n for n in rc.rewards if not any(t == n or t.startswith(n + "/") for t in targets)]
    if missing:
        raise ValueError(f"rm_refresh.rewards: {missing} are not reward_model / reward_model_ensemble rewards of "
                         f"this run ({[fn.name for fn, _ in rewards]})")
    labeler = build_reward(rc.labeler, **rc.labeler_kwargs)
    return RMRefresh(rc, targets, labeler, cfg.train.seed, run_dir)
