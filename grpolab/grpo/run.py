"""The run directory: config.yaml, metrics.jsonl, samples.jsonl, TensorBoard, checkpoints, eval.json.

`attach_outputs` adds the per-step writers to a Setup as hooks, so the loop itself does no I/O.
`train_in_run_dir` runs the loop with those writers, checkpoints (grpolab.rundir.checkpoint) and a
graceful stop on SIGTERM/SIGINT (grpolab.grpo.signals).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path

from grpolab.report.metrics import MetricsLogger

WARNINGS_FILE = "warnings.jsonl"


_EPISODE_KEYS = ("turns", "tool_calls", "tool_errors", "stop_reason", "env_reward", "segments")


class SamplesWriter:
    """Writes each step's prompt groups (completions, per-reward scores, reward, advantage; for agent
    episodes also "episode": counts, stop reason and the token segments, grpo.episodes.episode_rows):
    a Setup hook taking the step's `StepRecord` (every rank's groups, in rank order)."""

    def __init__(self, run_dir: Path, every: int):
        self.path = run_dir / "samples.jsonl"
        self.every = max(1, every)

    def __call__(self, step, row, record) -> None:
        if step % self.every:
            return
        G = record.group_size
        lengths = record.lengths.tolist()  # generated, not trained, tokens
        trunc = record.truncated.tolist()
        rewards = record.rewards.tolist()
        adv = record.advantages.tolist()
        per_fn = {k: v.tolist() for k, v in record.scores.items()}
        with self.path.open("a", encoding="utf-8") as f:
            for g, item in enumerate(record.items):
                comps = []
                for i in range(g * G, (g + 1) * G):
                    comps.append({
                        "text": record.texts[i],
                        "rewards": {k: (None if v[i] != v[i] else v[i]) for k, v in per_fn.items()},
                        "reward": None if rewards[i] != rewards[i] else rewards[i],
                        "advantage": adv[i], "length": lengths[i], "truncated": trunc[i],
                    })
                    if record.episodes is not None:  # the transcript, token runs marked policy / env / prompt
                        comps[-1]["episode"] = {k: record.episodes[i][k] for k in _EPISODE_KEYS}
                f.write(json.dumps({"step": step, "prompt": item.prompt, "meta": _jsonable(item.meta),
                                    "completions": comps}) + "\n")


class DegradedWarnings:
    """A Setup hook: degraded behaviour of a step (a reward replaced after an error, optimizer steps
    skipped for a non-finite loss) goes to RUN/warnings.jsonl and to the console, rate-limited: the
    first at once, then at most one line per `interval_s` saying how many came in between."""

    def __init__(self, run_dir: Path, interval_s: float = 30.0, stream=None):
        self.path = run_dir / WARNINGS_FILE
        self.interval_s, self.stream = interval_s, stream
        self.unshown, self.shown_at = 0, -math.inf

    def __call__(self, step, row, record) -> None:
        notes = list(record.notes)
        if row.get("skipped_steps"):
            notes.append(f"{row['skipped_steps']} optimizer step(s) skipped: non-finite loss or gradient")
        if not notes:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, "message": n}) + "\n" for n in notes)
        self.unshown += len(notes)
        if time.monotonic() - self.shown_at >= self.interval_s:
            self._say(f"step {step}: {notes[-1]}")

    def _say(self, message: str) -> None:
        more = f" (+{self.unshown - 1} more since the last warning; all in {self.path})" if self.unshown > 1 else ""
        print(f"grpolab: warning: {message}{more}", file=self.stream or sys.stderr, flush=True)
        self.unshown, self.shown_at = 0, time.monotonic()

    def close(self) -> None:
        if self.unshown:
            self._say(f"{self.unshown} warning(s) not shown yet")


def _jsonable(meta: dict) -> dict:
    out = {}
    for k, v in meta.items():
        try:
            json.dumps(v)
            out[k] = v
        except TypeError:
            out[k] = repr(v)
    return out


class Outputs:
    """The run directory's per-step writers (metrics, samples, warnings); close() at the end."""

    def __init__(self, setup, run_dir: Path):
        r = setup.cfg.run
        self.logger = MetricsLogger(run_dir, tensorboard=r.tensorboard, wandb=bool(r.wandb_project),
                                    wandb_project=r.wandb_project or None)
        self.warnings = DegradedWarnings(run_dir)
        setup.services.hooks.append(lambda step, row, *rest: self.logger.log(row))
        setup.services.hooks.append(SamplesWriter(run_dir, setup.cfg.run.samples_every))
        setup.services.hooks.append(self.warnings)

    def close(self) -> None:
        self.logger.close()
        self.warnings.close()


def attach_outputs(setup, run_dir: Path) -> Outputs | None:
    """Adds the metrics, samples and warnings writers to setup.services.hooks; returns them (close them at the
    end). Only rank 0 writes them (None elsewhere)."""
    return Outputs(setup, run_dir) if setup.services.parallel.is_main else None


