"""Reward shaping by completion length: DAPO's soft overlong punishment.

DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13)
adds a length penalty to the reward of completions that come close to the generation limit:

    R_length(L) = 0                                     L ≤ L_max − L_cache
                  ((L_max − L_cache) − L) / L_cache     L_max − L_cache < L ≤ L_max
                  −1                                    L_max < L

times a penalty factor. The peers' names: verl's `reward_model.overlong_buffer` {enable, len,
penalty_factor} with `max_resp_len` (its DAPO reward manager adds the penalty to the score), TRL's
`get_soft_overlong_punishment(max_completion_len, soft_punish_cache)` in trl/rewards (no factor:
the reward's weight plays that part). Here it is the built-in reward `overlong`, summed with the
others by its weight: `{name: overlong, kwargs: {buffer_len: 4, penalty_factor: 1.0}}`.

L is a completion's generated tokens, EOS included (as verl's valid response length), read from
the metadata key `completion_tokens` that the GRPO loop adds (`grpo.stats.score_rollout`); L_max
defaults to `max_new_tokens` of the same metadata (rollout.max_new_tokens), where a truncated
completion has L = L_max and gets −penalty_factor. Rows without `completion_tokens` (the start-up
probe, `grpolab eval`) abstain: the penalty shapes training, it does not score answers.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from grpolab.errors import ConfigError


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """DAPO eq. 13 times penalty_factor. lengths: [N] tokens per completion -> [N] float32 penalty ≤ 0.

    0 up to max_len − buffer_len, then linear down to −penalty_factor at max_len, and −penalty_factor
    past it (DAPO's and TRL's −1; verl's formula continues the line there, but its completions never
    pass max_resp_len). buffer_len = 0: only completions longer than max_len are punished."""
    assert lengths.dim() == 1, f"lengths must be [N], got {tuple(lengths.shape)}"
    assert 0 <= buffer_len <= max_len, f"need 0 ≤ buffer_len={buffer_len} ≤ max_len={max_len}"
    L = lengths.float()
    start = max_len - buffer_len
    window = (start - L) / max(buffer_len, 1)
    out = torch.where(L <= start, torch.zeros_like(L), window)
    return torch.where(L > max_len, torch.full_like(L, -1.0), out) * penalty_factor


class Overlong:
    """DAPO's soft overlong punishment (see the module docstring); not a verifier.

    buffer_len: L_cache, the tokens before the limit over which the penalty grows (verl's
    overlong_buffer.len, TRL's soft_punish_cache). penalty_factor: the penalty at the limit (verl's
    overlong_buffer.penalty_factor). max_len: L_max in tokens (verl's max_resp_len, TRL's
    max_completion_len); None = rollout.max_new_tokens."""

    name = "overlong"
    verifier = False

    def __init__(self, buffer_len: int, penalty_factor: float = 1.0, max_len: int | None = None):
        if buffer_len < 0:
            raise ConfigError(f"rewards: reward 'overlong': kwargs.buffer_len={buffer_len} must be ≥ 0")
        if penalty_factor < 0:
            raise ConfigError(f"rewards: reward 'overlong': kwargs.penalty_factor={penalty_factor} must be ≥ 0 "
                              "(the penalty is subtracted)")
        if max_len is not None and not buffer_len <= max_len:
            raise ConfigError(f"rewards: reward 'overlong': kwargs.buffer_len={buffer_len} must be ≤ "
                              f"kwargs.max_len={max_len}")
        self.buffer_len, self.penalty_factor, self.max_len = buffer_len, penalty_factor, max_len

    def _limit(self, row: dict[str, Any]) -> int:
        if self.max_len is not None:
            return self.max_len
        if "max_new_tokens" not in row:
            raise ValueError("reward 'overlong': no kwargs.max_len and no `max_new_tokens` in the metadata; "
                             "give kwargs.max_len")
        limit = int(row["max_new_tokens"])
        if self.buffer_len > limit:
            raise ValueError(f"reward 'overlong': kwargs.buffer_len={self.buffer_len} is longer than "
                             f"rollout.max_new_tokens={limit}, so every completion would be punished; lower it")
        return limit

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 metadata: Sequence[dict[str, Any]]) -> list[float | None]:
        if len(metadata) != len(completions):
            raise ValueError(f"reward 'overlong': {len(completions)} completions but {len(metadata)} metadata rows")
        known = [i for i, row in enumerate(metadata) if "completion_tokens" in row]
        out: list[float | None] = [None] * len(completions)
        if not known:
            return out
        limits = {self._limit(metadata[i]) for i in known}
        if len(limits) > 1:
            raise ValueError(f"reward 'overlong': the rows' max_new_tokens differ ({sorted(limits)}); give kwargs.max_len")
        lengths = torch.tensor([int(metadata[i]["completion_tokens"]) for i in known])
        penalty = overlong_penalty(lengths, limits.pop(), self.buffer_len, self.penalty_factor)
        for i, v in zip(known, penalty.tolist()):
            out[i] = v
        return out
