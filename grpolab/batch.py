"""The Rollout: what Phase A hands to Phase B, a typed bundle of tensors (read-only by convention).

Layout of one row (sequence): [left padding | prompt | completion | right padding], the prompt
part is `prompt_len` columns wide for every row. N = P × G rows, grouped by prompt: rows
g·G .. g·G+G-1 are the G completions of prompt g.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Rollout:
    input_ids: torch.Tensor
    """[N, T] int64: left-padded prompt then completion (pad after EOS)."""
    attention_mask: torch.Tensor
    """[N, T] bool: True on real prompt and completion tokens (through the first EOS)."""
    prompt_len: int
    """Lp: the first Lp columns are the (left-padded) prompt; completions are columns Lp..T-1."""
    loss_mask: torch.Tensor
    """[N, Lc] bool: True = this completion token counts (through and including the first EOS)."""
    truncated: torch.Tensor
    """[N] bool: the completion hit max_new_tokens without EOS."""
    group_size: int
    """G."""
    old_logp: torch.Tensor | None = None
    """[N, Lc] float32: log π_old of each completion token (None until computed)."""
    ref_logp: torch.Tensor | None = None
    """[N, Lc] float32: log π_ref (only with a KL penalty)."""
    sampler_logp: torch.Tensor | None = None
    """[N, Lc] float32: log-probs reported by the sampler (to measure train/inference mismatch)."""
    rewards: torch.Tensor | None = None
    """[N] float32: combined reward (NaN = every reward function abstained)."""
    advantages: torch.Tensor | None = None
    """[N] float32 (with loss.advantage=gae: each row's mean of token_advantages over its counted tokens)."""
    token_advantages: torch.Tensor | None = None
    """[N, Lc] float32: per-token advantages (loss.advantage=gae: GAE, whitened); None otherwise."""
    values: torch.Tensor | None = None
    """[N, Lc] float32 (the value head's dtype): V_old of each completion token's state (loss.advantage=gae)."""
    returns: torch.Tensor | None = None
    """[N, Lc] float32: the value targets R = GAE advantages + V_old (loss.advantage=gae)."""
    weight_version: int = 0
    """The version of the weights that sampled it (`Engine.load_weights`'s; the trainer's policy after k
    optimizer phases is version k); the oldest one when its rows were sampled by several (`versions`)."""
    versions: torch.Tensor | None = None
    """[N, Lc] int64: the weight version that sampled each completion token, where rows (or tokens)
    were sampled by different versions; None = every token by weight_version (`token_versions`)."""

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> torch.Tensor:
        """[N, Lc]."""
        return self.input_ids[:, self.prompt_len :]

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] int64: counted tokens per completion."""
        return self.loss_mask.sum(-1)

    @property
    def length_key(self) -> torch.Tensor:
        """[N] int64: orders rows by (completion length, real prompt length); sorting by it puts rows
        of similar widths together (`forward.buckets.length_buckets`, `forward.buckets.group_buckets`)."""
        prompt_real = self.attention_mask[:, : self.prompt_len].sum(-1)
        return self.completion_lengths * (self.prompt_len + 1) + prompt_real

    def token_versions(self) -> torch.Tensor:
        """[N, Lc] int64: the weight version that sampled each completion token (`versions`, or
        weight_version everywhere)."""
        if self.versions is not None:
            return self.versions
        return torch.full(tuple(self.loss_mask.shape), self.weight_version, dtype=torch.long,
                          device=self.loss_mask.device)

    def row_versions(self) -> torch.Tensor:
        """[N] int64: each row's oldest weight version among its counted tokens (weight_version for a
        row without any)."""
        if self.versions is None:
            return torch.full((self.num_sequences,), self.weight_version, dtype=torch.long,
                              device=self.loss_mask.device)
        big = torch.iinfo(torch.long).max
        oldest = self.versions.masked_fill(~self.loss_mask.bool(), big).min(-1).values
        return torch.where(oldest == big, torch.full_like(oldest, self.weight_version), oldest)

    def replace(self, **fields) -> "Rollout":
        return dataclasses.replace(self, **fields)

    def select(self, idx: torch.Tensor) -> "Rollout":
        """Rows `idx` (a new Rollout of contiguous copies; this one is not touched), trimmed of all-pad columns.

        Left columns that are padding in every selected row and right columns past the last
        counted token are dropped, so short microbatches cost less compute.
        """
        am = self.attention_mask[idx]
        lm = self.loss_mask[idx]
        left = int((~am[:, : self.prompt_len]).all(0).long().cumprod(0).sum())
        right = int(lm.any(0).nonzero().max()) + 1 if lm.any() else 1
        t_end = self.prompt_len + right

        def rows(x, cols=None):
            if x is None:
                return None
            # columns first, then rows: the row indexing copies into a fresh tensor, never a view,
            # so a compiled forward (which guards on strides and on views' bases) is not recompiled
            return (x if cols is None else x[:, cols])[idx]

        comp = slice(0, right)
        return Rollout(
            input_ids=rows(self.input_ids, slice(left, t_end)),
            attention_mask=rows(self.attention_mask, slice(left, t_end)),
            prompt_len=self.prompt_len - left,
            loss_mask=rows(self.loss_mask, comp),
            truncated=rows(self.truncated),
            group_size=self.group_size,
            old_logp=rows(self.old_logp, comp),
            ref_logp=rows(self.ref_logp, comp),
            sampler_logp=rows(self.sampler_logp, comp),
            rewards=rows(self.rewards),
            advantages=rows(self.advantages),
            token_advantages=rows(self.token_advantages, comp),
            values=rows(self.values, comp),
            returns=rows(self.returns, comp),
            weight_version=self.weight_version,
            versions=rows(self.versions, comp),
        )


def scatter_rows(pieces: list[torch.Tensor], idx: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Puts the per-microbatch [b_i, <=Lc] pieces (rows idx, in order; right-trimmed as `select`
    leaves them) back into an [N, Lc] float32 tensor. Columns past a piece's width are 0 there;
    they were trimmed because no row of that microbatch counts them."""
    device = pieces[0].device if pieces else idx.device
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    idx = idx.to(device)
    start = 0
    for piece in pieces:
        out[idx[start : start + piece.shape[0]], : piece.shape[1]] = piece.float()
        start += piece.shape[0]
    if start != len(idx):
        raise ValueError(f"scatter_rows: pieces hold {start} rows, idx has {len(idx)}")
    return out


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token. [N, T] -> [N, T]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def concat_rollouts(parts: list[Rollout], pad: int) -> Rollout:
    """The rows of several Rollouts (same group size) as one, in order: prompts left-padded and
    completions right-padded to the widest part (input_ids with `pad`, masks with False, per-token
    log-probs with 0). Per-token and per-row fields must be set in all parts or in none."""
    G = parts[0].group_size
    if any(p.group_size != G for p in parts):
        raise ValueError(f"concat_rollouts: group sizes {[p.group_size for p in parts]} differ")
    lp = max(p.prompt_len for p in parts)
    lc = max(p.loss_mask.shape[1] for p in parts)

    def widen(p: Rollout, x: torch.Tensor, value) -> torch.Tensor:  # [n, T] -> [n, lp + lc]
        prompt, comp = x[:, : p.prompt_len], x[:, p.prompt_len :]
        return torch.cat([F.pad(prompt, (lp - p.prompt_len, 0), value=value),
                          F.pad(comp, (0, lc - comp.shape[1]), value=value)], 1)

    def cat(name: str, value=0.0) -> torch.Tensor | None:
        xs = [getattr(p, name) for p in parts]
        if all(x is None for x in xs):
            return None
        if any(x is None for x in xs):
            raise ValueError(f"concat_rollouts: {name} is set in some parts only")
        return torch.cat([x if x.dim() == 1 else F.pad(x, (0, lc - x.shape[1]), value=value) for x in xs])

    return Rollout(
        input_ids=torch.cat([widen(p, p.input_ids, pad) for p in parts]),
        attention_mask=torch.cat([widen(p, p.attention_mask, False) for p in parts]),
        prompt_len=lp, loss_mask=cat("loss_mask", False), truncated=cat("truncated"), group_size=G,
        old_logp=cat("old_logp"), ref_logp=cat("ref_logp"), sampler_logp=cat("sampler_logp"),
        rewards=cat("rewards"), advantages=cat("advantages"),
        weight_version=min(p.weight_version for p in parts), versions=_versions(parts, lc),
    )


def _versions(parts: list[Rollout], lc: int) -> torch.Tensor | None:
    """concat_rollouts' `versions`: None when every part was sampled by one and the same version,
    else each part's per-token versions right-padded to lc (with the part's weight_version)."""
    if all(p.versions is None for p in parts) and len({p.weight_version for p in parts}) == 1:
        return None
    return torch.cat([F.pad(p.token_versions(), (0, lc - p.loss_mask.shape[1]), value=p.weight_version)
                      for p in parts])
