"""Configuration: frozen nested dataclasses, presets of the SFT-to-GRPO spectrum, YAML, overrides.

Every size carries its unit in its name; `minibatch_size` and `microbatch_size` count sequences
(completions), never prompts. Derived sizes are properties. Nothing here is mutated after
construction: overrides build a new Config. `validate()` rejects impossible settings at start-up
with a message naming the field and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpolab import config_io
from grpolab.errors import ConfigError

__all__ = ["Config", "ConfigError", "DataConfig", "LossConfig", "ModelConfig", "PRESETS", "RewardSpec", "RolloutConfig",
           "RunConfig", "SFTConfig", "TrainConfig", "dump", "from_preset", "load"]


@dataclass(frozen=True)
class ModelConfig:
    """The policy model, and how its log-prob forwards run."""

    name_or_path: str = "builtin:tiny"
    """Policy model: 'builtin:tiny' (built locally), an HF folder, a hub id 'org/name' (from the Hugging
    Face cache, downloaded when online), a .gguf file, or 'smollm2-135m-instruct'."""
    dtype: str = "auto"
    """Compute dtype: auto (bfloat16 where the CPU or GPU computes it natively: AVX512-BF16 / AMX, or a
    CUDA GPU with bf16; else float32); float32; bfloat16 (autocast, master weights stay float32)."""
    device: str = "cpu"
    """Torch device for the policy, e.g. cpu or cuda."""
    hidden_size: int = 128
    """builtin:tiny only: hidden width."""
    num_layers: int = 4
    """builtin:tiny only: transformer layers."""
    num_heads: int = 4
    """builtin:tiny only: attention heads."""
    lora_rank: int = 0
    """LoRA rank through PEFT; 0 = full fine-tune. With LoRA the reference is the base with adapters off."""
    lora_alpha: float = 16.0
    """LoRA scaling alpha."""
    compile: bool | str = "auto"
    """torch.compile the log-prob forwards: the policy's training forward (Phase B) and the no-grad
    π_old / π_ref passes of Phase A (a LoRA reference stays eager), per model.compile_scope. Shapes
    are dynamic, so widths that change from step to step do not recompile. The first step pays the
    compilation (seconds from the persistent compile cache, about a minute cold on a CPU); later steps
    are faster, most on small models whose forward is overhead-bound, at a small cost in peak memory.
    auto: on only where the planned run recovers the compile time (train/speed.py: `compile_pays`)."""
    compile_scope: str = "blocks"
    """With model.compile: 'blocks' compiles each transformer block (decoder layer) and runs the rest
    eagerly; all blocks share one graph, so compilation time does not grow with depth. 'model'
    compiles the whole model as one graph, which takes much longer to compile on deep models. A
    model whose blocks are not found (no `_no_split_modules`) is compiled whole."""
    compile_cpp_wrapper: bool = False
    """With model.compile: inductor's C++ wrapper calls the compiled kernels without Python in
    between. Pays on small models whose graphs are many short kernels; on deep models compiling the
    generated C++ can take too long to be practical, so it is off by default. Needs model.compile."""
    padding_free: bool | str = "auto"
    """The log-prob forwards (Phase B's training microbatches, Phase A's π_old / π_ref passes) pack
    each chunk's real tokens into one row: the linear layers and the LM head compute no padding, and
    attention stays within each original row (short rows in bf16 on a CPU go through
    forward/padded_attention.py, longer ones through one SDPA call each). Same log-probs up to the
    compute dtype's rounding. Chunks are cut to about equal real tokens
    (`forward.buckets.balanced_buckets`) and padded to a few fixed sizes, so kernels built per
    matrix size are reused. Pays when rows differ much in length. Needs SDPA attention without a
    sliding window; combines with model.compile (the row maps are graph inputs). auto: on a CPU in
    bf16, and in float32 where rows fit one padded attention call (data.max_prompt_tokens +
    rollout.max_new_tokens ≤ 128) or the model is ≥ 512 wide; off on GPUs (untested there)."""
    shared_prompt: bool | str = "auto"
    """The log-prob forwards compute each group's prompt once instead of G times: a group goes through
    the model as one row [prompt | completion 1 | ... | completion G], and attention keeps each
    completion to its prompt and itself (forward/shared_prompt.py). Same log-probs up to the compute
    dtype's rounding. With model.padding_free too, one row of the batch's distinct real tokens:
    neither padding nor prompt copies are computed. Pays when prompts are long next to completions;
    with short prompts it gains little. Phase B shuffles whole groups and cuts minibatches and
    microbatches in whole groups, so train.minibatch_size and train.microbatch_size must be
    multiples of rollout.group_size. Needs SDPA attention without a sliding window. auto: on a CPU when
    every optimizer step takes the whole batch (one minibatch per epoch: drawing groups instead of rows
    then changes nothing) and the microbatches can be whole groups; off on GPUs (untested there)."""


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from, and the held-out split."""

    source: str = "builtin:arith"
    """Prompt source: 'builtin:arith', 'jsonl:PATH', 'hf:PATH' (local datasets files) or 'rg:TASK' (reasoning-gym)."""
    eval_prompts: int = 256
    """Held-out prompts for evaluation (never trained on)."""
    eval_source: str = ""
    """Held-out prompts of `grpolab eval` (the forms of source); empty: builtin:arith's held-out split.
    Other sources need it: their prompts are all training prompts. The first eval_prompts are used."""
    system_prompt: str | None = None
    """System prompt for chat templates; None keeps the template's own default."""
    chat_template: bool | str = "auto"
    """jsonl/hf/rg prompts through the tokenizer's chat template: auto (when the tokenizer has one),
    true (required: an error when it has none), false (the prompt text as it is; chat messages are
    then an error)."""
    prompt_field: str = "prompt"
    """jsonl/hf rows: the field holding the prompt text."""
    messages_field: str = "messages"
    """jsonl/hf rows: the field holding chat messages (a list of {role, content}), instead of a prompt."""
    response_field: str = "response"
    """SFT rows (`grpolab sft` on jsonl/hf): the field holding the response to a prompt_field row (a
    messages row's response is its last, assistant, message)."""
    max_prompt_tokens: int = 256
    """Longest prompt accepted; longer prompts are reported with their file and line."""
    seed: int = 0
    """Seed of the held-out split (the prompt stream follows train.seed)."""
    arith_ops: str = "+-"
    """builtin:arith: operations of the answerable prompts (subset of +-*/)."""
    arith_answer_lsb_first: bool = True
    """builtin:arith: answers written least-significant digit first ("37+45=" -> "28"), the order in
    which small transformers learn carrying; False writes them as usual."""
    arith_unanswerable_share: float = 0.25
    """builtin:arith: share of unanswerable prompts (division by zero, missing operand) in GRPO batches and eval."""
    arith_eval_fraction: float = 0.2
    """builtin:arith: share of the fact space held out for evaluation, never trained on."""


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
    prompts_per_step groups with unequal rewards are kept (train/dynamic_sampling.py). Needs group_size ≥ 2."""
    dynamic_sampling_reward: str = ""
    """The reward whose spread decides (verl's filter_groups.metric): empty = the weighted sum (verl's
    seq_reward), or one reward's name or label, e.g. the verifier (verl's acc) beside an overlong reward."""
    max_generation_batches: int = 10
    """Most batches generated in a step, the first included (verl's max_num_gen_batches; 0 = no limit). verl
    raises there; here the earliest dropped groups fill the batch (a console note; see loss.filter_zero_std_groups)."""
    workers: int = 0
    """Rollout workers: 0 = generate in the training process; N = N Ray actors, each running rollout.engine on
    its own copy of the weights (synced after every optimizer phase), whole groups spread over them. Starts a
    local Ray cluster unless `grpolab train --ray ADDRESS` names one (grpolab/dist/ray_engine.py)."""
    worker_gpus: float = 0.0
    """GPUs per rollout worker: 0 on CPUs; 1 = a GPU of its own (separate mode); a fraction shares a GPU
    with the trainer ranks (colocated mode; a vLLM engine sleeps while the trainer learns)."""
    reward_workers: int = 0
    """Ray actors that score the rewards (0 = in the training process): each group is scored in a call of
    its own, spread over the workers, so a slow verifier or sandbox runs in parallel."""
    reward_worker_threads: int = 8
    """Reward calls one reward worker runs at once."""
    overlap: int = 0
    """1 = the next step's rollout is generated (and scored) while this step learns, one weight version
    behind; the importance ratio then uses the sampler's log-probs (the behaviour policy's). Needs
    rollout.workers ≥ 1."""
    vllm_gpu_memory_utilization: float = 0.5
    """vllm engine: share of the GPU's memory vLLM may take (weights and KV cache)."""
    vllm_sleep: bool = True
    """vllm engine: release the KV cache and offload the weights while the trainer learns (colocated mode)."""


