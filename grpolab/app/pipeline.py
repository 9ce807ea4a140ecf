"""`grpolab pipeline CONFIG`: the whole pipeline from one YAML file.

    sft             grpolab sft on the `sft:` config                       -> OUT/sft/final
    reward_models   grpolab rm per entry, each on its own preference data  -> OUT/rm-<name>/
    grpo            grpolab train on the `grpo:` config, starting from the SFT model, rewarded by
                    its own rewards (e.g. verifiers) plus each reward model × its weight  -> OUT/grpo/
    eval            the GRPO config's held-out prompts, scored by `eval.rewards` (default: the GRPO
                    rewards), for the starting model (π0) and the final policy   -> OUT/eval.json
    report          OUT/grpo/report.html

The file:

    out_dir: runs/my-pipeline
    sft: {preset: sft, model: ..., data: {source: jsonl:sft.jsonl}, sft: {steps: 300}}   # optional
    reward_models:                                                                      # optional
      accuracy: {data: acc.jsonl, eval_data: acc_heldout.jsonl, base: sft, steps: 300, weight: 1.0}
    grpo: {preset: grpo, data: {source: jsonl:prompts.jsonl, eval_source: jsonl:heldout.jsonl}, ...}
    eval: {samples: 4, rewards: [exact_match]}                                          # optional

`sft:` and `grpo:` are grpolab configs (the sections of `grpolab config`); a reward model entry
takes `grpolab rm`'s options (`--lm-coef` is `lm_coef`), `base: sft` (the SFT stage's model),
`weight` and `normalize` (the reward_model reward's score normalization, default fixed). Each stage
writes its own run directory; a finished stage is skipped when the pipeline runs again with the same
settings and input files (their SHA-256, computed again when a file's size or mtime changed; a finished
stage whose settings or inputs changed is an error that names them: `--from STAGE` redoes it and the
stages after it, moving their folders aside); an interrupted GRPO stage resumes from its last checkpoint,
an interrupted SFT or reward-model stage starts again. Every stage's input files are checked to exist
before any stage runs.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from grpolab import config as C
from grpolab.config.io import check_duplicate_keys, key_lines, dump_yaml, from_mapping
from grpolab.errors import ConfigError
from grpolab.rundir.rundir import move_aside, read_run

STAGES = ("sft", "reward_models", "grpo", "eval")
STAGES_FILE = "stages.json"
RM_REWARD_KEYS = ("weight", "normalize")
"""Keys of a reward_models entry that shape its GRPO reward rather than its training."""


class PipelineError(ValueError):
    """A stage stopped on bad input; the message names the stage and the culprit."""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Pipeline:
    """A parsed pipeline file: the stage configs, validated before any stage runs."""

    out_dir: Path
    sft: C.Config | None
    reward_models: dict[str, dict[str, Any]]
    grpo: C.Config
    eval_rewards: list | None
    eval_samples: int
    source: str

    @property
    def sft_dir(self) -> Path:
        return self.out_dir / "sft"

    @property
    def grpo_dir(self) -> Path:
        return self.out_dir / "grpo"

    def rm_dir(self, name: str) -> Path:
        return self.out_dir / f"rm-{name}"


def _lines_under(lines: dict[str, int], prefix: str) -> dict[str, int]:
    n = len(prefix) + 1
    return {k[n:]: v for k, v in lines.items() if k.startswith(prefix + ".")}


def _stage_config(data: dict, section: str, lines: dict, path: str, default_preset: str) -> C.Config | None:
    node = data.get(section)
    if node is None:
        return None
    if not isinstance(node, dict):
        raise ConfigError(f"{path}:{lines.get(section, 1)}: {section}: expected a config mapping (preset:, model:, ...)")
    try:
        return from_mapping(node, [], C.Config, C.PRESETS, _lines_under(lines, section), path, default_preset)
    except ConfigError as e:
        raise ConfigError(f"{section}: {e}") from None


def _rm_options() -> dict[str, Any]:
    """`grpolab rm`'s options (dest -> argparse action), from its own parser."""
    return {a.dest: a for a in _rm_parser()._actions if a.option_strings and a.dest != "help"}


def _rm_parser():
    """An argument parser of `grpolab rm`'s options (grpolab.app.rm.add_arguments)."""
    import argparse

    from grpolab.app.rm import add_arguments

    return add_arguments(argparse.ArgumentParser(prog="grpolab rm"))


