"""`grpolab export RUN_DIR --out DIR`: a run's policy as a standalone Hugging Face folder.

The folder holds the model (LoRA adapters merged into the base weights), its config, generation
config and tokenizer (with its chat template): `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it without grpolab. The weights come from a step
checkpoint (`--step N`; every checkpoint holds the whole policy) or, by default, from the run's
final policy: `final/` when it is a whole model, else the newest checkpoint. A checkpoint's files are
verified against the SHA-256 of its manifest first (a damaged newest one is named and skipped; a damaged
`--step N` is an error). `out` is claimed like a run folder (grpolab.rundir.rundir.claim): held by this
process while it is written, and a folder holding a run, an earlier export or the user's own files is
refused unless `overwrite` moves it aside.
"""

from __future__ import annotations

from pathlib import Path

from grpolab import config as C
from grpolab.manifest import check_manifest
from grpolab.rundir import checkpoint as ck


def _checkpoint_weights(path: Path) -> Path:
    """A checkpoint's policy weights: model.safetensors, or dcp/ when several ranks wrote it."""
    return path / "dcp" if (path / "dcp").is_dir() else path / "model.safetensors"


def _weights_of(run_dir: Path, step: int | None, say=None) -> Path:
    """The policy weights to export: a checkpoint's (model.safetensors or dcp/), or final/'s."""
    root = run_dir / ck.CHECKPOINTS
    if step is not None:
        path = root / f"step-{step}"
        if not path.is_dir():
            steps = [p.name for p in ck.complete_checkpoints(root)] if root.is_dir() else []
            raise FileNotFoundError(f"{run_dir}: no checkpoint step-{step} "
                                    f"(complete ones: {', '.join(steps) or 'none'})")
        ck.check_complete(path, verify=True)
        return _checkpoint_weights(path)
    final = run_dir / "final"
    if (final / "model.safetensors").is_file():
        check_manifest(final, "final policy")
        return final / "model.safetensors"
    latest = ck.latest_checkpoint(root, verify=True, say=say) if root.is_dir() else None
    if latest is None:
        raise FileNotFoundError(f"{run_dir}: neither final/model.safetensors nor a complete checkpoint to export "
                                "(a LoRA run's final/ holds only the adapter; export one of its checkpoints)")
    return _checkpoint_weights(latest)


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, *, overwrite: bool = False,
               say=None) -> Path:
    """Writes the run's policy (see the module docstring) to `out`; returns it. say(message) hears what
    was skipped and why, and what was moved aside."""
    from safetensors.torch import load_model

    from grpolab.models.policy import load_policy
    from grpolab.rundir.rundir import claim, mark_finished

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a grpolab run directory (no config.yaml)")
    cfg = C.load(str(run_dir / "config.yaml"))
    weights = _weights_of(run_dir, step, say)
    claim(out, "export", overwrite=overwrite, field="--out", say=say or (lambda m: None))
    policy, tokenizer = load_policy(cfg)  # the run's architecture (LoRA wrapped when it trained LoRA)
    try:
        if weights.is_dir():
            from grpolab.parallel.checkpoint import load_model_weights

            load_model_weights(weights, policy)
        else:
            load_model(policy, str(weights), strict=True)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"export: {weights} does not fit the model of {run_dir / 'config.yaml'}: "
                         f"{' '.join(str(e).split())[:300]}") from None
    except Exception as e:  # noqa: BLE001 - a damaged file: safetensors' own error type
        raise ValueError(f"export: {weights} cannot be read ({type(e).__name__}: {e})") from None
    if cfg.model.lora_rank > 0:
        policy = policy.merge_and_unload()
    policy.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if getattr(policy, "generation_config", None) is not None:
        policy.generation_config.save_pretrained(out)
    from grpolab.models.serving import make_servable

    make_servable(policy, tokenizer, out, say)  # AutoTokenizer loads what was trained with
    mark_finished(out)
    return out
