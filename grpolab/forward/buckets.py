"""Which rows go into which chunk of a log-prob pass (Phase A's π_old / π_ref passes, Phase B's microbatches).

Every function here takes (rollout, rows per chunk) and returns int64 row-index tensors that together
cover 0..N-1 once; the chunk sizes are the same whatever the choice (`batch_size` rows each, the last
one shorter). Only which rows share a chunk changes:

- padded rows (`length_buckets`, `group_buckets`): rows, or whole groups, of similar length
  together, so each chunk carries little padding;
- padding-free rows (`balanced_buckets`): every chunk gets about the same number of real tokens.
  Padding costs nothing there, and a chunk's size is its token count: equal counts make the chunks
  of a pass one matrix size (a CPU's oneDNN builds and keeps kernels for every size it meets) and
  the same work (data-parallel ranks and microbatches finish together).

Each layout of `forward.layouts` names its chunking; a run picks one at setup.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

Buckets = Callable[..., list[torch.Tensor]]


def length_buckets(rollout, batch_size: int) -> list[torch.Tensor]:
    """Row indices in chunks of `batch_size`, rows sorted by (completion length, prompt length).

    `Rollout.select` trims the columns that are padding in every row of a chunk, so chunks of
    similar lengths compute fewer padded positions. The sort is stable (ties keep row order).
    """
    order = torch.sort(rollout.length_key, stable=True).indices
    return list(order.split(batch_size))


def group_buckets(rollout, batch_size: int) -> list[torch.Tensor]:
    """Row indices in chunks of `batch_size` rows (a multiple of the group size), whole groups only.

    Groups are sorted by (longest completion, prompt length), stable, so a chunk carries little
    padding, as `length_buckets` does for rows; each group's rows stay together and in order.
    """
    g = _check_groups(rollout, batch_size)
    n = rollout.num_sequences
    order = torch.sort(rollout.length_key.view(n // g, g).amax(-1), stable=True).indices  # a group's longest row
    return list(group_rows(order, g).split(batch_size))


def balanced_buckets(rollout, batch_size: int, whole_groups: bool = False) -> list[torch.Tensor]:
    """Row indices in chunks of `batch_size` rows whose real-token counts are as equal as a greedy
    split makes them: units (rows, or whole groups with `whole_groups` (model.shared_prompt), each
    group's prompt counted once) longest first, each into the chunk with the fewest tokens so far
    that has room (`balanced_partition`). A group's rows stay together and in order; the units of
    a chunk are in index order.
    """
    g = _check_groups(rollout, batch_size) if whole_groups else 1
    n = rollout.num_sequences
    tokens = rollout.attention_mask.sum(-1).view(n // g, g)
    prompt = rollout.attention_mask[:, : rollout.prompt_len].sum(-1).view(n // g, g)[:, 0]
    cost = tokens.sum(-1) - (g - 1) * prompt  # what a padding-free forward computes per unit
    per = batch_size // g
    sizes = [per] * (len(cost) // per) + ([len(cost) % per] if len(cost) % per else [])
    device = rollout.attention_mask.device  # as length_buckets' indices
    return [group_rows(units.to(device), g) for units in balanced_partition(cost, sizes)]


def balanced_partition(cost: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Splits units 0..U-1 of `cost` ([U] int) into len(sizes) bins holding exactly sizes[b] units
    (sum(sizes) == U), greedily: highest cost first, each into the bin with the lowest total so far
    among those with room (ties: the lower bin). Returns [sizes[b]] int64 unit indices per bin,
    ascending."""
    if sum(sizes) != len(cost):
        raise ValueError(f"bins of {sizes} units do not hold {len(cost)} units")
    order = torch.sort(cost, descending=True, stable=True).indices.tolist()
    values = cost.tolist()
    heap = [(0, b) for b, size in enumerate(sizes) if size > 0]
    bins: list[list[int]] = [[] for _ in sizes]
    for unit in order:
        total, b = heapq.heappop(heap)
        bins[b].append(unit)
        if len(bins[b]) < sizes[b]:
            heapq.heappush(heap, (total + values[unit], b))
    return [torch.tensor(sorted(units), dtype=torch.long) for units in bins]


def _check_groups(rollout, batch_size: int) -> int:
    g = rollout.group_size
    n = rollout.num_sequences
    if batch_size % g or n % g:
        raise ValueError(f"model.shared_prompt: batches of {batch_size} rows out of {n} are not whole groups of {g}")
    return g


def group_rows(groups: torch.Tensor, g: int) -> torch.Tensor:
    """[k] group indices (groups of g consecutive rows) -> [k·g] int64 their rows, each group's together
    and in order."""
    return (groups[:, None] * g + torch.arange(g, device=groups.device)).flatten()
