"""torch.compile for the log-prob forwards (model.compile): the whole model or each transformer block."""

from __future__ import annotations

import torch


def training_module(model: torch.nn.Module, compile: bool, cpp_wrapper: bool = False, scope: str = "blocks"):
    """What the log-prob forwards call: `model` itself, or (`compile`) `model` with torch.compile'd
    transformer blocks (scope 'blocks': `CompiledBlocks`) or `torch.compile(model)` (scope 'model';
    also for a model whose blocks are not found), sharing its parameters (the optimizer,
    checkpoints and generation keep using `model`). Used for Phase B's training forward and Phase
    A's no-grad π_old / π_ref passes (one more graph each: grad mode is part of a compiled graph).
    Dynamic shapes: the batch width changes from step to step. cpp_wrapper: inductor calls the
    generated kernels from C++ instead of a Python wrapper (model.compile_cpp_wrapper; see its
    docstring for what it costs and gains)."""
    if not compile:
        return model
    options = {"cpp_wrapper": True} if cpp_wrapper else None
    blocks = transformer_blocks(model) if scope == "blocks" else []
    if not blocks:
        return torch.compile(model, dynamic=True, options=options)
    return CompiledBlocks(model, blocks, options)


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (the decoder layers): the modules whose class its
    `_no_split_modules` names. Empty for other models."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class CompiledBlocks:
    """Calls `model` with each of `blocks` run through torch.compile (regional compilation).

    All blocks share one compiled graph per grad mode (their code is the same and their parameters
    are graph inputs), so the compile time is that of one block whatever the number of layers, far
    shorter than compiling the whole model as one graph. Only calls through this object run
    compiled: generation and checkpoints use `model` as it is. Attributes (config, ...) are `model`'s.
    """

    def __init__(self, model: torch.nn.Module, blocks: list[torch.nn.Module], options: dict | None = None):
        self._model, self._blocks = model, blocks
        # nn.Module.compile's mechanism, set only for the duration of a call (see __call__)
        self._compiled = [torch.compile(b._call_impl, dynamic=True, options=options) for b in blocks]

    def __call__(self, *args, **kwargs):
        previous = [block._compiled_call_impl for block in self._blocks]  # None unless compiled by the user
        for block, compiled in zip(self._blocks, self._compiled):
            block._compiled_call_impl = compiled
        try:
            return self._model(*args, **kwargs)
        finally:
            for block, impl in zip(self._blocks, previous):
                block._compiled_call_impl = impl

    def __getattr__(self, name):
        if "_model" not in self.__dict__:  # during copy / unpickling, before __init__
            raise AttributeError(name)
        return getattr(self._model, name)
