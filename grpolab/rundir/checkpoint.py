"""Checkpoints of a GRPO run: save atomically, keep the last K, find the latest, resume exactly.

A checkpoint `RUN/checkpoints/step-N/` holds the state after N completed GRPO steps:

    model.safetensors      the policy's weights (safetensors; tied weights stored once)
    reference.safetensors  the frozen reference model, when it is a separate copy (KL on, no LoRA)
    value_head.safetensors PPO's value head (loss.advantage=gae; one process only)
    optimizer.pt           AdamW state            } torch.save, read back with
    scheduler.pt           LR scheduler position  } torch.load(weights_only=True):
    rng.pt                 python, numpy, torch (CPU, CUDA) global generators
    data.json              the prompt stream's cursor (PromptStream.state_dict())
    state.json             step, consecutive skipped optimizer steps
    config.yaml            the fully resolved config
    COMPLETE               written last: a JSON manifest of the files, their sizes and SHA-256

A run on several ranks (torchrun) writes `dcp/` instead of the first three: policy, AdamW state and
reference saved by every rank with torch.distributed.checkpoint (grpolab.parallel.checkpoint; sharded
with FSDP2). DCP reshards on load, so such a checkpoint resumes at any world size, one process
included. Rank 0 writes the other files, the manifest and the rename.

Writing: everything goes to `checkpoints/.tmp-step-N-<pid>/`, each file and the folder are
fsynced, COMPLETE is written last, and the folder is renamed to `step-N` (atomic on POSIX). A
write that is interrupted (an exception, SIGKILL, a full disk) leaves at most a `.tmp-*` folder,
which is never read and is removed by the next run. A `step-N` folder is used only when its
COMPLETE manifest matches the files on disk (sizes; on resume also the SHA-256 of every file, so a
damaged checkpoint is named and the previous one used). Nothing in a checkpoint is unpickled: weights come
from safetensors, the .pt files are read with `weights_only=True`.

Exactness: resuming from step-N and running to step M gives the same metrics (wall-clock timings
aside) as an uninterrupted run to M, because every input of a step is restored: weights, AdamW
moments, the LR schedule, the global RNGs, the data cursor, the skip counter; the sampling and
shuffling streams are seeded per step from (train.seed, rank, step). metrics.jsonl and
samples.jsonl are cut back to the lines of steps < N (`truncate_jsonl`), so lines written after
the checkpoint and before a crash are not duplicated. TensorBoard events of those steps are
written again (TensorBoard shows the later ones).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_model, save_model

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder or file and what to do."""


# ----------------------------------------------------------------------------- finding
def step_of(path: str | os.PathLike) -> int:
    """N of a `step-N` folder."""
    m = _STEP_DIR.fullmatch(Path(path).name)
    if not m:
        raise CheckpointError(f"{path}: not a checkpoint folder (expected a name like step-12)")
    return int(m.group(1))


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_complete(path: Path, verify: bool = False) -> dict:
    """The COMPLETE manifest of a checkpoint folder; CheckpointError naming what is wrong. Sizes
    are always checked; with `verify` also every file's SHA-256 (what a resume does)."""
    marker = path / MARKER
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {MARKER} marker): it was interrupted "
                              "while being written; resume from an earlier one")
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: {marker} is damaged (not the JSON manifest grpolab "
                              "writes); delete this checkpoint to resume from an earlier one") from None
    for name, entry in files.items():
        size, digest = (entry, None) if isinstance(entry, int) else (entry.get("size"), entry.get("sha256"))
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            got = f.stat().st_size if f.is_file() else "missing"
            raise CheckpointError(f"checkpoint file {f} is damaged ({got} bytes, the manifest says {size}); "
                                  "delete this checkpoint to resume from an earlier one")
        if verify and digest is not None and _sha256(f) != digest:
            raise CheckpointError(f"checkpoint file {f} is damaged (its content does not match the SHA-256 that "
                                  f"{MARKER} recorded); delete this checkpoint to resume from an earlier one")
    return manifest


def is_complete(path: Path) -> bool:
    try:
        check_complete(path)
        return True
    except CheckpointError:
        return False


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The usable `step-N` folders under root, oldest first (incomplete and .tmp-* ones skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and is_complete(p)]
    return sorted(found, key=step_of)


