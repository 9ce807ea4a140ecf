"""The run functions of the Python API; the command line (grpolab/cli/) calls these same functions.

Each takes a config (a Config, or what `make_config` takes, plus `overrides`) and Python objects (see
grpolab.api), and returns a result dataclass (grpolab.api.results). Input errors raise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from grpolab import config as C
from grpolab.api.configs import Overrides, make_config, override_list
from grpolab.api.inputs import data_source, model_inputs, reward_specs
from grpolab.api.results import EvalResult, PipelineResult, RMResult, SFTResult, TrainResult, read_metrics
from grpolab.errors import ConfigError

ConfigLike = C.Config | str | Path | dict | None


def _config(config: ConfigLike, overrides: Overrides, *, model: Any = None, rewards: Sequence | None = None,
            data: Any = None, eval_data: Any = None, default: str = "grpo") -> tuple[C.Config, Any, Any]:
    """(the run's Config, a policy object or None, its tokenizer or None): `config` with the overrides,
    then the Python objects' fields (model.name_or_path, rewards, data.source, data.eval_source), the
    process's thread setting applied (run.threads)."""
    from grpolab.parallel.launch import apply_threads

    cfg = make_config(default if config is None or config == "" else config, overrides)
    fields, policy, tokenizer = model_inputs(model)
    if policy is not None and getattr(policy, "name_or_path", ""):  # its origin, for config.yaml and export
        fields["model.name_or_path"] = str(policy.name_or_path)
    if rewards is not None:
        fields["rewards"] = [{"name": s.name, "weight": s.weight, "kwargs": s.kwargs, "label": s.label}
                             for s in reward_specs(rewards)]
    if data is not None:
        fields["data.source"] = data_source(data, "data")
    if eval_data is not None:
        fields["data.eval_source"] = data_source(eval_data, "eval_data")
    if fields:
        cfg = cfg.replace(**fields).validate()
    return apply_threads(cfg), policy, tokenizer


def _prepared(cfg: C.Config, policy: Any) -> Any:
    if policy is None:
        return None
    from grpolab.models.policy import prepare_policy

    return prepare_policy(policy, cfg)


def train(config: ConfigLike = None, overrides: Overrides = None, *, rewards: Sequence | None = None,
          data: Any = None, eval_data: Any = None, model: Any = None, callbacks: Sequence = (),
          resume: bool = False, overwrite: bool = False) -> TrainResult:
    """GRPO (or the config's preset of the spectrum; loss.policy_loss=sft runs `sft`) in this process:
    `grpolab train CONFIG [overrides] [--resume] [--overwrite]`.

    resume: continue run.out_dir from its latest complete checkpoint (a fresh start when it has none).
    callbacks: see grpolab.api.callbacks. Returns the run's TrainResult."""
    from grpolab.api.callbacks import CallbackHook
    from grpolab.app.train import run_grpo
    from grpolab.rundir.checkpoint import CHECKPOINTS, latest_checkpoint

    cfg, policy, tokenizer = _config(config, overrides, model=model, rewards=rewards, data=data,
                                     eval_data=eval_data)
    if resume and overwrite:
        raise ConfigError("--resume continues the run in run.out_dir and --overwrite moves it aside: choose one")
    if resume:
        cfg = cfg.replace(**{"run.resume": cfg.run.resume or "auto"})
    if cfg.loss.policy_loss == "sft":
        res = _sft(cfg, overwrite, policy, tokenizer)
        return TrainResult(res.run_dir, 0, [], res.final_model)
    hooks = (CallbackHook(list(callbacks)),) if callbacks else ()
    code, run_dir = run_grpo(cfg, overwrite, policy=_prepared(cfg, policy), tokenizer=tokenizer, hooks=hooks)
    stopped = hooks[0].stopped_by if hooks and hooks[0].stopped_by else _signal(code)
    final = run_dir / "final"
    finished = not stopped and (final / "config.json").is_file()
    return TrainResult(run_dir, code, read_metrics(run_dir), final if finished else None,
                       latest_checkpoint(run_dir / CHECKPOINTS), stopped)


def _signal(code: int) -> str:
    import signal

    if code > 128:
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            pass
    return {3: "the numerics guard"}.get(code, "")


def sft(config: ConfigLike = None, overrides: Overrides = None, *, data: Any = None, model: Any = None,
        overwrite: bool = False) -> SFTResult:
    """Supervised fine-tuning (token cross-entropy on prompt/response pairs; default config: the sft
    preset): `grpolab sft [CONFIG] [overrides]`. data: rows with data.prompt_field (or
    data.messages_field) and data.response_field."""
    cfg, policy, tokenizer = _config(config, overrides, model=model, data=data, default="sft")
    return _sft(cfg.replace(**{"loss.policy_loss": "sft"}), overwrite, policy, tokenizer)


train_sft = sft
"""`sft` under the name `grpolab.train_sft` (`grpolab.sft` is the SFT package once it is imported)."""


def _sft(cfg: C.Config, overwrite: bool, policy: Any, tokenizer: Any) -> SFTResult:
    from grpolab.app.train import run_sft

    run_dir, losses = run_sft(cfg, overwrite, policy=_prepared(cfg, policy), tokenizer=tokenizer)
    return SFTResult(run_dir, run_dir / "final", losses)


def evaluate(model: Any, config: ConfigLike = "grpo", overrides: Overrides = None, *,
             rewards: Sequence | None = None, eval_data: Any = None, samples: int = 0,
             best_of: int = 0) -> EvalResult:
    """Held-out evaluation by the config's rewards (greedy; with samples=K also K sampled completions per
    prompt, pass@1 and pass@K): `grpolab eval MODEL [CONFIG]`. model: an HF folder, a run directory (its
    final/), or (PreTrainedModel, tokenizer)."""
    from grpolab.evaluation.evaluate import evaluate_model, evaluate_policy

    folder = model if isinstance(model, (str, Path)) else None
    cfg, policy, tokenizer = _config(config, overrides, model=None if folder else model, rewards=rewards,
                                     eval_data=eval_data)
    if folder is not None:
        return EvalResult(evaluate_model(folder, cfg, samples=samples, best_of=best_of))
    return EvalResult(evaluate_policy(policy.to(cfg.model.device), tokenizer, cfg, samples, best_of=best_of))


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, overwrite: bool = False,
           say=None) -> Path:
    """A run's policy as a standalone HF folder (LoRA merged, tokenizer, generation config): `grpolab export
    RUN_DIR --out OUT [--step N]`. Returns the folder."""
    from grpolab.rundir.export import export_run

    return export_run(run_dir, out, step, overwrite=overwrite, say=say)