def _check_reward_models(node: Any, lines: dict, path: str) -> dict[str, dict[str, Any]]:
    if node is None:
        return {}
    if not isinstance(node, dict):
        raise ConfigError(f"{path}:{lines.get('reward_models', 1)}: reward_models: expected a mapping of name -> "
                          "grpolab rm options")
    known = set(_rm_options()) - {"out", "overwrite"}
    out = {}
    for name, opts in node.items():
        where = f"{path}:{lines.get(f'reward_models.{name}', 1)}: reward_models.{name}"
        if not isinstance(opts, dict) or "data" not in opts:
            raise ConfigError(f"{where}: expected a mapping with at least `data:` (a preference-pairs file)")
        for key in opts:
            if key not in known and key not in RM_REWARD_KEYS:
                at = f"{path}:{lines.get(f'reward_models.{name}.{key}', 1)}: reward_models.{name}.{key}"
                raise ConfigError(f"{at}: unknown option; known: {', '.join(sorted(known | set(RM_REWARD_KEYS)))}")
        out[str(name)] = dict(opts)
    return out


def load_pipeline(path: str, overrides: list[str] | None = None) -> Pipeline:
    """Parses and validates a pipeline file (every stage's config) before anything runs.
    overrides: `section.key=value` strings, e.g. grpo.train.steps=5 or reward_models.accuracy.steps=10."""
    try:
        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
    except OSError as e:
        raise ConfigError(f"pipeline file {path!r} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ConfigError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: a pipeline file is a mapping (out_dir:, sft:, reward_models:, grpo:, eval:)")
    check_duplicate_keys(text, path)
    lines = key_lines(text)
    for key in data:
        if key not in ("out_dir", *STAGES):
            raise ConfigError(f"{path}:{lines.get(key, 1)}: unknown section {key!r}; sections: out_dir, "
                              f"{', '.join(STAGES)}")
    data = _apply_overrides(data, overrides or [])
    if "grpo" not in data:
        raise ConfigError(f"{path}: grpo: the GRPO stage's config is required")
    ev = data.get("eval") or {}
    if not isinstance(ev, dict) or set(ev) - {"samples", "rewards"}:
        raise ConfigError(f"{path}:{lines.get('eval', 1)}: eval: expected a mapping with samples: and rewards:")
    out_dir = data.get("out_dir") or f"runs/pipeline-{time.strftime('%Y%m%d-%H%M%S')}"
    grpo = _stage_config(data, "grpo", lines, path, "grpo")
    eval_rewards = None
    if ev.get("rewards") is not None:
        eval_rewards = grpo.replace(rewards=ev["rewards"]).validate().rewards
    p = Pipeline(Path(out_dir), _stage_config(data, "sft", lines, path, "sft"),
                 _check_reward_models(data.get("reward_models"), lines, path), grpo, eval_rewards,
                 int(ev.get("samples", 0)), path)
    grpo_config(p)  # the GRPO stage's own checks (a reward at all), before any stage runs
    return p


def _apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = json.loads(json.dumps(data))  # a copy
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        parts = key.strip().split(".")
        if not sep or not parts[0] or parts[0] not in ("out_dir", *STAGES):
            raise ConfigError(f"override {ov!r}: expected SECTION.key=value with SECTION one of out_dir, "
                              f"{', '.join(STAGES)} (e.g. grpo.train.steps=5)")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {ov!r}: {p} is not a mapping")
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


# ----------------------------------------------------------------------------- stages
def _fingerprint(spec: Any) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _source_path(source: str | None) -> Path | None:
    """The local file or folder a data source reads (jsonl:PATH, hf:PATH), else None."""
    kind, sep, rest = (source or "").partition(":")
    return Path(rest) if sep and kind in ("jsonl", "hf") else None


def _model_path(name: str) -> Path | None:
    """A model given as a local folder or file (not a hub id or a built-in name)."""
    return Path(name) if name and not name.startswith("builtin:") and Path(name).exists() else None


