"""Decode with oneDNN-packed linear weights on a CPU in float32 (`rollout.packed_weights`).

A decode step multiplies a few rows (one token per sequence still generating) by every weight
matrix of the model. On a CPU, PyTorch's float32 `linear` calls MKL's sgemm, which re-reads the
weight in its plain layout at every call; for such skinny products oneDNN does better on a weight
reordered once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then
`torch.ops.mkldnn._linear_pointwise`: the prepacked linear inductor uses for frozen CPU models).
The weights change after every optimizer step, so the copies are made at the start of each
rollout and dropped at its end.

It pays when a decode step multiplies few rows by large weight matrices, where each product is
bound by reading the weight: the reorder, one pass over every linear weight per rollout, is repaid
over the rollout's decode steps. Small weight matrices multiplied by many rows gain nothing: MKL
already runs those products at full rate (bench/README.md has the measurements). While a rollout
runs, the packed copies take as much memory again as the model's linear weights.

Numerics: the same float32 products, summed in oneDNN's order instead of MKL's (differences of
float rounding); samples and sampler log-probs are those of the policy up to that rounding.
Inference only: the packed linear has no backward.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def packed_linears(model: torch.nn.Module, rows: int):
    """Within this block, each float32 CPU `nn.Linear` of `model` multiplies by a oneDNN-packed copy
    of its weight (no grad); other layers (another dtype or device) are left as they are, and so is
    a layer whose `forward` is already replaced on the instance (e.g. by accelerate's hooks), and
    everything when PyTorch was built without oneDNN. rows: the number of input rows to pack for (a
    hint for oneDNN's layout; other row counts work). On exit every layer is restored and the
    copies freed.
    """
    patched = []
    if not torch.backends.mkldnn.is_available():
        yield
        return
    try:
        for module in model.modules():
            if (isinstance(module, torch.nn.Linear) and "forward" not in module.__dict__
                    and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32):
                module.forward = _packed_forward(module, rows)
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


def _packed_forward(module: torch.nn.Linear, rows: int):
    """`module`'s forward on a packed copy of its weight: x [..., in] -> [..., out]."""
    weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
    bias = None if module.bias is None else module.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return forward