def train_rm(data: Any, out: str | Path, *, base: Any = None, eval_data: Any = None, overwrite: bool = False,
             **options: Any) -> RMResult:
    """A pairwise reward model on preference pairs ({prompt, chosen, rejected} rows, or builtin:accuracy |
    builtin:refusal): `grpolab rm --data DATA --out OUT`. options: the command's other options by their
    argument names (steps, epochs, batch_size, microbatch_size, lr, lm_coef, seed, device, policy, ...;
    `grpolab rm --help`)."""
    import argparse
    import json

    from grpolab.app.rm import add_arguments, train as train_reward_model

    defaults = vars(add_arguments(argparse.ArgumentParser()).parse_args(["--data", "-", "--out", "-"]))
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigError(f"train_rm: unknown option(s) {unknown}; known: {sorted(set(defaults) - {'data', 'out'})}")
    args = argparse.Namespace(**{**defaults, **options})
    args.data = _pairs_path(data, "data")
    args.eval_data = None if eval_data is None else _pairs_path(eval_data, "eval_data")
    args.out, args.overwrite = str(out), overwrite
    args.base = defaults["base"] if base is None else str(base)
    train_reward_model(args)
    info_file = Path(out) / "grpolab_rm.json"
    return RMResult(Path(out), json.loads(info_file.read_text()) if info_file.is_file() else {})


def _pairs_path(data: Any, what: str) -> str:
    """`grpolab rm --data`'s value: a path or builtin:NAME as given; rows in Python as a cached JSONL file."""
    if isinstance(data, (str, Path)):
        return str(data)
    return data_source(data, what).partition(":")[2]


def pipeline(path: str | Path, overrides: Overrides = None, *, redo: str = "", report: bool = True,
             overwrite: bool = False) -> PipelineResult:
    """SFT -> reward models -> GRPO -> evaluation -> report from one pipeline file: `grpolab pipeline FILE
    [SECTION.key=value ...] [--from STAGE]`."""
    from grpolab.app.pipeline import load_pipeline, run_pipeline

    p = load_pipeline(str(path), override_list(overrides))
    payload = run_pipeline(p, redo=redo, report=report, overwrite=overwrite)
    return PipelineResult(Path(p.out_dir), payload)
