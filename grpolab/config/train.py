"""The `train:` section: steps, Phase B's batch sizes, the optimizer, seeds, error handling."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    """Phase B and the run's schedule: batch sizes, optimizer, seeds, reward errors."""

    steps: int = 50
    """GRPO steps (one Phase A + one Phase B each)."""
    epochs: int = 1
    """μ: passes of Phase B over each rollout batch."""
    minibatch_size: int = 64
    """Sequences per optimizer step; 0 = all sequences of the step (one optimizer step per epoch:
    fully on-policy, what the presets without an importance ratio use)."""
    microbatch_size: int = 32
    """Sequences per forward/backward on one rank (gradients accumulate up to a minibatch): a memory
    knob of each device, so it is per rank, while minibatch_size counts the whole minibatch."""
    keep_freed_memory: bool | str = "auto"
    """CPU with glibc: keep freed memory in the process between phases instead of handing it back to
    the OS (no malloc_trim after the rollout and the no-grad passes; glibc's mmap and trim thresholds
    at 1 GiB), so Phase B reuses pages instead of page-faulting them in again. Trades a few percent
    more peak RSS for less time per step, most where page faults are expensive (VMs). Process-wide
    once set (grpolab.memory.keep_freed_memory). auto: on a CPU, except under FSDP2 on several ranks
    (the gathered layers it frees would stay in every rank's peak)."""
    parallel: str = "ddp"
    """Data-parallel strategy when the launcher (torchrun) starts several ranks: ddp (every rank holds
    the whole model and optimizer) or fsdp2 (parameters, gradients and optimizer state sharded over
    ranks, `fully_shard` per decoder layer). Ignored in one process. The world size is the launcher's;
    batch sizes stay global counts (see microbatch_size for the one per-rank size)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta2: float = 0.999
    """AdamW β2."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip; 0 = off."""
    warmup_steps: int = 0
    """Linear warm-up in optimizer steps."""
    lr_schedule: str = "constant"
    """Learning-rate decay after the warm-up, over all optimizer steps (a key of algo.optim.LR_SCHEDULES)."""
    seed: int = 0
    """Seed of sampling, shuffling and initialisation."""
    max_skipped_steps: int = 3
    """Stop after this many consecutive optimizer steps skipped for a non-finite loss or gradient."""
    on_reward_error: str = "raise"
    """What a reward function that raises does: raise | zero (scores 0) | skip_group (abstains)."""
    reward_timeout_s: float = 600.0
    """Wall-clock limit of one reward call on one step's batch; over it the call counts as an error
    (see on_reward_error). 0 = no limit. A hung Python call cannot be killed: it keeps a thread busy."""
