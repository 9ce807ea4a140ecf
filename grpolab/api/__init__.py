"""grpolab from Python: the functions the command line calls, with Python objects where it takes files.

    import grpolab

    def reward(prompts, completions, metadata):          # one float (or None) per completion
        return [float(c.strip() == m["answer"]) for c, m in zip(completions, metadata)]

    cfg = grpolab.make_config("grpo", {"train.steps": 50, "run.out_dir": "runs/mine"})
    result = grpolab.train(cfg, rewards=[reward], data=[{"prompt": "2+2=", "answer": "4"}, ...])
    print(result.metrics[-1]["reward/mean"], result.final_model)

Config: `make_config(preset | YAML path | dict | Config, overrides)` (overrides: `["k=v", ...]` or
`{"section.field": value}`), validated as the command line validates it. Each run function takes a
config (or what `make_config` takes) plus Python objects:

- rewards: callables `f(prompts, completions, metadata)` (or `(f, weight)`, `(name, f, weight)`);
  each is registered under its name, which the metrics and config.yaml show;
- data / eval_data: a list of dicts, a `datasets.Dataset`, a path (.jsonl, a dataset folder or file)
  or a data.source string; rows in Python are written once to a content-addressed JSONL file in
  grpolab's cache and read from there, as `grpolab train` reads a file;
- model: an id or folder (model.name_or_path), or a `PreTrainedModel` with its tokenizer
  (`model=(model, tokenizer)`);
- callbacks (`train`): objects with any of on_step_end / on_rollout / on_evaluate / on_save
  (grpolab.api.callbacks); one returning True stops the run as SIGTERM does (saved, resumable).

`train`, `sft` (top level: `grpolab.train_sft`, since `grpolab.sft` is the SFT package), `train_rm`,
`evaluate`, `export` and `pipeline` return dataclasses
(grpolab.api.results): run folder, metrics, the final model's folder. Errors are raised (ConfigError,
ValueError, FileNotFoundError) with the message the command line prints.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "make_config": "grpolab.api.configs",
    "train": "grpolab.api.runs", "sft": "grpolab.api.runs", "train_sft": "grpolab.api.runs",
    "train_rm": "grpolab.api.runs",
    "evaluate": "grpolab.api.runs", "export": "grpolab.api.runs", "pipeline": "grpolab.api.runs",
    "Callback": "grpolab.api.callbacks",
    "TrainResult": "grpolab.api.results", "SFTResult": "grpolab.api.results", "RMResult": "grpolab.api.results",
    "EvalResult": "grpolab.api.results", "PipelineResult": "grpolab.api.results",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The API's names, imported on first use (so `import grpolab` stays cheap)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'grpolab.api' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