def latest_checkpoint(root: str | os.PathLike, verify: bool = False, say=None) -> Path | None:
    """The newest complete checkpoint under root; with `verify` the newest whose files match their
    SHA-256. Each newer step-N folder that is skipped (incomplete, a file of the wrong size, or with
    `verify` a file whose SHA-256 does not match) is named with the reason through say(message)."""
    root = Path(root)
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name)] if root.is_dir() else []
    for path in sorted(found, key=step_of, reverse=True):
        try:
            check_complete(path, verify=verify)
            return path
        except CheckpointError as e:
            if say is not None:
                say(f"grpolab: warning: {e}; skipped")
    return None


def _logged_steps(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip())
    except OSError:
        return 0


def resolve_resume(resume: str, run_dir: Path, say=None, checkpoint_every: int = 0) -> Path | None:
    """The checkpoint that run.resume names (its files verified), or None for a fresh start.

    "" -> None. "auto" -> the latest usable checkpoint of run_dir (damaged ones named through
    say(message) and skipped); None if the run has none and no checkpoint was due yet (no step
    logged, or at most `checkpoint_every` (run.checkpoint_every) steps and no step-N folder: killed
    before its first checkpoint, those steps are run again), so a job script can always pass
    --resume; CheckpointError when a checkpoint should exist but none is usable (never a silent
    restart over them). A path -> that step-N folder (it must be usable), or the latest usable
    checkpoint of a run folder or a checkpoints folder.
    """
    if not resume:
        return None
    if resume == "auto":
        found = latest_checkpoint(run_dir / CHECKPOINTS, verify=True, say=say)
        logged = _logged_steps(run_dir)
        damaged = any((run_dir / CHECKPOINTS).glob("step-*"))
        if found is None and logged and (damaged or not 0 < logged <= checkpoint_every):
            raise CheckpointError(f"{run_dir} holds a run with {logged} logged steps but no usable "
                                  "checkpoint to continue it from; refusing to start over it (--overwrite moves it "
                                  "aside and starts a fresh run)")
        if found is None and logged and say is not None:
            say(f"grpolab: {run_dir} logged {logged} steps before its first checkpoint (run.checkpoint_every="
                f"{checkpoint_every}); starting over")
        return found
    p = Path(resume).expanduser()
    if not p.exists():
        raise CheckpointError(f"run.resume={resume!r}: no such checkpoint, run or checkpoints folder")
    if _STEP_DIR.fullmatch(p.name) or (p / MARKER).exists():
        check_complete(p, verify=True)
        return p
    for root in (p / CHECKPOINTS, p):
        latest = latest_checkpoint(root, verify=True, say=say)
        if latest is not None:
            return latest
    roots = [r for r in (p / CHECKPOINTS, p) if r.is_dir()]
    partial = sorted(q.name for r in roots for q in r.iterdir() if q.name.startswith(("step-", ".tmp-")))
    raise CheckpointError(f"run.resume={resume!r}: no complete checkpoint in it (looked for step-N folders "
                          f"with a {MARKER} marker in {p} and {p / CHECKPOINTS}; incomplete: {partial or 'none'})")


# ----------------------------------------------------------------------------- writing
def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj))


