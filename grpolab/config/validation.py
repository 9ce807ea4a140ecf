"""Validation of a whole config, and the allowed values of the enumerated fields.

The allowed values of the enumerated fields come from `field_choices()`, which reads the
registries of grpolab.algo for the loss variants: validation and the `grpolab config` reference
both use it, so a new registry entry is accepted and documented without editing this file.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from grpolab.errors import ConfigError


def _err(msg: str) -> ConfigError:
    return ConfigError(msg)


# Enumerated fields whose values are not a registry: dotted field -> allowed values.
FIXED_CHOICES: dict[str, tuple] = {
    "model.dtype": ("float32", "bfloat16", "auto"),
    "model.compile_scope": ("blocks", "model"),
    "train.on_reward_error": ("raise", "zero", "skip_group"),
    "train.parallel": ("ddp", "fsdp2"),
    "data.chat_template": ("auto", True, False),
    **{name: ("auto", True, False) for name in (
        "model.compile", "model.padding_free", "model.shared_prompt", "rollout.compile", "rollout.bf16_weights",
        "rollout.packed_weights", "train.keep_freed_memory")},  # auto: decided at setup (grpo/speed.py)
    "loss.multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),  # TRL's values
}

SFT_POLICY_LOSS = "sft"
"""loss.policy_loss value outside POLICY_LOSSES: supervised fine-tuning on offline data."""


def describe(entry: Any) -> str:
    """One line about a registry entry: its `doc` field, else the first sentence of its docstring."""
    doc = getattr(entry, "doc", None)
    if isinstance(doc, str):
        return doc
    text = " ".join((entry.__doc__ or "").split()) if callable(entry) else ""
    return text.split(". ")[0].rstrip(".")


def registry_choices() -> dict[str, dict[str, str]]:
    """Registry-backed fields: dotted field -> {allowed value: description}, read from the registries."""
    from grpolab.algo.advantages import ADVANTAGE_ESTIMATORS, STD_MODES
    from grpolab.algo.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
    from grpolab.algo.optim import LR_SCHEDULES
    from grpolab.rollout.engine import ENGINES

    policy = {k: describe(v) for k, v in POLICY_LOSSES.items()}
    policy[SFT_POLICY_LOSS] = "supervised fine-tuning on offline data: token cross-entropy, no rollouts"
    return {
        "loss.policy_loss": policy,
        "loss.advantage": {k: describe(v) for k, v in ADVANTAGE_ESTIMATORS.items()},
        "loss.std": {k: describe(v) for k, v in STD_MODES.items()},
        "loss.kl_estimator": {k: describe(v) for k, v in KL_ESTIMATORS.items()},
        "loss.loss_agg": {k: describe(v) for k, v in AGGREGATIONS.items()},
        "train.lr_schedule": {k: describe(v) for k, v in LR_SCHEDULES.items()},
        "rollout.engine": {k: describe(v) for k, v in ENGINES.items()},
    }


def field_choices() -> dict[str, tuple[str, ...]]:
    """Every enumerated field: dotted field -> allowed values (registry-backed ones first)."""
    out = {k: tuple(v) for k, v in registry_choices().items()}
    out.update(FIXED_CHOICES)
    return out


def get_field(cfg, dotted: str) -> Any:
    """cfg's value at a dotted path, e.g. get_field(cfg, "loss.kl_coef")."""
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _choice(value, allowed, field_name):
    if value not in allowed:
        close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        names = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in allowed)
        raise _err(f"{field_name}={value!r} is not one of {names}.{hint}")