def stage_inputs(p: Pipeline) -> dict[str, dict[str, Path]]:
    """Each stage's input files and folders: {stage: {field: path}} (data files, a local model, a base)."""
    out: dict[str, dict[str, Path]] = {}
    if p.sft is not None:
        out["sft"] = {"sft.data.source": _source_path(p.sft.data.source),
                      "sft.model.name_or_path": _model_path(p.sft.model.name_or_path)}
    for name, opts in p.reward_models.items():
        base = opts.get("base")
        out[f"reward_models:{name}"] = {
            f"reward_models.{name}.data": None if str(opts["data"]).startswith("builtin:") else Path(opts["data"]),
            f"reward_models.{name}.eval_data": Path(opts["eval_data"]) if opts.get("eval_data") else None,
            f"reward_models.{name}.base": p.sft_dir / "final" if base == "sft" else _model_path(str(base or ""))}
    grpo = {"grpo.data.source": _source_path(p.grpo.data.source),
            "grpo.data.eval_source": _source_path(p.grpo.data.eval_source)}
    grpo["grpo.model.name_or_path"] = p.sft_dir / "final" if p.sft is not None else _model_path(
        p.grpo.model.name_or_path)
    out["grpo"], out["eval"] = grpo, {"grpo.data.eval_source": grpo["grpo.data.eval_source"]}
    return {stage: {k: v for k, v in files.items() if v is not None} for stage, files in out.items()}


def check_inputs(p: Pipeline) -> None:
    """Every stage's input files exist (those an earlier stage writes aside): one ConfigError naming the
    field and the path before any stage runs."""
    for stage, files in stage_inputs(p).items():
        for field, path in files.items():
            if not path.exists() and p.out_dir not in path.parents:
                raise ConfigError(f"{p.source}: {field}: {str(path)!r} does not exist (every stage's inputs are "
                                  "checked before any stage runs)")


class _Digests:
    """OUT/inputs.json: each input file's size, mtime and SHA-256; the hash is computed again only when
    the size or the mtime changed."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "inputs.json"
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}

    def of(self, path: Path) -> str:
        """The content digest of a file, or of a folder's files (names and contents)."""
        from grpolab.manifest import sha256

        if path.is_dir():
            parts = [f"{f.relative_to(path)}:{self.of(f)}" for f in sorted(path.rglob("*")) if f.is_file()]
            return hashlib.sha256("\n".join(parts).encode()).hexdigest()
        st = path.stat()
        key, stamp = str(path.resolve()), [st.st_size, st.st_mtime_ns]
        entry = self.known.get(key)
        if entry is None or entry["stamp"] != stamp:
            entry = self.known[key] = {"stamp": stamp, "sha256": sha256(path)}
            self.path.write_text(json.dumps(self.known, indent=1))
        return entry["sha256"]

    def of_stage(self, files: dict[str, Path]) -> dict[str, str]:
        return {field: self.of(path) for field, path in files.items() if path.exists()}


class _Book:
    """OUT/stages.json: each finished stage's settings fingerprint and wall time."""

    def __init__(self, out_dir: Path, inputs: dict[str, dict[str, Path]] | None = None):
        self.path = out_dir / STAGES_FILE
        self.inputs, self.digests = inputs or {}, _Digests(out_dir)
        try:
            self.stages = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.stages = {}

    def done(self, stage: str, spec: Any, finished: bool, inputs: dict[str, str] | None = None) -> bool:
        """Whether `stage` finished with these settings and input files (their digests); a ConfigError
        when it finished with other settings or on input files whose content has changed since."""
        entry = self.stages.get(stage)
        if not finished or entry is None:
            return False
        again = (f"add --from {stage.split(':')[0]} to redo it and the stages after it (their folders are moved "
                 "aside, nothing is deleted)")
        if entry["fingerprint"] != _fingerprint(spec):
            raise ConfigError(f"pipeline stage {stage!r} finished with other settings than the file now gives; "
                              f"{again}")
        changed = [k for k, v in (inputs or {}).items() if entry.get("inputs", {}).get(k, v) != v]
        if changed:
            raise ConfigError(f"pipeline stage {stage!r} finished on other input files: {', '.join(changed)} "
                              f"changed since; {again}")
        return True

    def record(self, stage: str, spec: Any, seconds: float, inputs: dict[str, str] | None = None) -> None:
        self.stages[stage] = {"fingerprint": _fingerprint(spec), "seconds": round(seconds, 1),
                              "inputs": inputs or {}}
        self.path.write_text(json.dumps(self.stages, indent=1))

    def forget_from(self, stage: str) -> None:
        keep = STAGES[: STAGES.index(stage)]
        self.stages = {k: v for k, v in self.stages.items() if k.split(":")[0] in keep}
        self.path.write_text(json.dumps(self.stages, indent=1))


