"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resharded on load.

Layout: a checkpoint is one folder written by `torch.distributed.checkpoint.save` (a `.metadata`
file plus one `__<rank>_0.distcp` file per writing rank). Its state dict has the top-level keys

- "model": the policy's weights, keyed by the plain model's names (`model.layers.0.mlp...`): the
  public `torch.distributed.checkpoint.state_dict` API strips wrapper prefixes such as DDP's
  `module.`, and an FSDP2 rank writes only its own shards (DTensors);
- "optimizer": the optimizer's state keyed by those parameter names, not by the positional ids of
  `Optimizer.state_dict()` (AdamW: `state.<name>.{step,exp_avg,exp_avg_sq}`, and `param_groups`);
- "reference": the frozen reference model's weights, only when one was given to `save_sharded`.

DCP stores every tensor with its global shape and reads back whatever slices the loading ranks
own, so a checkpoint written by N ranks (DDP or FSDP2) loads at any world size, at world size 1
without a process group included, and the files are the same whether the model was a plain module,
a `DistributedDataParallel` wrapper, its inner module, or a module sharded in place by FSDP2.
With a process group initialized, `save_sharded`, `load_sharded` and `full_state_dict` (of an
FSDP2 model) are collectives: every rank calls them, and the folder must be on a filesystem every
rank sees.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

MODEL, OPTIMIZER, REFERENCE = "model", "optimizer", "reference"
_SHOWN = 5  # names listed in an error message before "..."


class CheckpointLoadError(ValueError):
    """A checkpoint folder that cannot be loaded into the given objects; the message names the folder."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every save and load without a process group even when told `no_dist=True`;
    one process is a supported layout here, so that warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _unwrap(model: nn.Module) -> nn.Module:
    """The module whose parameters hold the weights: DDP's inner module, else `model` itself."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _is_fsdp2(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return isinstance(module, FSDPModule) or any(isinstance(p, DTensor) for p in module.parameters())


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`get_optimizer_state_dict`, made safe for an optimizer that has not stepped yet.

    The state dict API gives such an optimizer a state by running one step of lr 0 on zero
    gradients, but only when no parameter holds a gradient (else it returns no state at all, and
    the checkpoint would silently lack the moments), and that step leaves AdamW at step 1, which
    changes the bias correction of the next real step. Here gradients are set aside for the call
    and put back after it, and the steps of a state made this way are reset to 0: zero moments at
    step 0 make the next step exactly that of a fresh optimizer.
    """
    fresh = not optimizer.state
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if fresh:
        for p in params:
            p.grad = None
    try:
        state = get_optimizer_state_dict(model, optimizer)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad
    if fresh:
        for per_param in [*optimizer.state.values(), *state.get("state", {}).values()]:
            step = per_param.get("step") if isinstance(per_param, dict) else None
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif isinstance(step, (int, float)):
                per_param["step"] = type(step)(0)
    return state


def save_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 reference: nn.Module | None = None) -> None:
    """Write `model`'s weights, `optimizer`'s state and, when given, the frozen `reference` model's
    weights (plain or FSDP2-sharded too) into `folder` (created) as a DCP checkpoint.

    Collective when a process group is initialized: every rank calls it with the same `folder`
    and writes its own shards (tensors replicated over ranks are written once). `model` is a plain
    module, a DDP wrapper or its inner module, or a module sharded in place by FSDP2; `optimizer`
    was built on its parameters that require grad (frozen parameters are saved as weights, with no
    optimizer state). An optimizer that has not stepped yet is saved as zero moments at step 0.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    module = _unwrap(model)
    state = {MODEL: get_model_state_dict(module), OPTIMIZER: _optimizer_state(module, optimizer)}
    if reference is not None:
        state[REFERENCE] = get_model_state_dict(_unwrap(reference))
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=folder, no_dist=not _distributed())


