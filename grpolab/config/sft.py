"""The `sft:` section: supervised fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass


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
    examples: int | None = None
    """A cap on the SFT examples: builtin, the count drawn from the task (None: 4000); a data file, its
    first `examples` rows (None: every row; a cap that cuts rows is said)."""
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