def _run_stage(book: _Book, stage: str, spec: Any, finished: bool, run: Callable[[], None]) -> None:
    inputs = book.digests.of_stage(book.inputs.get(stage, {}))
    if book.done(stage, spec, finished, inputs):
        _say(f"[pipeline] {stage}: finished before, skipped")
        return
    _say(f"[pipeline] {stage}: running")
    t = time.perf_counter()
    try:
        run()
    except ConfigError as e:
        raise ConfigError(f"pipeline stage {stage}: {e}") from None
    except (ValueError, OSError) as e:
        raise PipelineError(f"pipeline stage {stage}: {e}") from e
    book.record(stage, spec, time.perf_counter() - t, inputs)


def _finished(path: Path) -> bool:
    return read_run(path).get("status") == "finished"


def _sft_stage(p: Pipeline, book: _Book) -> None:
    from grpolab.app.train import sft_from_cfg
    from grpolab.rundir.rundir import holds_run
    from grpolab.parallel.launch import apply_threads

    cfg = p.sft.replace(**{"loss.policy_loss": "sft", "run.out_dir": str(p.sft_dir)})
    spec = dump_yaml(cfg)

    def run():
        interrupted = holds_run(p.sft_dir) and not _finished(p.sft_dir)  # started again, the old one moved aside
        apply_threads(cfg)
        sft_from_cfg(cfg, overwrite=interrupted)

    _run_stage(book, "sft", spec, _finished(p.sft_dir), run)


def _rm_argv(p: Pipeline, name: str, opts: dict[str, Any]) -> list[str]:
    actions = _rm_options()
    argv = ["--out", str(p.rm_dir(name))]
    for key, value in opts.items():
        if key in RM_REWARD_KEYS:
            continue
        if key == "base" and value == "sft":
            if p.sft is None:
                raise ConfigError(f"{p.source}: reward_models.{name}.base: sft, but the pipeline has no sft stage")
            value = str(p.sft_dir / "final")
        flag = actions[key].option_strings[-1]
        if actions[key].nargs == 0:  # a switch
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def _rm_stage(p: Pipeline, book: _Book, name: str, opts: dict[str, Any]) -> None:
    from grpolab.app.rm import train
    from grpolab.rundir.rundir import holds_run

    argv = _rm_argv(p, name, opts)
    out = p.rm_dir(name)

    def run():
        again = ["--overwrite"] if holds_run(out) and not _finished(out) else []
        train(_rm_parser().parse_args(argv + again))

    _run_stage(book, f"reward_models:{name}", argv, _finished(out), run)


def _rm_rewards(p: Pipeline) -> list[dict]:
    return [{"name": "reward_model", "label": f"{name}_rm", "weight": float(opts.get("weight", 1.0)),
             "kwargs": {"path": str(p.rm_dir(name)), "normalize": opts.get("normalize", "fixed")}}
            for name, opts in p.reward_models.items()]


def grpo_config(p: Pipeline) -> C.Config:
    """The GRPO stage's config: its own, starting from the SFT model, its rewards plus the reward models."""
    cfg = p.grpo.replace(**{"run.out_dir": str(p.grpo_dir), "run.resume": "auto"})
    if p.sft is not None:
        cfg = cfg.replace(**{"model.name_or_path": str(p.sft_dir / "final")})
    own = [{"name": r.name, "label": r.label, "weight": r.weight, "kwargs": dict(r.kwargs)} for r in cfg.rewards]
    if not own and not p.reward_models:
        raise ConfigError(f"{p.source}: grpo.rewards is empty and there are no reward_models: GRPO needs a reward")
    return cfg.replace(rewards=own + _rm_rewards(p)).validate()


def _grpo_stage(p: Pipeline, book: _Book) -> C.Config:
    from grpolab.app.train import train_from_cfg
    from grpolab.parallel.launch import apply_threads

    cfg = grpo_config(p)

    def run():
        apply_threads(cfg)
        if train_from_cfg(cfg) != 0:  # stopped by a signal: run the pipeline again to resume
            raise PipelineError("the GRPO stage stopped before its last step; run the pipeline again to resume it")

    _run_stage(book, "grpo", dump_yaml(cfg), _finished(p.grpo_dir), run)
    return cfg


