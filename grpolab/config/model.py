"""The `model:` section: which model, its size (built-in), dtype, LoRA, attention and compilation switches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """The policy model, and how its log-prob forwards run."""

    name_or_path: str = "builtin:tiny"
    """Policy model: 'builtin:tiny' (built locally; 'builtin:tiny-chat': with a character-level ChatML
    tokenizer whose chat template renders tools, for agent runs), an HF folder, a hub id 'org/name' (from the Hugging
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
    """LoRA scaling alpha (PEFT's `lora_alpha`): the adapters' update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA adapters' input (PEFT's `lora_dropout`), in [0, 1). Non-zero makes Phase B's
    forward random, so π_old's log-probs no longer equal the first minibatch's exactly."""
    lora_targets: tuple[str, ...] = ()
    """Module names that get adapters (PEFT's `target_modules`), e.g. [q_proj, k_proj, v_proj, o_proj];
    [all-linear]: every linear layer but the output head; empty: PEFT's default for the architecture
    (q_proj and v_proj for Llama / Qwen2). A name no module has is an error naming this field."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' `gradient_checkpointing_enable`, non-reentrant): less memory in Phase B for about
    one more forward of compute; the gradients are the same. Works with LoRA, DDP and FSDP2."""
    compile: bool | str = "auto"
    """torch.compile the log-prob forwards: the policy's training forward (Phase B) and the no-grad
    π_old / π_ref passes of Phase A (a LoRA reference stays eager), per model.compile_scope. Shapes
    are dynamic, so widths that change from step to step do not recompile. The first step pays the
    compilation (seconds from the persistent compile cache, about a minute cold on a CPU); later steps
    are faster, most on small models whose forward is overhead-bound, at a small cost in peak memory.
    auto: on only where the planned run recovers the compile time (grpo/speed.py: `compile_pays`)."""
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
