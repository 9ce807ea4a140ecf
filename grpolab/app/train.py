"""`grpolab train` and `grpolab sft` of a config: run directory, resume, the loop (or SFT), final/."""

from __future__ import annotations

from pathlib import Path

from grpolab.app.common import say
from grpolab.config import ConfigError


def train_from_cfg(cfg, overwrite: bool = False) -> int:
    """`grpolab train` of a loaded config: run directory, resume (run.resume), the loop, final/."""
    return run_grpo(cfg, overwrite)[0]


def run_grpo(cfg, overwrite: bool = False, *, policy=None, tokenizer=None, prompts=None,
             hooks: tuple = ()) -> tuple[int, Path]:
    """`train_from_cfg` with Python objects (grpolab.api.train): a policy and its tokenizer instead of
    model.name_or_path's, a prompt stream instead of data.source's, Setup hooks (callbacks) run before
    the run directory's writers. Returns (exit code, run directory)."""
    from grpolab.parallel.launch import init_parallel
    from grpolab.report.progress import Progress
    from grpolab.rundir.checkpoint import resolve_resume, step_of
    from grpolab.rundir.rundir import make_run_dir, mark_stopped, recording_failure, write_config
    from grpolab.grpo.run import train_in_run_dir
    from grpolab.grpo.setup import build_setup
    from grpolab.models.loading import resolve_compute_dtype

    if cfg.run.resume == "auto" and not cfg.run.out_dir:
        raise ConfigError("--resume (run.resume=auto) needs the run folder to continue: add run.out_dir=DIR")
    par = init_parallel(cfg.model.device, cfg.train.parallel, resolve_compute_dtype(cfg.model.dtype, cfg.model.device))
    note = say if par.is_main else None
    if cfg.run.out_dir:  # held (rank 0) before its checkpoints are read: no run prunes them meanwhile
        from grpolab.rundir.lock import lock_folder

        _on_rank0(par, lambda: str(lock_folder(cfg.run.out_dir, "run.out_dir")))
    if cfg.off_policy_steps and note is not None:
        from grpolab.app.config_reference import off_policy_note

        note(f"grpolab: note: {off_policy_note(cfg)}")
    resume_from = None if overwrite else resolve_resume(cfg.run.resume, Path(cfg.run.out_dir or "."), say=note,
                                                      checkpoint_every=cfg.run.checkpoint_every)
    if resume_from is not None and not cfg.run.out_dir:  # an explicit checkpoint: continue its run
        cfg = cfg.replace(**{"run.out_dir": str(resume_from.parent.parent)})
    run_dir = Path(_on_rank0(par, lambda: str(make_run_dir(cfg, command="train", resume=bool(cfg.run.resume),
                                                            overwrite=overwrite))))
    if par.is_main:
        write_config(cfg, run_dir)
    start = min(step_of(resume_from), cfg.train.steps) if resume_from is not None else 0
    progress = Progress(cfg.train.steps, enabled=cfg.run.progress and par.is_main, start_step=start)
    with recording_failure(run_dir, par.is_main):
        setup = build_setup(cfg, policy, tokenizer, prompts, progress=progress, parallel=par)
        if cfg.run.eval_every:  # before the callbacks: on_evaluate and on_step_end see the eval/ figures
            from grpolab.grpo.eval_hook import EvalHook

            setup.services.hooks.append(EvalHook(setup))
        setup.services.hooks.extend(hook.attach(setup) if hasattr(hook, "attach") else hook for hook in hooks)
        code = train_in_run_dir(setup, run_dir, resume_from)
    if par.is_main and code != 0:  # a signal (resumable) or the numerics guard
        mark_stopped(run_dir, f"exit code {code}", "stopped")
    if par.is_main:
        print(f"run directory: {run_dir}")
    return code, run_dir


def _on_rank0(par, fn):
    """fn() on rank 0, its result (or its ConfigError, raised again) on every rank."""
    result = None
    if par.is_main:
        try:
            result = ("ok", fn())
        except ConfigError as e:
            result = ("error", str(e))
    kind, value = par.broadcast(result)
    if kind == "error":
        raise ConfigError(value)
    return value


def sft_from_cfg(cfg, overwrite: bool = False) -> int:
    """`grpolab sft` of a loaded config: run directory, SFT (the built-in task's recipe, or data.source's
    pairs, capped by sft.examples), final/; run.json says failed when it raises."""
    run_sft(cfg, overwrite)
    return 0


def run_sft(cfg, overwrite: bool = False, *, policy=None, tokenizer=None) -> tuple[Path, list[float]]:
    """`sft_from_cfg` with a policy and its tokenizer instead of model.name_or_path's (grpolab.api.sft).
    Returns (run directory, the loss per step)."""
    from grpolab.rundir.rundir import make_run_dir, recording_failure, write_config

    run_dir = make_run_dir(cfg, "sft", command="sft", overwrite=overwrite)
    write_config(cfg, run_dir)
    with recording_failure(run_dir):
        losses = _sft_in(cfg, run_dir, policy, tokenizer)
    print(f"final loss {losses[-1]:.4f}; run directory: {run_dir}")
    return run_dir, list(losses)


def _sft_in(cfg, run_dir: Path, policy=None, tokenizer=None) -> list[float]:
    from grpolab.data.build import arith_task
    from grpolab.manifest import write_manifest
    from grpolab.models.loading import resolve_compute_dtype
    from grpolab.models.policy import load_policy
    from grpolab.rundir.rundir import mark_finished
    from grpolab.sft.sft import progress_printer, sft_builtin, train_sft

    model, tok = load_policy(cfg) if policy is None else (policy, tokenizer)
    if cfg.data.source != "builtin:arith":
        from grpolab.data.build import capped, source_options
        from grpolab.data.sft_pairs import load_sft_pairs

        d = cfg.data
        pairs = load_sft_pairs(d.source, response_field=d.response_field, prompt_field=d.prompt_field,
                               messages_field=d.messages_field, **source_options(cfg, tok))
        pairs = capped(pairs, cfg.sft.examples, "sft.examples")
        print(f"[sft] {len(pairs)} examples, {cfg.sft.steps} steps of {cfg.sft.batch_size}", flush=True)
        losses = train_sft(model, tok, pairs, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size,
                           microbatch_size=cfg.sft.microbatch_size, lr=cfg.sft.lr, seed=cfg.train.seed,
                           compute_dtype=resolve_compute_dtype(cfg.model.dtype, cfg.model.device),
                           on_step=progress_printer(cfg.sft.steps, lambda m: print(m, flush=True)))
    else:  # the built-in task: refusal kinds and the early stop on a training-side probe as in the demo
        losses = sft_builtin(model, tok, arith_task(cfg), cfg)
    model.save_pretrained(run_dir / "final")
    tok.save_pretrained(run_dir / "final")
    write_manifest(run_dir / "final")
    mark_finished(run_dir)
    return losses
