"""`grpolab pipeline CONFIG`: the whole pipeline from one YAML file.

    sft             grpolab sft on the `sft:` config                       -> OUT/sft/final
                    then, when there are held-out prompts, its greedy evaluation  -> OUT/sft/eval.json
    reward_models   grpolab rm per entry, each on its own preference data  -> OUT/rm-<name>/
    grpo            grpolab train on the `grpo:` config, starting from the SFT model, rewarded by
                    its own rewards (e.g. verifiers) plus each reward model × its weight  -> OUT/grpo/
    eval            the GRPO config's held-out prompts, scored by `eval.rewards` (default: the GRPO
                    rewards), for the starting model (π0) and the final policy   -> OUT/eval.json
                    (per value of each `eval.group_by` field), every completion -> OUT/completions.jsonl
    report          OUT/grpo/report.html

The file:

    out_dir: runs/my-pipeline
    sft: {preset: sft, model: ..., data: {source: jsonl:sft.jsonl}, sft: {steps: 300}}   # optional
    reward_models:                                                                      # optional
      accuracy: {data: acc.jsonl, eval_data: acc_heldout.jsonl, steps: 300, lr: 1.0e-4, weight: 1.0}
    grpo: {preset: grpo, data: {source: jsonl:prompts.jsonl, eval_source: jsonl:heldout.jsonl}, ...}
    eval: {samples: 4, rewards: [exact_match], group_by: kind}                          # optional

`sft:` and `grpo:` are grpolab configs (the sections of `grpolab config`); a reward model entry
takes `grpolab rm`'s options (`--lm-coef` is `lm_coef`), `weight` and `normalize` (the reward_model
reward's score normalization, default fixed). Its backbone `base` defaults to the SFT stage's model
(`sft`, its tokenizer too), or without an SFT stage to the GRPO stage's model; its `lr` defaults to
`grpolab rm`'s (1e-3 for builtin:tiny, else 1e-5), said when the stage starts. Each stage
writes its own run directory; a finished stage is skipped when the pipeline runs again with the same
settings and input files (their SHA-256, computed again when a file's size or mtime changed; a finished
stage whose settings or inputs changed is an error that names them: `--from STAGE` redoes it and the
stages after it, moving their folders aside); an interrupted GRPO stage resumes from its last checkpoint,
an interrupted SFT or reward-model stage starts again. Before any stage runs, every stage's config is
validated, its input files read and its rewards probed (grpolab.app.pipeline_checks).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from grpolab import config as C
from grpolab.app.pipeline_book import STAGES, Book
from grpolab.app.pipeline_checks import preflight, rm_base, stage_inputs
from grpolab.config.validation import check_eval
from grpolab.config.io import check_duplicate_keys, key_lines, dump_yaml, from_mapping
from grpolab.errors import ConfigError
from grpolab.rundir.rundir import move_aside, read_run

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
    eval_group_by: tuple[str, ...] = ()

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
        for key, value in opts.items():
            at = f"{path}:{lines.get(f'reward_models.{name}.{key}', 1)}: reward_models.{name}.{key}"
            if key not in known and key not in RM_REWARD_KEYS:
                raise ConfigError(f"{at}: unknown option; known: {', '.join(sorted(known | set(RM_REWARD_KEYS)))}")
            _check_rm_value(_rm_options().get(key), value, at)
        out[str(name)] = dict(opts)
    return out


def _check_rm_value(action, value: Any, at: str) -> None:
    """A reward-model option's value has the type `grpolab rm` parses it as (a ConfigError naming it)."""
    if key_type := getattr(action, "type", None):
        try:
            key_type(str(value))
        except (TypeError, ValueError):
            raise ConfigError(f"{at}: expected {key_type.__name__}, got {value!r}") from None
    elif action is not None and action.nargs == 0 and not isinstance(value, bool):
        raise ConfigError(f"{at}: expected true or false, got {value!r}")
    if value is None or isinstance(value, (dict, list)):
        raise ConfigError(f"{at}: expected a single value, got {value!r}")


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
    if not isinstance(ev, dict) or set(ev) - {"samples", "rewards", "group_by"}:
        raise ConfigError(f"{path}:{lines.get('eval', 1)}: eval: expected a mapping with samples:, rewards: and "
                          "group_by:")
    out_dir = data.get("out_dir") or f"runs/pipeline-{time.strftime('%Y%m%d-%H%M%S')}"
    grpo = _stage_config(data, "grpo", lines, path, "grpo")
    eval_rewards = None
    try:
        if ev.get("rewards") is not None:
            eval_rewards = grpo.replace(rewards=ev["rewards"]).validate().rewards
        with_groups = grpo.replace(**{"eval.group_by": ev.get("group_by", ())})
        check_eval(with_groups)
        group_by = with_groups.eval.group_fields
    except ConfigError as e:
        raise ConfigError(f"{path}:{lines.get('eval', 1)}: eval: {e}") from None
    p = Pipeline(Path(out_dir), _stage_config(data, "sft", lines, path, "sft"),
                 _check_reward_models(data.get("reward_models"), lines, path), grpo, eval_rewards,
                 int(ev.get("samples", 0)), path, group_by)
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
def _run_stage(book: Book, stage: str, spec: Any, finished: bool, run: Callable[[], None]) -> None:
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