def _check_shared_prompt(cfg) -> None:
    """model.shared_prompt forwards whole groups: every batch of rows must be whole groups."""
    g, t, world, mb = cfg.rollout.group_size, cfg.train, cfg.world_size, cfg.minibatch_sequences
    for name, v in (("train.minibatch_size", mb), ("train.microbatch_size", t.microbatch_size)):
        if v % g:
            raise _err(f"{name}={v} is not a multiple of rollout.group_size={g}, which model.shared_prompt=true "
                       f"needs (it forwards whole groups); set {name} to a multiple of {g}")
    if world > 1 and (mb // world) % g:
        raise _err(f"train.minibatch_size={mb} gives {mb // world} sequences per rank "
                   f"on {world} ranks, not whole groups of rollout.group_size={g} (model.shared_prompt=true); set "
                   f"train.minibatch_size to a multiple of {g * world}")


def _check_world(cfg, world: int) -> None:
    """Several ranks (torchrun's WORLD_SIZE): global batch sizes split evenly, features that run there."""
    r = cfg.rollout
    for name, v, unit in (("rollout.prompts_per_step", r.prompts_per_step, "prompts"),
                          ("train.minibatch_size", cfg.minibatch_sequences, "sequences")):
        if v % world:
            raise _err(f"{name}={v} does not split over the {world} ranks the launcher started (each rank takes "
                       f"{name.split('.')[1]} / world {unit}); set {name} to a multiple of {world}")
    if cfg.model.compile is True:
        raise _err(f"model.compile=true runs without a launcher only (not in the {world} rank(s) torchrun "
                   "started); set model.compile=false")
    if cfg.loss.policy_loss == SFT_POLICY_LOSS:
        raise _err("loss.policy_loss='sft' (grpolab sft) runs in one process; start it without torchrun / --nproc")
    ray_workers = [f"rollout.{n}={getattr(cfg.rollout, n)}" for n in ("workers", "reward_workers", "env_workers")
                   if getattr(cfg.rollout, n)]
    if world > 1 and ray_workers and not os.environ.get("GRPOLAB_RAY_TRAINER"):
        raise _err(f"{' and '.join(ray_workers)} start Ray actors, which ranks started by torchrun do not share "
                   f"(each would start a cluster of its own); run `grpolab train CONFIG ... --nproc {world} --ray`, "
                   "which places the trainer ranks and the workers on one Ray cluster, or set those to 0")


def _check_choices(cfg) -> None:
    for name, allowed in field_choices().items():
        _choice(get_field(cfg, name), allowed, name)
    r = cfg.rollout
    if cfg.model.compile_cpp_wrapper and cfg.model.compile is False:
        raise _err("model.compile_cpp_wrapper=true applies to compiled forwards; set model.compile=true too")
    if r.bf16_weights is True and cfg.model.dtype == "float32":
        raise _err("rollout.bf16_weights=true samples in bfloat16 but model.dtype='float32'; "
                   "set model.dtype=bfloat16 (or auto), or leave rollout.bf16_weights=false")
    if r.packed_weights is True and (r.compile is True or cfg.model.dtype == "bfloat16"):
        raise _err("rollout.packed_weights=true packs float32 weights for the eager decode loop; it does "
                   f"not combine with {'rollout.compile=true' if r.compile is True else 'model.dtype=bfloat16'}")


def _check_ranges(cfg) -> None:
    r, t, lo = cfg.rollout, cfg.train, cfg.loss
    positive = {
        "rollout.prompts_per_step": r.prompts_per_step, "rollout.group_size": r.group_size,
        "rollout.max_new_tokens": r.max_new_tokens, "train.epochs": t.epochs,
        "train.microbatch_size": t.microbatch_size,
        "sft.batch_size": cfg.sft.batch_size,
        "sft.microbatch_size": cfg.sft.microbatch_size, "train.max_skipped_steps": t.max_skipped_steps,
        "sft.probe_every": cfg.sft.probe_every, "sft.probe_prompts": cfg.sft.probe_prompts,
        "run.keep_checkpoints": cfg.run.keep_checkpoints,
        **{k: v for k, v in (("sft.examples", cfg.sft.examples), ("data.eval_prompts", cfg.data.eval_prompts))
           if v is not None},
    }
    for name, v in positive.items():
        if v < 1:
            raise _err(f"{name}={v} must be at least 1")
    nonneg = {"train.steps": t.steps, "loss.kl_coef": lo.kl_coef, "loss.clip_eps_low": lo.clip_eps_low,
              "loss.clip_eps_high": lo.clip_eps_high, "train.warmup_steps": t.warmup_steps,
              "train.max_grad_norm": t.max_grad_norm, "loss.entropy_coef": lo.entropy_coef,
              "sft.steps": cfg.sft.steps, "loss.std_eps": lo.std_eps, "run.threads": cfg.run.threads}
    for name, v in nonneg.items():
        if v < 0:
            raise _err(f"{name}={v} must be ≥ 0")
    if cfg.run.eval_every < 0:
        raise _err(f"run.eval_every={cfg.run.eval_every} must be ≥ 0 (0 = no evaluation during training)")
    if cfg.run.eval_every and cfg.train.parallel == "fsdp2":
        raise _err("run.eval_every evaluates the policy in each rank's process, which train.parallel=fsdp2 shards; "
                   "use ddp, or evaluate the checkpoints afterwards (grpolab eval)")
    if cfg.run.checkpoint_every < 0:
        raise _err(f"run.checkpoint_every={cfg.run.checkpoint_every} must be ≥ 0 (0 = only at the end)")
    if t.reward_timeout_s < 0:
        raise _err(f"train.reward_timeout_s={t.reward_timeout_s} must be ≥ 0 (0 = no limit)")
    if r.temperature <= 0:
        raise _err(f"rollout.temperature={r.temperature} must be > 0 (use a small value such as 1e-3 for near-greedy)")
    if not 0 < r.top_p <= 1:
        raise _err(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if t.lr <= 0:
        raise _err(f"train.lr={t.lr} must be > 0")
    if lo.dual_clip is not None and lo.dual_clip <= 1:
        raise _err(f"loss.dual_clip={lo.dual_clip} must be > 1 (typically 3), or null to turn it off")
    _check_loss_options(cfg)


def _check_loss_options(cfg) -> None:
    """The options of single loss variants: CISPO's cap, SAPO's temperatures, KL in the reward,
    normalize-then-sum."""
    lo = cfg.loss
    positive = {"loss.cispo_ratio_max": lo.cispo_ratio_max, "loss.sapo_temperature_pos": lo.sapo_temperature_pos,
                "loss.sapo_temperature_neg": lo.sapo_temperature_neg}
    for name, v in positive.items():
        if not v > 0:
            raise _err(f"{name}={v} must be > 0")
    if lo.kl_in_reward and not lo.kl_coef > 0:
        raise _err("loss.kl_in_reward=true subtracts loss.kl_coef × KL(π_old ‖ π_ref) from the rewards, but "
                   "loss.kl_coef=0 (no reference model); set loss.kl_coef > 0 (e.g. 0.001) or loss.kl_in_reward=false")
    if lo.multi_objective_aggregation == "normalize_then_sum" and cfg.rollout.group_size < 2:
        raise _err(f"loss.multi_objective_aggregation='normalize_then_sum' normalizes each reward within its group, "
                   f"but rollout.group_size={cfg.rollout.group_size}; set rollout.group_size ≥ 2 or use sum_then_normalize")


def _check_sizes(cfg) -> None:
    from grpolab.algo.advantages import ADVANTAGE_ESTIMATORS

    r, t, lo = cfg.rollout, cfg.train, cfg.loss
    if ADVANTAGE_ESTIMATORS[lo.advantage].needs_group and r.group_size < 2:
        raise _err(f"rollout.group_size={r.group_size}: loss.advantage={lo.advantage!r} compares completions "
                   "within a group, so group_size must be at least 2")
    n, mb = cfg.sequences_per_step, cfg.minibatch_sequences
    if t.minibatch_size < 0:
        raise _err(f"train.minibatch_size={t.minibatch_size} must be ≥ 1, or 0 for all sequences of a step")
    if n % mb:
        divs = [d for d in range(1, n + 1) if n % d == 0]
        raise _err(f"train.minibatch_size={mb} does not divide the {n} sequences of a step "
                   f"(rollout.prompts_per_step={r.prompts_per_step} × rollout.group_size={r.group_size}); "
                   f"set train.minibatch_size to one of {divs}")
    world = cfg.world_size
    if "WORLD_SIZE" in os.environ:  # started by torchrun, with one rank or more
        _check_world(cfg, world)
    if cfg.model.shared_prompt is True:
        _check_shared_prompt(cfg)
    if (mb // world) % t.microbatch_size:
        per_rank = mb // world
        divs = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        where = f" on each of {world} ranks" if world > 1 else ""
        raise _err(f"train.microbatch_size={t.microbatch_size} does not divide the {per_rank} sequences of a "
                   f"minibatch{where} (train.minibatch_size={mb}); set train.microbatch_size to one "
                   f"of {divs}")
    if cfg.sft.batch_size % cfg.sft.microbatch_size:
        raise _err(f"sft.batch_size={cfg.sft.batch_size} is not a multiple of sft.microbatch_size={cfg.sft.microbatch_size}")


def _check_outputs(cfg) -> None:
    import importlib.util

    if cfg.run.wandb_project and importlib.util.find_spec("wandb") is None:
        raise _err(f"run.wandb_project={cfg.run.wandb_project!r} logs to Weights & Biases, but the wandb package "
                   "is not installed: pip install wandb (or leave run.wandb_project empty)")


def _check_rewards(cfg) -> None:
    if not cfg.rewards and cfg.loss.policy_loss != SFT_POLICY_LOSS and not cfg.environment.name:
        raise _err("rewards: at least one reward function is needed (e.g. rewards: [{name: exact_match, weight: 1.0}])")
    names = [s.display_name for s in cfg.rewards]
    if len(set(names)) != len(names):
        raise _err(f"rewards: two reward functions share the name(s) {sorted({n for n in names if names.count(n) > 1})}; "
                   "give each a distinct label (e.g. label: accuracy_rm)")


def _check_dynamic_sampling(cfg) -> None:
    r, names = cfg.rollout, [spec.display_name for spec in cfg.rewards] + (["environment"] if cfg.environment.name else [])
    if r.max_generation_batches < 0:
        raise _err(f"rollout.max_generation_batches={r.max_generation_batches} must be ≥ 0 (0 = no limit)")
    if r.dynamic_sampling and r.group_size < 2:
        raise _err(f"rollout.dynamic_sampling=true drops groups whose rewards are all equal, as every group of "
                   f"rollout.group_size={r.group_size} is; set rollout.group_size ≥ 2")
    if r.dynamic_sampling_reward not in ("", *names):
        raise _err(f"rollout.dynamic_sampling_reward={r.dynamic_sampling_reward!r} is not one of this run's "
                   f"rewards {names}; name one, or leave it empty for their weighted sum")


def _check_workers(cfg) -> None:
    """rollout.workers / reward_workers / overlap (Ray) and loss.tis_cap."""
    r = cfg.rollout
    for name in ("workers", "reward_workers", "worker_gpus"):
        if getattr(r, name) < 0:
            raise _err(f"rollout.{name}={getattr(r, name)} must be ≥ 0")
    if r.reward_worker_threads < 1:
        raise _err(f"rollout.reward_worker_threads={r.reward_worker_threads} must be ≥ 1")
    if r.overlap < 0:
        raise _err(f"rollout.overlap={r.overlap} must be ≥ 0 (0 = off; K = the next K rollouts in flight, up to "
                   "K weight versions behind)")
    if r.overlap and not r.workers:
        raise _err(f"rollout.overlap={r.overlap} generates the next {r.overlap} rollouts while the trainer learns, "
                   "which needs rollout workers of their own: set rollout.workers ≥ 1")
    if r.overlap and r.dynamic_sampling:
        raise _err(f"rollout.overlap={r.overlap} prefetches one batch per step; rollout.dynamic_sampling draws as "
                   "many as it needs: turn one of them off")
    if not 0 < r.vllm_gpu_memory_utilization <= 1:
        raise _err(f"rollout.vllm_gpu_memory_utilization={r.vllm_gpu_memory_utilization} must be in (0, 1]")
    if cfg.loss.tis_cap < 0:
        raise _err(f"loss.tis_cap={cfg.loss.tis_cap} must be ≥ 0 (0 = off; e.g. 2)")


def _check_episodes(cfg) -> None:
    """environment / rollout.tools / max_turns / max_episode_tokens (multi-turn episodes)."""
    r, env = cfg.rollout, cfg.environment
    if r.max_turns < 1:
        raise _err(f"rollout.max_turns={r.max_turns} must be ≥ 1")
    if r.max_episode_tokens < 2:
        raise _err(f"rollout.max_episode_tokens={r.max_episode_tokens} must be ≥ 2")
    if r.tool_timeout_s < 0:
        raise _err(f"rollout.tool_timeout_s={r.tool_timeout_s} must be ≥ 0 (0 = each tool's own limit)")
    if env.name and ":" not in env.name:
        raise _err(f"environment.name={env.name!r}: expected 'pkg.mod:Class' (e.g. grpolab.agents.builtin:GuessNumber)")
    bad = [t for t in r.tools if ":" not in t]
    if bad:
        raise _err(f"rollout.tools: {bad} must be 'pkg.mod:fn' (e.g. grpolab.agents.builtin:calculator)")
    _check_env_workers(cfg)
    if env.name and "environment" in [s.display_name for s in cfg.rewards]:
        raise _err("rewards: the name 'environment' is the environment's reward; label that reward otherwise")
    if not cfg.episodes:
        if env.kwargs:
            raise _err("environment.kwargs is set but environment.name is empty: name the environment class")
        return
    if r.compile is True:
        raise _err("rollout.compile=true: episodes are decoded turn by turn with a dynamic KV cache, not the compiled "
                   "static one; set rollout.compile=auto or false")


def _check_env_workers(cfg) -> None:
    """rollout.env_workers / env_timeout_s / env_worker_threads (environments on Ray actors)."""
    r = cfg.rollout
    if r.env_workers < 0 or r.env_worker_threads < 1 or not r.env_timeout_s > 0:
        raise _err(f"rollout.env_workers={r.env_workers} must be ≥ 0, rollout.env_worker_threads="
                   f"{r.env_worker_threads} ≥ 1 and rollout.env_timeout_s={r.env_timeout_s} > 0 (seconds)")
    if not r.env_workers:
        return
    if not cfg.environment.name:
        raise _err(f"rollout.env_workers={r.env_workers} runs the environment on Ray actors, but no environment is "
                   "named: set environment.name, or rollout.env_workers=0")
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise _err(f"rollout.env_workers={r.env_workers} runs the environment on Ray actors, but ray is not "
                   "installed: pip install 'grpolab[ray]', or set rollout.env_workers=0")


def _check_rm_refresh(cfg) -> None:
    rc = cfg.rm_refresh
    if rc.every_steps < 0:
        raise _err(f"rm_refresh.every_steps={rc.every_steps} must be ≥ 0 (0 = off)")
    if not rc.every_steps:
        return
    if not rc.labeler:
        raise _err("rm_refresh.every_steps > 0 labels pairs of the policy's completions: name the preference "
                   "source in rm_refresh.labeler (a reward name or module:attr, e.g. exact_match)")
    for name in ("labels_per_refresh", "train_steps", "batch_size"):
        if getattr(rc, name) < 1:
            raise _err(f"rm_refresh.{name}={getattr(rc, name)} must be ≥ 1")
    if not rc.lr > 0 or not 0 <= rc.replay_share < 1:
        raise _err(f"rm_refresh.lr={rc.lr} must be > 0 and rm_refresh.replay_share={rc.replay_share} in [0, 1)")
    if cfg.rollout.reward_workers or cfg.rollout.overlap:
        raise _err("rm_refresh trains the reward models in the trainer process while they score; it does not run "
                   "with rollout.reward_workers or rollout.overlap: turn those off")


def _check_value_head(cfg) -> None:
    """loss.advantage=gae (PPO's value head): its options, and what it runs with."""
    from grpolab.algo.advantages import VALUE_BASED
    from grpolab.algo.losses import SEQUENCE_LEVEL

    lo, m = cfg.loss, cfg.model
    for name, v in (("loss.gae_gamma", lo.gae_gamma), ("loss.gae_lambda", lo.gae_lambda)):
        if not 0 <= v <= 1:
            raise _err(f"{name}={v} must be in [0, 1]")
    if lo.value_coef < 0 or (lo.value_clip is not None and lo.value_clip <= 0):
        raise _err(f"loss.value_coef={lo.value_coef} must be ≥ 0 and loss.value_clip={lo.value_clip} > 0 (or null)")
    if lo.advantage not in VALUE_BASED:
        return
    why = f"loss.advantage={lo.advantage!r} trains a value head on the policy's trunk"
    if lo.value_coef == 0:
        raise _err(f"{why}, but loss.value_coef=0 leaves it untrained; set loss.value_coef > 0 (e.g. 0.1)")
    if lo.policy_loss in SEQUENCE_LEVEL:
        raise _err(f"loss.policy_loss={lo.policy_loss!r} has one ratio per sequence; loss.advantage={lo.advantage!r} "
                   "gives one advantage per token: choose a token-level policy loss (e.g. clipped)")
    whole_model = m.compile is True and m.compile_scope == "model"
    for name, on in (("model.padding_free", m.padding_free), ("model.shared_prompt", m.shared_prompt),
                     ("model.compile_scope=model with model.compile", whole_model)):
        if on is True:
            raise _err(f"{why}, which reads the trunk's hidden states of padded rows: turn {name} off")
    if cfg.world_size > 1:
        raise _err(f"{why} in one process only; start it without torchrun / --nproc")


def _check_finite(node, where: str = "") -> None:
    """Every float field (at any depth, list elements included) is a finite number: nan and ±inf pass
    no range check (nan compares false both ways) and would surface as a model's error much later."""
    import dataclasses
    import math

    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            _check_finite(getattr(node, f.name), f"{where}.{f.name}" if where else f.name)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _check_finite(v, f"{where}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise _err(f"{where}={node}: expected a finite number")


def _check_lora(cfg) -> None:
    """PEFT's LoRA options: alpha > 0, dropout in [0, 1), target names that can name modules."""
    m = cfg.model
    if m.lora_alpha <= 0:
        raise _err(f"model.lora_alpha={m.lora_alpha} must be > 0")
    if not 0.0 <= m.lora_dropout < 1.0:
        raise _err(f"model.lora_dropout={m.lora_dropout} must be in [0, 1)")
    bad = [t for t in m.lora_targets if not t or any(c.isspace() for c in t)]
    if bad:
        raise _err(f"model.lora_targets={list(m.lora_targets)}: {bad[0]!r} is not a module name (e.g. q_proj)")
    if "all-linear" in m.lora_targets and len(m.lora_targets) > 1:
        raise _err("model.lora_targets: all-linear stands alone (every linear layer but the output head)")
    if (m.lora_targets or m.lora_dropout) and m.lora_rank == 0:
        raise _err("model.lora_targets / model.lora_dropout set but model.lora_rank=0 (no LoRA): set "
                   "model.lora_rank=8, say")


def check_eval(cfg) -> None:
    """The `eval:` section alone (the pipeline checks its own eval: with it)."""
    fields = cfg.eval.group_fields
    for f in fields:
        if not f.strip() or f != f.strip():
            raise _err(f"eval.group_by: {f!r} is not a field name (a data column, e.g. kind)")
    if len(set(fields)) < len(fields):
        raise _err(f"eval.group_by: {list(fields)} names a field twice")
    if fields and cfg.episodes:
        raise _err("eval.group_by: an agent run's episodes are not broken down by a field (yet); leave it empty")


def validate_config(cfg) -> None:
    """Raises ConfigError naming the field and the fix for an impossible setting."""
    _check_finite(cfg)
    _check_choices(cfg)
    _check_ranges(cfg)
    _check_sizes(cfg)
    _check_rewards(cfg)
    _check_dynamic_sampling(cfg)
    _check_value_head(cfg)
    _check_workers(cfg)
    _check_episodes(cfg)
    _check_rm_refresh(cfg)
    _check_lora(cfg)
    _check_outputs(cfg)
    check_eval(cfg)
