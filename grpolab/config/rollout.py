"""The `rollout:` section: Phase A's sampling: sizes, engine, workers, overlap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutConfig:
    """Phase A: sampling completions from the policy."""

    prompts_per_step: int = 16
    """P: prompts per training step (Phase A batch)."""
    group_size: int = 8
    """G: completions sampled per prompt."""
    max_new_tokens: int = 16
    """Longest completion in tokens; longer ones are cut and flagged truncated."""
    temperature: float = 1.0
    """Sampling temperature (also used for the log-probs of the training loss)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    engine: str = "hf"
    """Generation engine of Phase A, a key of rollout.engine.ENGINES (see the choices below)."""
    compile: bool | str = "auto"
    """hf engine: decode with a static KV cache and a torch.compile'd step (rollout/static.py).
    Pays on small models whose decode step is overhead-bound, not on larger ones; each new (rows,
    prompt width bucket) compiles once (tens of seconds), and finished rows keep decoding instead
    of leaving the batch. auto: as model.compile, by the same rule (`compile_pays`)."""
    bf16_weights: bool | str = "auto"
    """hf engine, bf16 compute: sample from a bfloat16 copy of the policy's weights, made at the start
    of each rollout and freed after it. Pays with rollout.compile, whose compiled step otherwise
    re-casts the float32 weights at every step; the eager loop casts once per rollout anyway. The
    sampler then differs from π_old's forward by bf16 rounding, as a vLLM sampler does; the loss
    still takes log π_old from the training forward. Rejected with model.dtype=float32; ignored
    when model.dtype=auto resolves to float32 (a CPU without bf16). auto: on with a compiled decode
    in bf16."""
    packed_weights: bool | str = "auto"
    """hf engine, float32 on a CPU, eager loop: the decode's linear layers multiply by oneDNN-packed
    copies of their weights, made at the start of each rollout and freed after it (rollout/packed.py).
    Pays where the decode's products are skinny against large weights (models of ~100M parameters
    and up), not on tiny ones; costs the linear weights' size again in memory during the rollout.
    Rejected with rollout.compile=true and model.dtype=bfloat16; ignored when model.dtype=auto
    resolves to bfloat16, and on a GPU. auto: on for models of hidden size ≥ 512 (float32, eager decode,
    CPU)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025; verl's algorithm.filter_groups.enable): groups with all
    rewards equal are dropped and more batches of prompts_per_step prompts generated until
    prompts_per_step groups with unequal rewards are kept (grpo/dynamic_sampling.py). Needs group_size ≥ 2."""
    dynamic_sampling_reward: str = ""
    """The reward whose spread decides (verl's filter_groups.metric): empty = the weighted sum (verl's
    seq_reward), or one reward's name or label, e.g. the verifier (verl's acc) beside an overlong reward."""
    max_generation_batches: int = 10
    """Most batches generated in a step, the first included (verl's max_num_gen_batches; 0 = no limit). verl
    raises there; here the earliest dropped groups fill the batch (a console note; see loss.filter_zero_std_groups)."""
    workers: int = 0
    """Rollout workers: 0 = generate in the training process; N = N Ray actors, each running rollout.engine on
    its own copy of the weights (synced after every optimizer phase), whole groups spread over them. Starts a
    local Ray cluster unless `grpolab train --ray ADDRESS` names one (grpolab/rollout/ray_engine.py)."""
    worker_gpus: float = 0.0
    """GPUs per rollout worker: 0 on CPUs; 1 = a GPU of its own (separate mode); a fraction shares a GPU
    with the trainer ranks (colocated mode; a vLLM engine sleeps while the trainer learns)."""
    reward_workers: int = 0
    """Ray actors that score the rewards (0 = in the training process): each group is scored in a call of
    its own, spread over the workers, so a slow verifier or sandbox runs in parallel."""
    reward_worker_threads: int = 8
    """Reward calls one reward worker runs at once."""
    overlap: int = 0
    """K ≥ 1 = the next K steps' rollouts are generated (and scored) while this step learns, each by the
    weights the workers hold when it is submitted: up to K weight versions behind (`rollout/staleness`;
    TRL's max_staleness, NeMo RL's max_trajectory_age_steps); the importance ratio then uses the
    sampler's log-probs (the behaviour policy's). 0 = off. Needs rollout.workers ≥ 1 (grpo/overlap.py)."""
    tools: tuple[str, ...] = ()
    """Tools the policy may call during an episode, as 'pkg.mod:fn' (typed, documented functions; see
    grpolab/agents/tools.py). With tools or an `environment`, Phase A samples multi-turn episodes."""
    max_turns: int = 1
    """Episodes: the most policy turns; an episode still going after them is cut (truncated). A turn is
    at most max_new_tokens tokens."""
    max_episode_tokens: int = 1024
    """Episodes: the most tokens of prompt, policy turns and environment replies together; an episode
    that reaches it is cut (truncated)."""
    tool_timeout_s: float = 0.0
    """Episodes: wall-clock limit of every tool call in seconds (0 = each tool's own `timeout_s`
    attribute, else 10 s). A call past it is killed and the model is told."""
    env_workers: int = 0
    """Episodes: 0 = the environment's reset and step run in the process that runs the episodes; N = in N Ray
    actors (grpolab/agents/envworkers.py), each episode's environment on one of them, the calls of a batch's
    episodes at the same time, so a slow environment does not hold the others. Needs an `environment`."""
    env_timeout_s: float = 60.0
    """Episodes with env_workers: wall-clock limit of one environment call (reset or step) in seconds. A call
    past it ends its episode as an environment error (train.on_reward_error applies; episode/env_errors
    counts it) and its actor is replaced when the batch ends."""
    env_worker_threads: int = 32
    """Episodes with env_workers: environment calls one env worker runs at once. A call's time limit runs
    from when it is sent, a wait for a free thread included: keep it ≥ the episodes per env worker
    (prompts_per_step × group_size / env_workers, per process that runs episodes)."""
    vllm_gpu_memory_utilization: float = 0.5
    """vllm engine: share of the GPU's memory vLLM may take (weights and KV cache)."""
    vllm_sleep: bool = True
    """vllm engine: release the KV cache and offload the weights while the trainer learns (colocated mode)."""