def sft_config(p: Pipeline) -> C.Config:
    """The SFT stage's config as `grpolab sft` runs it (loss.policy_loss=sft, run.out_dir OUT/sft)."""
    return p.sft.replace(**{"loss.policy_loss": "sft", "run.out_dir": str(p.sft_dir)})


def rm_args(p: Pipeline, name: str):
    """The reward-model stage `name`'s `grpolab rm` options, parsed (argparse.Namespace)."""
    return _rm_parser().parse_args(_rm_argv(p, name, p.reward_models[name]))


def _sft_stage(p: Pipeline, book: Book, eval_cfg: C.Config) -> None:
    from grpolab.app.train import sft_from_cfg
    from grpolab.rundir.rundir import holds_run
    from grpolab.parallel.launch import apply_threads

    cfg = sft_config(p)
    spec = dump_yaml(cfg)

    def run():
        interrupted = holds_run(p.sft_dir) and not _finished(p.sft_dir)  # started again, the old one moved aside
        apply_threads(cfg)
        sft_from_cfg(cfg, overwrite=interrupted)
        if has_heldout(eval_cfg):
            _sft_eval(p, eval_cfg)

    _run_stage(book, "sft", spec, _finished(p.sft_dir), run)


def has_heldout(cfg: C.Config) -> bool:
    """Whether cfg has held-out prompts to evaluate on (data.eval_source, or a built-in split)."""
    return bool(cfg.data.eval_source) or cfg.data.source in ("builtin:arith", "builtin:seeds")


def _sft_eval(p: Pipeline, cfg: C.Config) -> None:
    """The SFT model on the held-out prompts, greedy, by the evaluation's rewards but the reward models
    this pipeline trains later: OUT/sft/eval.json and completions.jsonl, and the table on stderr."""
    from grpolab.evaluation.evaluate import evaluate_model, format_eval, write_completions
    from grpolab.rundir.rundir import write_eval

    later = {str(p.rm_dir(name)) for name in p.reward_models}
    rewards = [dataclasses.asdict(r) for r in cfg.rewards if str(r.kwargs.get("path", "")) not in later]
    if not rewards:
        _say("[pipeline] sft: no held-out evaluation (every evaluation reward is a reward model trained later)")
        return
    cfg = cfg.replace(rewards=rewards)
    _say(f"[pipeline] sft: held-out evaluation of {p.sft_dir / 'final'}")
    res = evaluate_model(p.sft_dir / "final", cfg)
    write_completions(p.sft_dir / "completions.jsonl", res.pop("completions", []), model="sft")
    write_eval(p.sft_dir, res)
    _say(format_eval(res))


def _rm_argv(p: Pipeline, name: str, opts: dict[str, Any]) -> list[str]:
    actions = _rm_options()
    argv = ["--out", str(p.rm_dir(name))]
    for key, value in {**opts, "base": rm_base(p, opts)}.items():
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


def _rm_stage(p: Pipeline, book: Book, name: str, opts: dict[str, Any]) -> None:
    from grpolab.app.rm import train
    from grpolab.rundir.rundir import holds_run

    argv = _rm_argv(p, name, opts)
    out = p.rm_dir(name)
    base = rm_base(p, opts)
    how = "its `base`" if opts.get("base") is not None else ("the SFT stage's model, the default" if base == "sft"
                                                             else "the GRPO stage's model, the default")
    lr = opts.get("lr")
    lr_how = "its `lr`" if lr is not None else "grpolab rm's default for this backbone; set lr: to change it"
    lr = lr if lr is not None else (1e-3 if base == "builtin:tiny" else 1e-5)
    _say(f"[pipeline] reward_models:{name}: backbone {base} ({how}), lr {lr:g} ({lr_how})")

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
    own = [dataclasses.asdict(r) for r in cfg.rewards]
    if not own and not p.reward_models:
        raise ConfigError(f"{p.source}: grpo.rewards is empty and there are no reward_models: GRPO needs a reward")
    return cfg.replace(rewards=own + _rm_rewards(p)).validate()


