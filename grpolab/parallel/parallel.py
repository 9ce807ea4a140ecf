"""Data parallelism on torch.distributed: the loop's only view of the process group.

Phase A: every rank draws the same P prompts from its (identical) prompt stream and keeps its own
P / world of them (`shard`), so groups stay whole on one rank and advantages group-local. Phase B:
each rank learns on its own rows; the minibatch's loss normalizer is summed over ranks before its
microbatches run (the exactness rule of the design), and each rank's loss is scaled by the world
size, because DDP and FSDP2 average gradients over ranks: the reduced gradient is then the
gradient of the whole minibatch's loss, as one process would compute it. Gradients accumulate
over a rank's microbatches without a sync; the last microbatch's backward reduces them.

strategies: "none" (one process), "ddp" (`DistributedDataParallel`), "fsdp2" (`fully_shard` per
decoder layer and on the root, with a bf16 mixed-precision policy when the compute dtype is bf16).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    strategy: str = "none"
    compute_dtype: torch.dtype | None = None
    """FSDP2's mixed-precision parameter dtype (None = the parameters' own)."""

    @property
    def active(self) -> bool:
        """Ranks of a process group (torchrun), one or more; False in a plain process."""
        return self.strategy != "none"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes the run's files (metrics, samples, config, final/)."""
        return self.rank == 0

    @property
    def shards_parameters(self) -> bool:
        return self.active and self.strategy == "fsdp2"

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over ranks (a new tensor; `value` itself with one process)."""
        if not self.active:
            return value
        out = value.detach().clone()
        torch.distributed.all_reduce(out)
        return out

    def sum_floats(self, value: float) -> float:
        """The sum of a Python float over ranks (float64 on the wire)."""
        return float(self.all_reduce_sum(torch.tensor(value, dtype=torch.float64))) if self.active else value

    def reduce_floats(self, sums: Sequence[float], mins: Sequence[float], maxs: Sequence[float]):
        """(sums, mins, maxs) over ranks, element-wise, in three float64 all-reduces."""
        if not self.active:
            return list(sums), list(mins), list(maxs)
        out = []
        for values, op in ((sums, "SUM"), (mins, "MIN"), (maxs, "MAX")):
            t = torch.tensor(list(values), dtype=torch.float64)
            if t.numel():
                torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
            out.append(t.tolist())
        return tuple(out)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on any."""
        return bool(self.reduce_floats([], [], [float(flag)])[2][0]) if self.active else bool(flag)

    def gather(self, obj: Any) -> list:
        """[rank 0's obj, rank 1's, ...] on every rank (pickled; for small per-step records)."""
        if not self.active:
            return [obj]
        out: list = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    # ------------------------------------------------------------------ Phase A
    def shard(self, items: Sequence) -> list:
        """This rank's contiguous share of a step's prompts (len(items) / world of them)."""
        per = len(items) // self.world_size
        return list(items[self.rank * per:(self.rank + 1) * per])

    # ------------------------------------------------------------------ Phase B
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """What Phase B calls: `model` (one process), DDP(model), or `model` sharded in place by FSDP2
        (each decoder layer, then the root). Build the optimizer on the wrapped model's parameters."""
        if not self.active:
            return model
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        return self.shard_module(model)

    def shard_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 in place: `fully_shard` on each decoder layer, then on the root (also for the frozen
        reference model, which is then sharded like the policy); returns `model`."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from grpolab.forward.compiled import transformer_blocks

        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32) \
            if self.compute_dtype is not None else MixedPrecisionPolicy()
        for block in transformer_blocks(model):
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model

    def microbatch(self, module, last: bool):
        """Context of one microbatch's forward and backward: gradients are reduced over ranks only on
        the minibatch's `last` microbatch (no sync per microbatch)."""
        if self.active and self.strategy == "fsdp2":
            module.set_requires_gradient_sync(last)
        if self.active and self.strategy == "ddp" and not last:
            return module.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled by the world size so that the ranks' averaged gradient is the sum
        of their gradients (each rank's loss already divides by the global normalizer)."""
        (loss * self.world_size if self.active else loss).backward()

    def full_state(self, model: torch.nn.Module) -> Mapping[str, torch.Tensor]:
        """The policy's full weights on every rank, for the rollout engine: the module's own tensors,
        or with FSDP2 a mapping that all-gathers one tensor at a time as it is read (every rank must
        read it, in the same order: a collective per tensor), so no second full copy is ever held."""
        if not self.shards_parameters:
            return model.state_dict()
        return _Gathered(model.state_dict())


class _Gathered(Mapping):
    """A sharded state dict read as full tensors, one all-gather per item read (FSDP2)."""

    def __init__(self, sharded: dict):
        self._sharded = sharded

    def __getitem__(self, key: str) -> torch.Tensor:
        value = self._sharded[key]
        return value.full_tensor() if hasattr(value, "full_tensor") else value

    def __iter__(self):
        return iter(self._sharded)

    def __len__(self) -> int:
        return len(self._sharded)
