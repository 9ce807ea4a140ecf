"""Sharded checkpoints round-trip exactly: weights, AdamW moments and steps, and a frozen reference
model come back at world size 1 (no process group) and at world size 2 (gloo ranks on this CPU, DDP
and FSDP2), across world sizes in both directions; a checkpoint that does not fit says so.

All the two-rank work happens in one spawn (module fixture `ranks`): spawning is the slow part."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from grpolab.parallel.checkpoint import CheckpointLoadError, full_state_dict, load_sharded, save_sharded
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

WORLD = 2
RESUME_SEED = 100  # the batch of the step taken after a load, the same on every rank
ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")


@functools.cache
def _tokenizer():
    return build_char_tokenizer()


def _model(seed: int = 0) -> torch.nn.Module:
    """The tiny causal LM (tied embeddings) with one frozen weight, as LoRA-like training has."""
    model = build_tiny_model(_tokenizer(), hidden_size=32, num_layers=2, num_heads=2, seed=seed)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    return model


def _reference(seed: int = 0) -> torch.nn.Module:
    return build_tiny_model(_tokenizer(), hidden_size=32, num_layers=2, num_heads=2, seed=seed).requires_grad_(False)


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    from grpolab.forward.compiled import transformer_blocks

    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


def _train(model, optimizer, steps: int, seed: int, forward=None) -> None:
    """`steps` AdamW steps of the LM loss on random rows (`forward`: the wrapper to call, if any)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(3, 40, (2, 7), generator=g)
        (forward or model)(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _adam_state(module: torch.nn.Module, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's state by parameter name, full tensors (FSDP2 shards all-gathered: collective)."""
    out = {}
    for name, p in module.named_parameters():
        if p in optimizer.state:
            out[name] = {k: v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()
                         for k, v in optimizer.state[p].items()}
    return out


def _snapshot(module, optimizer) -> tuple[dict, dict]:
    return full_state_dict(module), _adam_state(module, optimizer)


def _assert_weights(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"{what}: {name}")


def _assert_adam(got: dict, want: dict, what: str) -> None:
    assert want and set(got) == set(want), f"{what}: optimizer state names differ: {set(got) ^ set(want)}"
    for name in want:
        assert set(got[name]) == set(ADAM_KEYS), f"{what}: {name} has {sorted(got[name])}"
        for key in ADAM_KEYS:
            torch.testing.assert_close(got[name][key], want[name][key], rtol=0, atol=0, msg=f"{what}: {name}.{key}")


def _assert_differ(got: dict, want: dict) -> None:
    """Guard: the fresh objects a load fills must differ from what it should restore (else an
    equality after the load proves nothing)."""
    assert any(not torch.equal(got[k], want[k]) for k in want), "the fresh model already equals the checkpoint"


def _rank(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel

    try:
        tmp, out = Path(tmp), {}
        # FSDP2: train 2 steps on this rank's rows; save with a sharded frozen reference
        model, ref = _shard(_model()), _shard(_reference())
        optimizer = _optimizer(model)
        _train(model, optimizer, 2, seed=rank)
        save_sharded(tmp / "fsdp2", model, optimizer, reference=ref)
        out["fsdp2"] = (*_snapshot(model, optimizer), full_state_dict(ref))
        # DDP: save through the wrapper and through its inner module
        model = _model()
        ddp, optimizer = DistributedDataParallel(model), _optimizer(model)
        _train(model, optimizer, 2, seed=rank, forward=ddp)
        save_sharded(tmp / "ddp", ddp, optimizer)
        save_sharded(tmp / "ddp-inner", model, optimizer)
        out["ddp"] = full_state_dict(ddp), _adam_state(model, optimizer)
        out["ddp-inner-full"] = full_state_dict(model)
        # the reverse: the world-1 checkpoint into FSDP2 (then one more step) and into DDP's inner module
        model = _shard(_model(seed=1))
        optimizer = _optimizer(model)
        load_sharded(tmp / "world1", model, optimizer)
        out["to-fsdp2"] = _snapshot(model, optimizer)
        _train(model, optimizer, 1, seed=RESUME_SEED)
        out["to-fsdp2-stepped"] = full_state_dict(model)
        model = _model(seed=1)
        ddp, optimizer = DistributedDataParallel(model), _optimizer(model)
        load_sharded(tmp / "world1", model, optimizer)
        out["to-ddp"] = full_state_dict(ddp), _adam_state(model, optimizer)
        if rank == 0:
            torch.save(out, tmp / "ranks.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, free_port):
    """One spawn of 2 gloo ranks. Before it, this process saves a world-1 checkpoint (`world1`) for
    the ranks to load. Returns (folder, the ranks' results, the world-1 weights and AdamW state as
    saved, the world-1 weights after one more step on the RESUME_SEED batch)."""
    tmp = tmp_path_factory.mktemp("ranks")
    model = _model()
    optimizer = _optimizer(model)
    _train(model, optimizer, 2, seed=7)
    save_sharded(tmp / "world1", model, optimizer)
    saved = _snapshot(model, optimizer)
    _train(model, optimizer, 1, seed=RESUME_SEED)
    mp.start_processes(_rank, args=(free_port(), str(tmp)), nprocs=WORLD, start_method="spawn")
    return tmp, torch.load(tmp / "ranks.pt"), saved, full_state_dict(model)


def _load_world1(folder: Path, with_reference: bool = False):
    """A fresh (differently seeded) model, optimizer and reference loaded from `folder` here, with no
    process group: (weights, AdamW state by name, reference weights or None)."""
    model, ref = _model(seed=1), _reference(seed=1) if with_reference else None
    optimizer = _optimizer(model)
    load_sharded(folder, model, optimizer, reference=ref)
    return (*_snapshot(model, optimizer), full_state_dict(ref) if ref is not None else None)


def test_world1_round_trip_then_identical_step(tmp_path):
    assert not torch.distributed.is_initialized()
    model = _model()
    optimizer = _optimizer(model)
    _train(model, optimizer, 2, seed=0)
    save_sharded(tmp_path / "ck", model, optimizer)
    fresh = _model(seed=1)
    fresh_optimizer = _optimizer(fresh)
    fresh_optimizer.param_groups[0]["lr"] = 0.5  # the saved param groups (lr 1e-2) must replace it
    _assert_differ(full_state_dict(fresh), full_state_dict(model))
    load_sharded(tmp_path / "ck", fresh, fresh_optimizer)
    _assert_weights(full_state_dict(fresh), full_state_dict(model), "weights")
    _assert_adam(_adam_state(fresh, fresh_optimizer), _adam_state(model, optimizer), "AdamW")
    assert float(fresh_optimizer.state[fresh.lm_head.weight]["step"]) == 2
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    _train(model, optimizer, 1, seed=RESUME_SEED)
    _train(fresh, fresh_optimizer, 1, seed=RESUME_SEED)
    _assert_weights(full_state_dict(fresh), full_state_dict(model), "after one more step")


def test_fsdp2_checkpoint_loads_at_world1(ranks):
    tmp, got, _, _ = ranks
    weights, adam, ref = got["fsdp2"]
    _assert_differ(full_state_dict(_model(seed=1)), weights)
    loaded = _load_world1(tmp / "fsdp2", with_reference=True)
    _assert_weights(loaded[0], weights, "fsdp2 -> world 1 weights")
    _assert_adam(loaded[1], adam, "fsdp2 -> world 1 AdamW")
    _assert_weights(loaded[2], ref, "fsdp2 -> world 1 reference")
    _assert_weights(ref, full_state_dict(_reference()), "the sharded reference as saved")


def test_ddp_checkpoint_loads_at_world1_and_world1_loads_at_two_ranks(ranks):
    tmp, got, (saved_weights, saved_adam), stepped = ranks
    weights, adam = got["ddp"]
    _assert_weights(got["ddp-inner-full"], weights, "full_state_dict of DDP's inner module")
    for folder in ("ddp", "ddp-inner"):  # saved through the wrapper, and through its inner module
        loaded = _load_world1(tmp / folder)
        _assert_weights(loaded[0], weights, f"{folder} -> world 1 weights")
        _assert_adam(loaded[1], adam, f"{folder} -> world 1 AdamW")
    _assert_differ(full_state_dict(_model(seed=1)), saved_weights)
    for target in ("to-fsdp2", "to-ddp"):
        _assert_weights(got[target][0], saved_weights, f"world 1 -> {target} weights")
        _assert_adam(got[target][1], saved_adam, f"world 1 -> {target} AdamW")
    # both ranks stepped on the same batch: their averaged gradient is this process's gradient
    for name, want in stepped.items():
        torch.testing.assert_close(got["to-fsdp2-stepped"][name], want, msg=f"resumed step at 2 ranks: {name}")
    assert any(not torch.equal(stepped[k], saved_weights[k]) for k in stepped), "the resumed step moved nothing"


def test_reference_round_trip_and_load_errors(tmp_path):
    model, ref = _model(), _reference()
    optimizer = _optimizer(model)
    _train(model, optimizer, 2, seed=0)
    save_sharded(tmp_path / "with-ref", model, optimizer, reference=ref)
    save_sharded(tmp_path / "no-ref", model, optimizer)
    _assert_differ(full_state_dict(_reference(seed=1)), full_state_dict(ref))
    loaded = _load_world1(tmp_path / "with-ref", with_reference=True)
    _assert_weights(loaded[2], full_state_dict(ref), "reference")
    _assert_weights(loaded[0], full_state_dict(model), "policy next to a reference")
    _assert_weights(_load_world1(tmp_path / "with-ref")[0], full_state_dict(model), "reference left unread")

    with pytest.raises(CheckpointLoadError, match="no reference model") as err:
        _load_world1(tmp_path / "no-ref", with_reference=True)
    assert str(tmp_path / "no-ref") in str(err.value)
    wider = build_tiny_model(_tokenizer(), hidden_size=48, num_layers=2, num_heads=2, seed=0)
    with pytest.raises(ValueError, match="do not fit") as err:  # CheckpointLoadError is a ValueError
        load_sharded(tmp_path / "no-ref", wider, _optimizer(wider))
    assert isinstance(err.value, CheckpointLoadError) and str(tmp_path / "no-ref") in str(err.value)
    assert "model.embed_tokens.weight (49, 32) in the checkpoint, (49, 48) here" in str(err.value)
    unfrozen = build_tiny_model(_tokenizer(), hidden_size=32, num_layers=2, num_heads=2, seed=0)
    with pytest.raises(CheckpointLoadError, match="up_proj") as err:  # trainable here, frozen (no moments) there
        load_sharded(tmp_path / "no-ref", unfrozen, _optimizer(unfrozen))
    assert str(tmp_path / "no-ref") in str(err.value)
    with pytest.raises(CheckpointLoadError, match="no DCP checkpoint"):
        load_sharded(tmp_path / "nothing", model, optimizer)


@pytest.mark.parametrize("with_grads", [False, True])
def test_unstepped_optimizer_checkpoint(tmp_path, with_grads):
    """An optimizer saved before its first step: saving leaves its next step that of a fresh optimizer
    (the state dict API would leave AdamW at step 1), and the checkpoint holds its moments (the API
    returns no state at all when gradients exist)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 40, (2, 7), generator=g)
    runs = []
    for save in (False, True):
        model = _model()
        optimizer = _optimizer(model)
        if with_grads:
            model(input_ids=ids, labels=ids).loss.backward()
        if save:
            save_sharded(tmp_path / "ck", model, optimizer)
        if not with_grads:
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        runs.append(full_state_dict(model))
    _assert_weights(runs[1], runs[0], "first step after a save")
    loaded = _load_world1(tmp_path / "ck")
    assert loaded[1] and all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in loaded[1].values())