@dataclass(frozen=True)
class LossConfig:
    """The training objective: policy loss, advantages, KL penalty, aggregation."""

    policy_loss: str = "clipped"
    """The per-token policy objective (a key of algo.losses.POLICY_LOSSES), or sft: supervised
    fine-tuning on offline data instead of GRPO."""
    advantage: str = "group_norm"
    """How each completion's reward becomes its advantage (a key of algo.advantages.ADVANTAGE_ESTIMATORS)."""
    std: str = "sample"
    """How loss.advantage=group_norm scales the centred rewards (a key of algo.advantages.STD_MODES):
    each group's own std, none, or one std over the whole step's rewards (every rank's groups)."""
    std_eps: float = 1e-6
    """Added to the group std before dividing."""
    clip_eps_low: float = 0.2
    """Lower clip: ratio floor 1 - clip_eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: ratio ceiling 1 + clip_eps_high (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; None = off."""
    cispo_ratio_max: float = 5.0
    """loss.policy_loss=cispo: ε_max, the cap on the importance weight π/π_old (a ratio, not an offset
    from 1), which is detached, so capped tokens keep their gradient. TRL's epsilon_high under
    loss_type="cispo" (whose doc recommends 5.0, the ScaleRL value; unset, TRL would cap at epsilon)."""
    sapo_temperature_pos: float = 1.0
    """loss.policy_loss=sapo: temperature τ of the soft gate σ(τ(ρ-1)) on tokens with advantage > 0 (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """loss.policy_loss=sapo: temperature τ of the soft gate on tokens with advantage ≤ 0 (TRL's default)."""
    kl_coef: float = 0.04
    """β of the KL penalty to the frozen reference; 0 = no reference model is loaded."""
    kl_estimator: str = "k3"
    """Per-token estimator of KL(π || π_ref) for the KL penalty (a key of algo.losses.KL_ESTIMATORS)."""
    kl_ratio_weighted: bool = True
    """Multiply the per-token KL by π/π_old (unbiased when samples come from π_old; TRL's default)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (verl's rollout_is_threshold; Yao et al. 2025): each token's loss is
    weighted by min(π_old / π_sampler, tis_cap), correcting for a sampler whose numerics differ from the
    trainer's (vLLM, bf16 weights). 0 = off."""
    kl_in_reward: bool = False
    """KL as a reward penalty instead of a loss term (verl's algorithm.use_kl_in_reward): each
    completion's reward becomes r - kl_coef · Σ_t KL_t(π_old ‖ π_ref), the loss.kl_estimator summed
    over its counted tokens (verl's default estimator there is k1), before the advantages; Phase A
    then records log π_old too. The loss has no KL term (the KL is still reported). Needs kl_coef > 0."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """How several reward functions make one reward (TRL's option and values): sum_then_normalize =
    their weighted sum; normalize_then_sum = each function's scores normalized within the group
    first ((s - group mean) / (group sample std + loss.std_eps), GDPO), then the weighted sum. TRL
    then scales by the batch std: loss.std=batch gives its recipe."""
    loss_agg: str = "seq-mean-token-mean"
    """How per-token losses are summed and normalized into the minibatch loss (a key of
    algo.losses.AGGREGATIONS); the normalizer is counted on the whole minibatch, so the gradient
    does not depend on the microbatch size — except TRL's per-microbatch normalizer (its entry says
    so), whose gradient depends on train.microbatch_size and the world size on purpose."""
    agg_constant_tokens: int = 0
    """Tokens per sequence of the 'constant' normalizer; 0 = rollout.max_new_tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss -= coef · entropy)."""
    mask_truncated: bool = False
    """Give no loss to completions cut at max_new_tokens."""
    filter_zero_std_groups: bool = False
    """Drop groups whose rewards are all equal from the loss, without resampling (see rollout.dynamic_sampling)."""
    gae_gamma: float = 1.0
    """loss.advantage=gae: discount γ of the token rewards (TRL's PPO gamma and verl's algorithm.gamma, both 1.0)."""
    gae_lambda: float = 0.95
    """loss.advantage=gae: GAE's λ, from 0 (one-step TD) to 1 (Monte-Carlo returns minus V); TRL's PPO lam."""
    value_coef: float = 0.1
    """loss.advantage=gae: weight of the value loss 0.5·max((V - R)², (clip(V, V_old ± value_clip) - R)²),
    aggregated like the policy loss and added to it (TRL's vf_coef)."""
    value_clip: float | None = 0.2
    """loss.advantage=gae: how far V may move from V_old before the clipped term takes over (TRL's
    cliprange_value); None = the plain 0.5·(V - R)²."""


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


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning (the sft preset, and π0 of the demo)."""

    steps: int = 300
    """SFT optimizer steps."""
    batch_size: int = 64
    """Sequences per optimizer step."""
    microbatch_size: int = 64
    """Sequences per forward/backward."""
    lr: float = 1e-3
    """AdamW learning rate."""
    examples: int = 4000
    """SFT examples drawn from the task (builtin) or read from data (jsonl)."""
    refusal_examples: int = 20
    """builtin: refusal examples among them (few: GRPO is to teach refusing)."""
    answer_noise: float = 0.0
    """builtin: share of SFT answers replaced by a plausible wrong one (a noisy teacher)."""
    refusal_kinds: tuple[str, ...] = ()
    """builtin: unanswerable kinds the refusal examples come from (empty = all): div_by_zero, missing_operand."""
    stop_at_accuracy: float = 0.0
    """builtin: stop SFT once greedy accuracy on a probe of TRAINING-side prompts reaches this (0 = off).
    Makes π0 partially competent by design; held-out prompts are never looked at."""
    probe_every: int = 25
    """builtin: SFT steps between two probes."""
    probe_prompts: int = 256
    """builtin: answerable training-side prompts in the probe (its accuracy's noise ~ 0.5/sqrt(n))."""


@dataclass(frozen=True)
class RewardSpec:
    """One reward function of the combined reward."""

    name: str = "exact_match"
    """A registered reward name (`grpolab.rewards.registry.reward_names()`), or 'module:attr' to load
    a reward from user code on sys.path (see grpolab.rewards.registry.build_reward for the rule)."""
    weight: float = 1.0
    """Weight in the combined reward."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the reward factory (e.g. path of a reward model). The key `verifier`
    (true/false) is reserved: it overrides whether the reward counts as a verifier (the step's
    `accuracy` metric) and is not passed to the factory."""
    label: str = ""
    """Name in metrics and reports (default: name); needed to tell two reward models apart."""

    @property
    def display_name(self) -> str:
        return self.label or self.name

    @classmethod
    def from_shorthand(cls, text: str) -> "RewardSpec":
        """'name' or 'name:weight' (e.g. 'exact_match:2.0', 'mypkg.rewards:length_penalty:0.5'):
        the part after the last ':' is the weight when it reads as a number, else part of the name."""
        head, sep, tail = text.rpartition(":")
        if sep:
            try:
                return cls(name=head.strip(), weight=float(tail))
            except ValueError:
                pass
        return cls(name=text.strip())


@dataclass(frozen=True)
class RMRefreshConfig:
    """Iterated reward-model updates during GRPO (grpolab/train/rm_refresh.py): every `every_steps`
    steps, pairs of the policy's recent completions are judged by a labeler within a budget and the
    learned reward models keep training on them."""

    every_steps: int = 0
    """Steps between two refreshes (0 = off); the pairs come from the steps since the last one."""
    rewards: tuple[str, ...] = ()
    """Names (labels) of the reward_model / reward_model_ensemble rewards to refresh; empty = all."""
    labeler: str = ""
    """The preference source: a registered reward name or 'module:attr', called only on the pairs
    chosen for annotation; of a pair the higher-scored completion is preferred (equal = a tie,
    None = no judgement)."""
    labeler_kwargs: dict = field(default_factory=dict)
    """Keyword arguments of the labeler's factory."""
    labels_per_refresh: int = 256
    """Annotation budget: pairs judged per refresh (ties included), shared by the refreshed RMs."""
    train_steps: int = 20
    """RM optimizer steps per refresh."""
    batch_size: int = 64
    """Pairs per RM optimizer step."""
    lr: float = 3e-4
    """AdamW learning rate of the refresh (constant)."""
    replay_share: float = 0.5
    """Share of each batch drawn from the RM's own saved training pairs (train_pairs.jsonl in its
    folder; against forgetting); the rest from every pair labelled so far in the run."""


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


@dataclass(frozen=True)
class Config:
    """A whole run: one section per dataclass, plus the preset's name and the reward functions."""

    preset: str = "grpo"
    """Name of the preset these values started from (informational)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rewards: tuple[RewardSpec, ...] = (RewardSpec("exact_match", 1.0), RewardSpec("refusal", 1.0))
    """Reward functions and their weights; the combined reward is their weighted sum."""
    rm_refresh: RMRefreshConfig = field(default_factory=RMRefreshConfig)
    run: RunConfig = field(default_factory=RunConfig)

    # ---- derived sizes (never stored) ----
    @property
    def sequences_per_step(self) -> int:
        """N = prompts_per_step × group_size."""
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def minibatches_per_epoch(self) -> int:
        return self.sequences_per_step // self.minibatch_sequences

    @property
    def minibatch_sequences(self) -> int:
        """Sequences per optimizer step: train.minibatch_size, or the whole step's N when it is 0."""
        return self.train.minibatch_size or self.sequences_per_step

    @property
    def off_policy_steps(self) -> int:
        """Optimizer steps per rollout that learn off-policy WITHOUT correction: all but the first
        when loss.policy_loss has no importance ratio (algo.losses.RATIO_FREE) and a rollout gets
        several optimizer steps (epochs × minibatches); 0 otherwise."""
        from grpolab.algo.losses import RATIO_FREE

        return self.optimizer_steps_per_step - 1 if self.loss.policy_loss in RATIO_FREE else 0

    @property
    def world_size(self) -> int:
        """Data-parallel ranks, as the launcher set them (torchrun's WORLD_SIZE; 1 without one)."""
        from grpolab.dist.launch import launch_world_size

        return launch_world_size()

    @property
    def microbatches_per_minibatch(self) -> int:
        """Per rank."""
        return self.minibatch_sequences // (self.train.microbatch_size * self.world_size)

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.train.epochs * self.minibatches_per_epoch

    @property
    def needs_reference(self) -> bool:
        return self.loss.kl_coef > 0

    @property
    def needs_old_logp_pass(self) -> bool:
        """Phase A forwards π_old over the rollout: with several minibatches per epoch, or when
        loss.kl_in_reward needs log π_old before the advantages. Else epoch 0's forward of every row
        runs under π_old (before its only optimizer step) and Phase B records old_logp there."""
        return self.minibatches_per_epoch > 1 or self.loss.kl_in_reward

    def validate(self) -> "Config":
        """Raises ConfigError naming the field and the fix; returns self for chaining."""
        config_io.validate_config(self)
        return self

    def replace(self, **dotted: Any) -> "Config":
        """A new Config with dotted overrides, e.g. replace(**{"loss.kl_coef": 0.0})."""
        return config_io.apply_overrides(self, config_io.override_strings(dotted))


# Each preset is only a set of field values on top of the defaults (which are GRPO's).
_ONE_UPDATE = {"loss.policy_loss": "weighted_nll", "loss.kl_coef": 0.0, "train.minibatch_size": 0, "train.epochs": 1}
"""No importance ratio, so one optimizer step per rollout: every step on-policy."""
PRESETS: dict[str, dict[str, Any]] = {
    "sft": {"loss.policy_loss": "sft", "loss.kl_coef": 0.0},
    "onpolicy_sft": {**_ONE_UPDATE, "loss.advantage": "relu"},
    "reinforce": {**_ONE_UPDATE, "loss.advantage": "reinforce"},
    "reinforce_norm": {**_ONE_UPDATE, "loss.advantage": "group_norm"},
    "grpo": {},
    "grpo_no_kl": {"loss.kl_coef": 0.0},
    "dr_grpo": {"loss.std": "none", "loss.loss_agg": "constant", "loss.kl_coef": 0.0},
    "dapo": {"loss.clip_eps_low": 0.2, "loss.clip_eps_high": 0.28, "loss.kl_coef": 0.0, "loss.loss_agg": "token-mean",
             "loss.filter_zero_std_groups": True, "rollout.dynamic_sampling": True},
    "gspo": {"loss.policy_loss": "gspo", "loss.clip_eps_low": 3e-4, "loss.clip_eps_high": 4e-4, "loss.kl_coef": 0.0,
             "loss.loss_agg": "seq-mean-token-mean"},
    "rloo": {"loss.advantage": "rloo", "loss.kl_coef": 0.0},
    # seed 004's futures, GRPO minus one trick each (grpo_no_kl drops the KL): sft_o1 = on-policy SFT with
    # twice the on-policy steps for the same sampled completions; grpo_no_is = no ratio (SimPO's route)
    "sft_o1": {**_ONE_UPDATE, "loss.advantage": "relu", "rollout.prompts_per_step": 8, "train.steps": 100},
    "grpo_no_is": {"loss.policy_loss": "weighted_nll", "loss.kl_coef": 0.0, "loss.loss_agg": "seq-mean-token-mean"},
    # seed 000's value-function loss: PPO, its KL per token in the reward (TRL's PPOTrainer: k1, β = 0.05)
    "ppo": {"loss.advantage": "gae", "loss.loss_agg": "token-mean", "loss.kl_in_reward": True,
            "loss.kl_estimator": "k1", "loss.kl_coef": 0.05},
}


def from_preset(name: str, overrides: list[str] | None = None) -> Config:
    """Config of a preset with dotted `key=value` overrides applied, validated."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = config_io.apply_overrides(Config(preset=name), config_io.override_strings(PRESETS[name]))
    return config_io.apply_overrides(cfg, overrides or []).validate()


def load(path: str, overrides: list[str] | None = None) -> Config:
    """Config from a YAML file (a `preset:` key picks the starting values), then overrides."""
    return config_io.load_yaml(path, overrides or [], Config, PRESETS).validate()


def dump(cfg: Config, path: str | None = None) -> str:
    """The fully resolved config as YAML (written to path if given)."""
    text = config_io.dump_yaml(cfg)
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text

