"""`grpolab config PIPELINE.yaml`: what each stage of a pipeline file runs, field by field (the SFT and
GRPO stages' configs as the stages run them, each reward model's `grpolab rm` options with their
defaults resolved, the evaluation's rewards and grouping)."""

from __future__ import annotations

from pathlib import Path

import yaml

from grpolab.app.config_reference import config_reference
from grpolab.app.pipeline import eval_config, grpo_config, load_pipeline, rm_args, sft_config
from grpolab.app.pipeline_book import STAGES

PIPELINE_KEYS = ("out_dir", "reward_models", "grpo")
"""Top-level keys only a pipeline file has (a config file has sections and `preset:`)."""


def is_pipeline_file(path: str) -> bool:
    """Whether the YAML file at `path` is a pipeline file (a top-level out_dir:, reward_models: or grpo:)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False  # the config loader names the problem
    return isinstance(data, dict) and any(k in data for k in PIPELINE_KEYS)


def _rm_lines(p, name: str) -> list[str]:
    args = rm_args(p, name)
    given = set(p.reward_models[name])
    lines = []
    for key, value in sorted(vars(args).items()):
        if key in ("out", "overwrite"):  # the pipeline's
            continue
        note = "" if key in given else "   # default"
        if key == "lr" and value is None:
            value = f"{1e-3 if args.base == 'builtin:tiny' else 1e-5:g}"
            note = "   # default: grpolab rm's for this backbone (1e-3 builtin:tiny, else 1e-5)"
        if key == "base" and key not in given:
            note = f"   # default: the {'SFT' if p.sft is not None else 'GRPO'} stage's model"
        lines.append(f"reward_models.{name}.{key}: {value}{note}")
    opts = p.reward_models[name]
    lines.append(f"reward_models.{name}.weight: {opts.get('weight', 1.0)}   (the GRPO reward's weight)")
    lines.append(f"reward_models.{name}.normalize: {opts.get('normalize', 'fixed')}")
    return lines


def pipeline_reference(path: str, overrides: list[str]) -> str:
    """The text `grpolab config` prints for a pipeline file: a section per stage."""
    p = load_pipeline(path, overrides)
    grpo_cfg = grpo_config(p)
    ev = eval_config(p, grpo_cfg)
    rule = "=" * 100
    out = [" ".join(["grpolab config", path, *overrides]), "",
           f"pipeline {path}: out_dir {p.out_dir}; stages {', '.join(STAGES)}", ""]
    if p.sft is not None:
        out += [rule, f"stage sft: grpolab sft -> {p.sft_dir / 'final'}", rule, config_reference(sft_config(p))]
    for name in p.reward_models:
        out += [rule, f"stage reward_models:{name}: grpolab rm -> {p.rm_dir(name)}", rule, *_rm_lines(p, name), ""]
    out += [rule, f"stage grpo: grpolab train -> {p.grpo_dir}", rule, config_reference(grpo_cfg)]
    out += [rule, f"stage eval: π0 and the final policy -> {p.out_dir / 'eval.json'}, completions.jsonl", rule,
            f"eval.rewards: {', '.join(f'{r.display_name}:{r.weight:g}' for r in ev.rewards)}",
            f"eval.samples: {p.eval_samples}", f"eval.group_by: {list(ev.eval.group_fields)}",
            f"held-out prompts: {ev.data.eval_source or ev.data.source + ' (its held-out split)'}", ""]
    return "\n".join(out)