def _grpo_stage(p: Pipeline, book: Book) -> C.Config:
    from grpolab.app.train import train_from_cfg
    from grpolab.parallel.launch import apply_threads

    cfg = grpo_config(p)

    def run():
        apply_threads(cfg)
        if train_from_cfg(cfg) != 0:  # stopped by a signal: run the pipeline again to resume
            raise PipelineError("the GRPO stage stopped before its last step; run the pipeline again to resume it")

    _run_stage(book, "grpo", dump_yaml(cfg), _finished(p.grpo_dir), run)
    return cfg


def eval_config(p: Pipeline, grpo_cfg: C.Config) -> C.Config:
    """The evaluation's config: the GRPO stage's, scored by eval.rewards and grouped by eval.group_by when
    given."""
    if p.eval_group_by:
        grpo_cfg = grpo_cfg.replace(**{"eval.group_by": list(p.eval_group_by)})
    if p.eval_rewards is None:
        return grpo_cfg
    return grpo_cfg.replace(rewards=[dataclasses.asdict(r) for r in p.eval_rewards])


def _eval_stage(p: Pipeline, book: Book, cfg: C.Config) -> dict:
    from grpolab.evaluation.evaluate import evaluate_model, write_completions

    cfg = eval_config(p, cfg)
    path = p.out_dir / "eval.json"
    start = p.sft_dir / "final" if p.sft is not None else Path(p.grpo.model.name_or_path)
    spec = {"config": dump_yaml(cfg), "samples": p.eval_samples, "start": str(start)}

    def run():
        payload = {"rewards": [{"name": r.display_name, "weight": r.weight} for r in cfg.rewards],
                   "samples": p.eval_samples, "reward_models": _rm_accuracies(p)}
        completions = p.out_dir / "completions.jsonl"
        if start.is_dir():
            _say(f"[pipeline] eval: π0 ({start})")
            payload["pi0"] = evaluate_model(start, cfg, samples=p.eval_samples)
        _say(f"[pipeline] eval: final policy ({p.grpo_dir})")
        payload["final"] = evaluate_model(p.grpo_dir, cfg, samples=p.eval_samples)
        for i, model in enumerate(m for m in ("pi0", "final") if m in payload):
            write_completions(completions, payload[model].pop("completions", []), append=i > 0, model=model)
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
            "eval": [p.out_dir / "eval.json", p.out_dir / "completions.jsonl"]}[stage]


def redo_from(p: Pipeline, book: Book, stage: str) -> None:
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

    grpo_cfg = grpo_config(p)
    eval_cfg = eval_config(p, grpo_cfg)
    preflight(p, grpo_cfg, eval_cfg)
    claim(p.out_dir, "pipeline", resume=True, overwrite=overwrite, field="out_dir", say=_say)
    book = Book(p.out_dir, stage_inputs(p))
    if redo:
        redo_from(p, book, redo)
    if p.sft is not None:
        _sft_stage(p, book, eval_cfg)
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
    """π0 vs final for every float metric of the evaluation, then per eval.group_by value."""
    before, after = payload.get("pi0", {}), payload["final"]
    groups = [("", before, after)] + [
        (f"{field}={value} ", before.get("by", {}).get(field, {}).get(value, {}), m)
        for field, values in after.get("by", {}).items() for value, m in values.items()]
    rows = [(prefix + part + " " + k, b_part.get(part, {}).get(k), v) for prefix, b_part, a_part in groups
            for part in ("greedy", "sampled") for k, v in a_part.get(part, {}).items()
            if isinstance(v, float) and v == v]  # NaN: no row of the group was scored
    width = max([36] + [len(name) + 2 for name, _, _ in rows])
    lines = [f"{'held-out metric':<{width}}{'π0':>9}{'final':>9}{'change':>9}"]
    for name, b, v in rows:
        cells = f"{b:>9.3f}{v:>9.3f}{v - b:>+9.3f}" if isinstance(b, float) else f"{'':>9}{v:>9.3f}"
        lines.append(f"{name:<{width}}{cells}")
    for name, acc in payload.get("reward_models", {}).items():
        if acc is not None:
            lines.append(f"reward model {name}: held-out pair accuracy {acc:.3f}")
    return "\n".join(lines)