def train_in_run_dir(setup, run_dir: Path, resume_from: Path | None = None, resume_hint: str = "") -> int:
    """Runs the GRPO loop of `setup` in run_dir; returns the process exit code.

    resume_from: a complete checkpoint to restore first (metrics.jsonl and samples.jsonl are cut
    back to its step; a fresh start empties them). Checkpoints follow run.checkpoint_every, the
    last step, and SIGTERM/SIGINT (finish the step, save, exit 128 + signal number). The numerics
    guard (TrainingStopped) saves the last good state and exits 3. Done: final/ holds the model.
    resume_hint: the command that continues the run, said when it stops (default: `grpolab train`'s).
    """
    from grpolab.rundir import checkpoint as ck
    from grpolab.grpo import loop as grpo
    from grpolab.grpo.checkpoint_hook import CheckpointHook
    from grpolab.reward_models.refresh import LABELS_FILE
    from grpolab.grpo.setup import TrainingStopped
    from grpolab.grpo.signals import StopSignal
    from grpolab.grpo.speed import speed_line

    par = setup.services.parallel
    resume_hint = resume_hint or f"the same command plus --resume run.out_dir={run_dir}"
    if par.is_main:
        ck.remove_stale_tmp(run_dir / ck.CHECKPOINTS)
    if resume_from is not None:
        for change in ck.config_changes(resume_from, setup.cfg) if par.is_main else ():
            print(f"grpolab: warning: resuming with a changed config: {change}", file=sys.stderr)
        ck.load_checkpoint(setup, resume_from, verify=False)  # resolve_resume verified its files
        if par.is_main:
            print(f"grpolab: resuming after step {setup.start_step} from {resume_from}", file=sys.stderr)
    if par.is_main and setup.services.speed:
        print(f"grpolab: {speed_line(setup.services.speed)}", file=sys.stderr, flush=True)
    if par.is_main:
        for name in ("metrics.jsonl", "samples.jsonl", WARNINGS_FILE, LABELS_FILE):
            ck.truncate_jsonl(run_dir / name, setup.start_step)
        if setup.services.rm_refresh is not None:  # rank 0 appends the labelled pairs to rm_labels.jsonl
            setup.services.rm_refresh.run_dir = run_dir
    par.barrier()
    outputs = attach_outputs(setup, run_dir)
    hook = CheckpointHook(setup, run_dir, loaded_from=resume_from)
    setup.services.hooks.append(hook)  # last: the step's metrics are written before its checkpoint
    try:
        with StopSignal() as stop:
            setup.services.stop = stop
            grpo.train(setup)
    except TrainingStopped as e:
        saved = hook.save_last_good()
        if par.is_main:
            print(f"grpolab: {e}\ngrpolab: the last good state is saved in {saved}", file=sys.stderr)
        return 3
    except Exception as e:
        if not par.active:
            _save_after_crash(hook, resume_hint)
        else:  # saving would wait for the other ranks forever: the last complete checkpoint stands
            print(f"grpolab: rank {par.rank} stops on {type(e).__name__}: {' '.join(str(e).split())[:300]}; "
                  f"continue from the last complete checkpoint ({hook.last or 'none yet'}) with {resume_hint}",
                  file=sys.stderr)
        raise
    finally:
        setup.close()
        if outputs is not None:
            outputs.close()
        if setup.services.progress is not None:
            setup.services.progress.close()
    signum = int(par.reduce_floats([], [], [float(stop.signum if stop.requested else 0)])[2][0])  # any rank's
    asked = par.any(bool(stop.reason))  # a callback asked (grpolab.api.callbacks): the signal's path, exit code 0
    if signum or asked:
        if hook.saved_step != hook.done:  # the signal came after the step's hook had looked
            hook.save()
        if par.is_main:
            by = signal.Signals(signum).name if signum else (stop.reason or "a callback on another rank")
            print(f"grpolab: stopped by {by} after {hook.done} of {setup.cfg.train.steps} "
                  f"steps; checkpoint {hook.last}. Continue with {resume_hint}.", file=sys.stderr)
        return 128 + signum if signum else 0
    save_final(setup, run_dir / "final")
    if par.is_main and setup.services.rm_refresh is not None:  # the refreshed reward models, as RM folders
        setup.services.rm_refresh.export(run_dir / "reward_models_refreshed")
    if par.is_main:
        from grpolab.rundir.rundir import mark_finished

        mark_finished(run_dir)
    return 0


def save_final(setup, folder: Path) -> None:
    """The trained policy as a transformers folder (weights gathered from every rank with FSDP2),
    with its tokenizer, PPO's value head beside it (value_head.safetensors) and the integrity manifest
    every reader checks (grpolab.manifest); written by rank 0."""
    from grpolab.manifest import write_manifest

    state = None
    if setup.services.parallel.shards_parameters:  # gathered on every rank (a collective), written by rank 0
        from grpolab.parallel.checkpoint import full_state_dict

        state = full_state_dict(setup.models.policy)
    if setup.services.parallel.is_main:
        setup.models.policy.save_pretrained(folder, state_dict=state)
        setup.models.tokenizer.save_pretrained(folder)
        if setup.models.critic is not None:
            from safetensors.torch import save_model

            save_model(setup.models.critic.head, str(folder / "value_head.safetensors"))
        write_manifest(folder)
    setup.services.parallel.barrier()


def _save_after_crash(hook, resume_hint: str) -> None:
    """Saves the step boundary when a step failed before updating the policy; never masks the error."""
    try:
        path = hook.save_on_error()
    except Exception as e:  # noqa: BLE001 - the original error is what the user must see
        print(f"grpolab: could not save a checkpoint after the error ({type(e).__name__}: {e})", file=sys.stderr)
        return
    if path is not None:
        print(f"grpolab: the state before the failed step is saved in {path}; fix the cause and continue "
              f"with {resume_hint}", file=sys.stderr)
