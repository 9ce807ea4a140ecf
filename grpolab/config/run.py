"""The `run:` section: output folder, logging, checkpoints, threads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunConfig:
    """The run directory, checkpoints, logging and the process."""

    out_dir: str = ""
    """Run directory; empty = a new folder under runs/."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0 = only at the end and on SIGTERM/SIGINT)."""
    keep_checkpoints: int = 2
    """Keep the last K checkpoints."""
    resume: str = ""
    """Continue from a checkpoint: '' = start fresh; 'auto' = the latest complete checkpoint in
    out_dir/checkpoints (a fresh start if there is none; `grpolab train ... --resume` sets this);
    or a path: a step-N checkpoint folder, or a run folder (its latest checkpoint)."""
    eval_every: int = 0
    """Every N steps (and after the last), evaluate the policy greedily on the held-out prompts (data.eval_source,
    or the built-in task's held-out split; data.eval_prompts of them) by the rewards, as `grpolab eval` does; the
    metrics row gets them as eval/KEY (grpolab.api callbacks: on_evaluate). 0 = off."""
    samples_every: int = 1
    """Write the step's groups to samples.jsonl every N steps."""
    tensorboard: bool = True
    """Write TensorBoard events under tb/."""
    wandb_project: str = ""
    """Also log every step's metrics to this Weights & Biases project (run files under the run
    directory); empty = off. Needs `pip install wandb`."""
    progress: bool = True
    """Show progress (rich on a terminal, plain lines otherwise)."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s used for model FLOP utilisation; 0 = measure a GEMM once at start."""
    threads: int = 0
    """torch intra-op CPU threads of this process; 0 = torch's default (one per core). On a machine
    shared with other torch processes use 1: more threads than free cores makes every step several
    times slower."""