def rng_state() -> dict:
    """The global RNGs (python, numpy, torch), as tensors and plain lists (loadable with
    weights_only=True). The loop's own streams are seeded per step (Setup.seed_step)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, key.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def reference_model(setup) -> torch.nn.Module | None:
    """The reference model when it is a separate module (a frozen copy); None without KL or with LoRA."""
    return getattr(setup.models.reference, "model", None) if setup.models.reference is not None else None


def write_state(setup, d: Path, step: int, reference_from: Path | None = None) -> None:
    """Writes every file of a checkpoint of `setup` into folder d (not fsynced, no marker); on
    several ranks every rank writes its part of dcp/ and rank 0 the rest."""
    from grpolab import config as C

    ref = reference_model(setup)
    if setup.services.parallel.active:
        from grpolab.parallel.checkpoint import save_sharded

        save_sharded(d / "dcp", setup.models.policy, setup.optim.optimizer, ref)
        if not setup.services.parallel.is_main:
            return
    else:
        save_model(setup.models.policy, str(d / "model.safetensors"))
        if setup.models.critic is not None:
            save_model(setup.models.critic.head, str(d / "value_head.safetensors"))
        if ref is not None:
            _write_reference(ref, d / "reference.safetensors", reference_from)
        torch.save(setup.optim.optimizer.state_dict(), d / "optimizer.pt")
    torch.save(setup.optim.scheduler.state_dict(), d / "scheduler.pt")
    if setup.services.rm_refresh is not None:
        setup.services.rm_refresh.save(d)
    torch.save(rng_state(), d / "rng.pt")
    _write_json(d / "data.json", setup.prompt_state())
    _write_json(d / "state.json", {"step": step, "consecutive_skips": setup.consecutive_skips})
    (d / "config.yaml").write_text(C.dump(setup.cfg))


def _write_reference(ref: torch.nn.Module, dst: Path, reference_from: Path | None) -> None:
    """The reference never changes during a run: hard-link the file of the checkpoint this run
    last wrote or loaded when there is one (no copy on disk), else write it."""
    src = reference_from / dst.name if reference_from is not None else None
    if src is not None and src.is_file():
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system, or links not supported
            pass
    save_model(ref, str(dst))


def save_checkpoint(setup, root: str | os.PathLike, step: int, keep: int,
                    reference_from: Path | None = None, flush: Iterable[Path] = ()) -> Path:
    """Saves `setup` as root/step-<step> atomically (see the module docstring); returns the folder.

    keep: how many complete checkpoints to keep (older ones are deleted after the save).
    reference_from: a checkpoint of this run whose reference.safetensors may be hard-linked.
    flush: files to fsync first (metrics.jsonl, samples.jsonl), so that the lines of the steps
        a checkpoint covers are on disk before it is.
    An existing step-<step> is replaced only once the new one is complete.
    """
    root, par = Path(root), setup.services.parallel
    main = par.is_main
    final, tmp = root / f"step-{step}", root / par.broadcast(f".tmp-step-{step}-{os.getpid()}")  # rank 0's name
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for f in flush:
            if Path(f).is_file():
                _fsync(Path(f))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    par.barrier()
    try:
        write_state(setup, tmp, step, reference_from)
        par.barrier()  # every rank's shard is written
        if main:
            _seal(tmp, final, root, step)
    except BaseException:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    par.barrier()  # nobody goes on before the checkpoint exists
    if main:
        prune(root, keep)
    return final


def _seal(tmp: Path, final: Path, root: Path, step: int) -> None:
    """fsyncs every file of tmp, writes the COMPLETE manifest, renames tmp to final (atomically)."""
    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(tmp.rglob("*")) if p.is_file()}
    for name in files:
        _fsync(tmp / name)
    for sub in (p for p in tmp.rglob("*") if p.is_dir()):
        _fsync(sub)
    _write_json(tmp / MARKER, {"step": step, "files": files})
    _fsync(tmp / MARKER)
    _fsync(tmp)
    if final.exists():  # a checkpoint of the same step from an earlier attempt: swap it out
        old = root / f".tmp-old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync(root)


def prune(root: Path, keep: int) -> list[Path]:
    """Deletes all but the `keep` newest complete checkpoints, and step folders older than those
    that are incomplete (a deletion cut short); returns the deleted folders. The marker goes
    first, so a folder whose deletion is interrupted is never taken for a complete one."""
    kept = complete_checkpoints(root)[-keep:] if keep > 0 else []
    oldest = step_of(kept[0]) if kept else -1
    old = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and step_of(p) < oldest]
    for p in old:
        (p / MARKER).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return old


def remove_stale_tmp(root: str | os.PathLike) -> list[Path]:
    """Removes `.tmp-*` folders left by interrupted writes (one training process per run folder)."""
    root = Path(root)
    stale = [p for p in root.iterdir() if p.name.startswith(".tmp-")] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


# ----------------------------------------------------------------------------- loading
def _load_pt(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - name the file whatever the reason
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(e).__name__}: {e}); "
                              "delete this checkpoint to resume from an earlier one") from None


def load_weights(model: torch.nn.Module, path: Path) -> None:
    device = next(model.parameters()).device
    try:
        load_model(model, str(path), strict=True, device=str(device))
    except RuntimeError as e:  # wrong shapes or names: another model
        raise CheckpointError(f"checkpoint file {path} does not fit this model (were model.* settings "
                              f"changed since it was saved?): {' '.join(str(e).split())[:400]}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: safetensors' own error type
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(e).__name__}: {e})") from None


def load_checkpoint(setup, path: str | os.PathLike, verify: bool = True) -> int:
    """Restores `setup` from a complete checkpoint folder (its files' SHA-256 checked unless
    `verify` is False: resolve_resume has checked them); sets and returns setup.start_step."""
    path = Path(path)
    check_complete(path, verify=verify)
    if (path / "dcp").is_dir():  # written by several ranks: DCP reshards to this world size
        _load_sharded(setup, path)
    else:
        _load_single(setup, path)
    try:
        setup.optim.scheduler.load_state_dict(_load_pt(path / "scheduler.pt"))
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path / 'scheduler.pt'} does not fit this run: {e}") from None
    set_rng_state(_load_pt(path / "rng.pt"))
    try:
        setup.data.prompts.load_state_dict(json.loads((path / "data.json").read_text()))
        state = json.loads((path / "state.json").read_text())
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: data.json or state.json cannot be used ({e})") from None
    if setup.services.rm_refresh is not None:
        setup.services.rm_refresh.load(path)
    setup.start_step = int(state["step"])
    setup.consecutive_skips = int(state.get("consecutive_skips", 0))
    setup.data.engine.load_weights(setup.start_step, setup.services.parallel.full_state(setup.models.policy))  # an engine's own copy
    return setup.start_step


def _load_single(setup, path: Path) -> None:
    """Weights, reference and AdamW state of a one-process checkpoint (safetensors + optimizer.pt);
    DDP ranks each load the whole of it."""
    if setup.services.parallel.shards_parameters:
        return _load_sharded(setup, path, one_process=True)
    load_weights(setup.models.policy, path / "model.safetensors")
    if setup.models.critic is not None:
        if not (path / "value_head.safetensors").is_file():
            raise CheckpointError(f"checkpoint {path} has no value_head.safetensors but this config trains a value "
                                  "head (loss.advantage=gae); was it saved by another preset?")
        load_weights(setup.models.critic.head, path / "value_head.safetensors")
    ref = reference_model(setup)
    if ref is not None:
        if not (path / "reference.safetensors").is_file():
            raise CheckpointError(f"checkpoint {path} has no reference.safetensors but this config uses a "
                                  "reference model (loss.kl_coef > 0); was the KL turned on after it was saved?")
        load_weights(ref, path / "reference.safetensors")
    try:
        setup.optim.optimizer.load_state_dict(_load_pt(path / "optimizer.pt"))
    except (ValueError, KeyError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {path / 'optimizer.pt'} does not fit this run: {e}") from None


def _load_sharded(setup, path: Path, one_process: bool = False) -> None:
    """A checkpoint through grpolab.parallel.checkpoint: dcp/ (any world size), or with `one_process`
    the files of a one-process checkpoint into FSDP2 ranks."""
    from grpolab.parallel import checkpoint as dck

    try:
        if one_process:
            dck.load_one_process_checkpoint(path, setup.models.policy, setup.optim.optimizer, reference_model(setup))
        else:
            dck.load_sharded(path / "dcp", setup.models.policy, setup.optim.optimizer, reference_model(setup))
    except dck.CheckpointLoadError as e:
        raise CheckpointError(str(e)) from None


WHERE_IT_RUNS = ("train.parallel",)
"""Fields that say how the ranks hold the model, not what a step computes: a checkpoint resumes under
either (DCP reshards), so a difference is not reported as a change."""


def config_changes(path: Path, cfg) -> list[str]:
    """Fields (other than run.*) whose value differs between the checkpoint's config and cfg. A field cfg
    leaves at `auto` where the checkpoint holds a value is not a change: the checkpoint's config holds
    the setup's decisions (`grpo.speed`), and setup decides again."""
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return ["config.yaml (unreadable)"]
    now = yaml.safe_load(yaml.safe_dump(dataclasses.asdict(cfg)))  # same plain types as the file

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out

    a, b = flat(saved), flat(now)
    keys = sorted(k for k in set(a) | set(b) if not k.startswith("run.") and k not in WHERE_IT_RUNS
                  and a.get(k) != b.get(k) and b.get(k) != "auto")
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


def truncate_jsonl(path: str | os.PathLike, before_step: int) -> int:
    """Keeps the complete lines of a metrics/samples file whose "step" < before_step (atomically);
    returns how many were dropped. A missing file is left missing."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            ok = line.endswith("\n") and int(json.loads(line)["step"]) < before_step
        except (ValueError, KeyError, TypeError):
            ok = False
        if ok:
            kept.append(line)
        else:
            dropped += line.strip() != ""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    _fsync(tmp)
    os.replace(tmp, path)
    return dropped