def _read_metadata(folder: Path) -> Metadata:
    """The checkpoint's metadata (every tensor's name and global shape); CheckpointLoadError if
    `folder` holds no DCP checkpoint."""
    if not (folder / ".metadata").is_file():
        raise CheckpointLoadError(f"checkpoint {folder}: no DCP checkpoint there (missing {folder / '.metadata'})")
    try:
        return dcp.FileSystemReader(folder).read_metadata()
    except Exception as e:  # a truncated or foreign file: say which folder, keep the cause chained
        raise CheckpointLoadError(f"checkpoint {folder}: unreadable metadata ({type(e).__name__}: {e})") from e


def _listed(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def _check_weights(folder: Path, metadata: Metadata, key: str, weights: dict) -> None:
    """CheckpointLoadError unless the checkpoint's `key` entry holds exactly `weights`' tensor names
    with the same global shapes (DTensor shapes are global)."""
    saved = {name[len(key) + 1:]: meta for name, meta in metadata.state_dict_metadata.items()
             if name.startswith(key + ".")}
    if not saved:
        if key == REFERENCE:
            raise CheckpointLoadError(f"checkpoint {folder} has no reference model (no '{key}' key): it was "
                                      "saved without one; load it with reference=None")
        raise CheckpointLoadError(f"checkpoint {folder} has no '{key}' weights")
    missing = sorted(n for n in weights if n not in saved)
    unexpected = sorted(n for n in saved if n not in weights)
    shapes = sorted(f"{n} {tuple(saved[n].size)} in the checkpoint, {tuple(t.shape)} here"
                    for n, t in weights.items() if isinstance(t, torch.Tensor) and n in saved
                    and (not isinstance(saved[n], TensorStorageMetadata) or tuple(saved[n].size) != tuple(t.shape)))
    problems = [f"{label}: {_listed(names)}" for label, names in
                (("missing from the checkpoint", missing), ("not in this model", unexpected),
                 ("shape mismatch", shapes)) if names]
    if problems:
        raise CheckpointLoadError(f"checkpoint {folder}: its '{key}' weights do not fit this model ("
                                  + "; ".join(problems) + ")")


def load_sharded(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                 reference: nn.Module | None = None) -> None:
    """Restore `model`'s weights, `optimizer`'s state (AdamW moments, step, param groups) and, when
    given, `reference`'s weights from the DCP checkpoint in `folder`, in place.

    Collective when a process group is initialized (every rank calls it). The checkpoint is
    resharded to the current layout: any world size and strategy may have written it, and it loads
    at world size 1 with no process group, into DDP (wrapper or inner module) or FSDP2. Raises
    CheckpointLoadError (a ValueError naming `folder`) when the folder holds no checkpoint, when
    `reference` is given but the checkpoint has none, when the model's parameter names or shapes
    differ from the checkpoint's, or when DCP cannot read the optimizer state (e.g. a parameter
    trainable here was frozen when saving). These checks run on every rank before any collective,
    so all ranks raise together. Gradients are left as they are.
    """
    folder = Path(folder)
    metadata = _read_metadata(folder)
    module = _unwrap(model)
    ref = _unwrap(reference) if reference is not None else None
    state = {MODEL: get_model_state_dict(module)}
    _check_weights(folder, metadata, MODEL, state[MODEL])
    if ref is not None:
        state[REFERENCE] = get_model_state_dict(ref)
        _check_weights(folder, metadata, REFERENCE, state[REFERENCE])
    state[OPTIMIZER] = _optimizer_state(module, optimizer)
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
    except CheckpointException as e:  # a BaseException whose str() is every rank's whole traceback:
        first = next((exc for exc, _ in e.failures.values()), e)  # the first rank's error says enough
        raise CheckpointLoadError(f"checkpoint {folder}: DCP could not load it into this model and optimizer "
                                  f"({type(first).__name__}: {first})") from None
    set_model_state_dict(module, state[MODEL])
    set_optimizer_state_dict(module, optimizer, state[OPTIMIZER])
    if ref is not None:
        set_model_state_dict(ref, state[REFERENCE])


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) weights on every rank, keyed by the plain model's names.

    For a module sharded by FSDP2 an all-gather (a collective: every rank calls it), tied parameters
    sharing one tensor as they do in the model (so save_pretrained stores them once); for a plain
    module, a DDP wrapper or its inner module, detached copies of the module's own tensors (no
    `module.` prefix, no communication).
    """
    module = _unwrap(model)
    if _is_fsdp2(module):
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        first: dict[int, str] = {}  # tied parameters (e.g. lm_head = embeddings) share one gathered tensor
        for name, p in module.named_parameters(remove_duplicate=False):
            if name in full:
                full[name] = full[first.setdefault(id(p), name)]
        return full
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def load_model_weights(folder: Path, model: nn.Module) -> None:
    """Only the policy weights ("model") of the DCP checkpoint in `folder`, into a plain `model` in
    one process (e.g. to export a step of a several-rank run); CheckpointLoadError if they do not fit."""
    folder = Path(folder)
    state = {MODEL: get_model_state_dict(model)}
    _check_weights(folder, _read_metadata(folder), MODEL, state[MODEL])
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
    set_model_state_dict(model, state[MODEL])


def load_full_into_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                           optimizer_state: dict) -> None:
    """A one-process checkpoint (full weights; `Optimizer.state_dict()` keyed by parameter position)
    into an FSDP2-sharded `model` and its optimizer: each rank keeps its shards. Collective.

    Positions are those of `optimizer`'s param groups, which name the same parameters in the same
    order as the one-process optimizer did (both built on the model's trainable parameters)."""
    module = _unwrap(model)
    names = {id(p): n for n, p in module.named_parameters()}
    position = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    try:
        state = {position[int(i)]: s for i, s in optimizer_state["state"].items()}
        groups = [{**g, "params": [position[int(i)] for i in g["params"]]} for g in optimizer_state["param_groups"]]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise CheckpointLoadError(f"the optimizer state does not fit this model's parameters ({type(e).__name__}: {e})") \
            from None
    full = StateDictOptions(full_state_dict=True, strict=False)  # a tied weight is stored once
    missing, unexpected = set_model_state_dict(module, weights, options=full)
    tied = {n for n, p in module.named_parameters(remove_duplicate=False)} - set(names.values())
    if unexpected or set(missing) - tied:
        raise CheckpointLoadError(f"the weights do not fit this model (missing {_listed(sorted(set(missing) - tied))}; "
                                  f"unexpected {_listed(sorted(unexpected))})")
    set_optimizer_state_dict(module, optimizer, {"state": state, "param_groups": groups}, options=full)


def load_one_process_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                                reference: nn.Module | None = None) -> None:
    """The files of a one-process checkpoint (model.safetensors, optimizer.pt, reference.safetensors)
    into FSDP2 ranks: every rank reads them whole and keeps its shards. Collective."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if reference is not None and not (folder / "reference.safetensors").is_file():
        raise CheckpointLoadError(f"checkpoint {folder} has no reference.safetensors but this config uses a "
                                  "reference model (loss.kl_coef > 0); was the KL turned on after it was saved?")
    try:
        weights = load_file(folder / "model.safetensors")
        optimizer_state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - name the folder whatever the reason
        raise CheckpointLoadError(f"checkpoint {folder} cannot be read ({type(e).__name__}: {e})") from None
    try:
        load_full_into_sharded(model, optimizer, weights, optimizer_state)
    except CheckpointLoadError as e:
        raise CheckpointLoadError(f"checkpoint {folder}: {e}") from None
    if reference is not None:
        set_model_state_dict(_unwrap(reference), load_file(folder / "reference.safetensors"),
                             options=StateDictOptions(full_state_dict=True, strict=False))