def _eval_stage(p: Pipeline, book: _Book, cfg: C.Config) -> dict:
    from grpolab.evaluation.evaluate import evaluate_model

    if p.eval_rewards is not None:
        cfg = cfg.replace(rewards=[{"name": r.name, "label": r.label, "weight": r.weight, "kwargs": dict(r.kwargs)}
                                   for r in p.eval_rewards])
    path = p.out_dir / "eval.json"
    start = p.sft_dir / "final" if p.sft is not None else Path(p.grpo.model.name_or_path)
    spec = {"config": dump_yaml(cfg), "samples": p.eval_samples, "start": str(start)}

    def run():
        payload = {"rewards": [{"name": r.display_name, "weight": r.weight} for r in cfg.rewards],
                   "samples": p.eval_samples, "reward_models": _rm_accuracies(p)}
        if start.is_dir():
            _say(f"[pipeline] eval: π0 ({start})")
            payload["pi0"] = evaluate_model(start, cfg, samples=p.eval_samples)
        _say(f"[pipeline] eval: final policy ({p.grpo_dir})")
        payload["final"] = evaluate_model(p.grpo_dir, cfg, samples=p.eval_samples)
        payload["stages"] = book.stages
        tmp = path.with_name("eval.json.tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(path)

    _run_stage(book, "eval", spec, path.is_file(), run)
    return json.loads(path.read_text())


def _rm_accuracies(p: Pipeline) -> dict[str, float | None]:
    from grpolab.reward_models.model import RM_INFO_FILE

    out = {}
    for name in p.reward_models:
        out[name] = json.loads((p.rm_dir(name) / RM_INFO_FILE).read_text()).get("heldout_accuracy")
    return out


def _stage_paths(p: Pipeline, stage: str) -> list[Path]:
    return {"sft": [p.sft_dir], "reward_models": [p.rm_dir(n) for n in p.reward_models], "grpo": [p.grpo_dir],
            "eval": [p.out_dir / "eval.json"]}[stage]


def redo_from(p: Pipeline, book: _Book, stage: str) -> None:
    """Moves the folders of `stage` and every later stage aside and forgets that they finished."""
    if stage not in STAGES:
        raise ConfigError(f"--from {stage!r}: expected one of {', '.join(STAGES)}")
    for later in STAGES[STAGES.index(stage):]:
        for path in _stage_paths(p, later):
            if path.exists():
                _say(f"[pipeline] --from {stage}: moved {path} to {move_aside(path)}")
    book.forget_from(stage)


def run_pipeline(p: Pipeline, redo: str = "", report: bool = True, overwrite: bool = False) -> dict:
    """Runs the stages in order, skipping finished ones; returns the eval.json payload. Every stage's
    input files are checked first; then out_dir is claimed like a run folder (grpolab.rundir.rundir.claim:
    held by this process, continued when it holds this pipeline's earlier run, refused when it holds the
    user's own files or another command's run; `overwrite` moves them aside, nothing is deleted)."""
    from grpolab.rundir.rundir import claim, mark_finished

    check_inputs(p)
    claim(p.out_dir, "pipeline", resume=True, overwrite=overwrite, field="out_dir", say=_say)
    book = _Book(p.out_dir, stage_inputs(p))
    if redo:
        redo_from(p, book, redo)
    if p.sft is not None:
        _sft_stage(p, book)
    for name, opts in p.reward_models.items():
        _rm_stage(p, book, name, opts)
    cfg = _grpo_stage(p, book)
    payload = _eval_stage(p, book, cfg)
    if report:
        from grpolab.report.html import write_report

        _say(f"[pipeline] report: {write_report(p.grpo_dir)}")
    mark_finished(p.out_dir)
    return payload


def format_table(payload: dict) -> str:
    """π0 vs final for every float metric of the evaluation."""
    before, after = payload.get("pi0", {}), payload["final"]
    lines = [f"{'held-out metric':<36}{'π0':>9}{'final':>9}{'change':>9}"]
    for part in ("greedy", "sampled"):
        for k, v in after.get(part, {}).items():
            if not isinstance(v, float):
                continue
            b = before.get(part, {}).get(k)
            cells = f"{b:>9.3f}{v:>9.3f}{v - b:>+9.3f}" if isinstance(b, float) else f"{'':>9}{v:>9.3f}"
            lines.append(f"{part + ' ' + k:<36}{cells}")
    for name, acc in payload.get("reward_models", {}).items():
        if acc is not None:
            lines.append(f"reward model {name}: held-out pair accuracy {acc:.3f}")
    return "\n".join(lines)
