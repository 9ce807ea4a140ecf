"""The `data:` section: where the prompts come from and how they are rendered."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from, and the held-out split."""

    source: str = "builtin:arith"
    """Prompt source: 'builtin:arith', 'jsonl:PATH', 'hf:PATH' (local datasets files), 'hf:org/name' (a hub
    dataset in the Hugging Face cache; HF_HUB_OFFLINE=1 honoured), 'rg:TASK' (reasoning-gym) or
    'builtin:seeds' (items {"seed": k} for an environment that builds its episode from a seed; held out:
    seeds 0 .. data.eval_prompts-1, never trained on)."""
    eval_prompts: int | None = None
    """Held-out prompts for evaluation (never trained on). None: every row of data.eval_source, and
    256 of builtin:arith's split or of builtin:seeds; a number caps eval_source (a cut is said)."""
    eval_source: str = ""
    """Held-out prompts of `grpolab eval` (the forms of source); empty: builtin:arith's held-out split.
    Other sources need it: their prompts are all training prompts."""
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

    @property
    def builtin_eval_prompts(self) -> int:
        """Held-out prompts drawn from a built-in source: eval_prompts, else 256."""
        return self.eval_prompts if self.eval_prompts is not None else 256
