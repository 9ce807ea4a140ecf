"""Data parallelism on torch.distributed: what Phase B needs to be exact across ranks.

`Parallel` is the loop's only view of the process group. Each rank learns on its own rows; the
minibatch's loss normalizer is summed over ranks before its microbatches run (the exactness rule
of the design), and each rank's loss is scaled by the world size, because DDP and FSDP2 average
gradients over ranks: the reduced gradient is then the gradient of the whole minibatch's loss, as
one process would compute it. Gradients accumulate over a rank's microbatches without a sync; the
last microbatch's backward reduces them.

strategies: "none" (one process), "ddp" (`DistributedDataParallel`), "fsdp2" (`fully_shard` per
decoder layer and on the root).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    strategy: str = "none"

    @property
    def active(self) -> bool:
        return self.world_size > 1

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

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """What Phase B calls: `model` (one process), DDP(model), or `model` sharded in place by FSDP2
        (each decoder layer, then the root). Build the optimizer on the wrapped model's parameters."""
        if not self.active or self.strategy == "none":
            return model
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(model)
        from torch.distributed.fsdp import fully_shard

        from grpolab.forward.compiled import transformer_blocks

        for block in transformer_blocks(model):
            fully_shard(block)
        fully_shard(model)
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
