"""What `grpolab pipeline` checks before its first stage runs, so that no stage fails late on input an
earlier stage could not have changed:

- every stage's config is valid (the SFT stage's as `grpolab sft` runs it; the GRPO and eval configs
  are validated when the file is loaded, the reward models' options are typed there too);
- every stage's input files exist (those an earlier stage writes aside) and read as that stage reads
  them: SFT pairs, preference pairs, GRPO and held-out prompts, each row parsed (file:line named);
- every reward of the GRPO stage and of the evaluation is imported, built and probed on the first
  row of the prompts it will score (grpolab.rewards.base.probe_reward), except the learned ones
  (reward models, self-likelihood), whose models the stages write or load;
- every eval.group_by field is a field of the held-out rows.

The checks read the files with the tokenizer of the model that will read them (the SFT stage's, which
the later stages inherit, else the GRPO stage's), loaded without the model: chat messages are rendered
by its template and every text encoded as the stage will (`model_tokenizer`; a hub id not in the cache
is read with a stand-in that checks chat messages without rendering them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from grpolab.errors import ConfigError

NOT_PROBED = ("reward_model", "reward_model_ensemble", "self_likelihood")
"""Rewards built on a model: not built before the stages (a reward model is trained by one)."""


def source_path(source: str | None) -> Path | None:
    """The local file or folder a data source reads (jsonl:PATH, hf:PATH), else None."""
    kind, sep, rest = (source or "").partition(":")
    return Path(rest) if sep and kind in ("jsonl", "hf") else None


def model_path(name: str) -> Path | None:
    """A model given as a local folder or file (not a hub id or a built-in name)."""
    return Path(name) if name and not name.startswith("builtin:") and Path(name).exists() else None


def rm_base(p, opts: dict[str, Any]) -> str:
    """A reward model's backbone: its `base`, else the SFT stage's model ("sft"), else the GRPO stage's."""
    if opts.get("base") is not None:
        return str(opts["base"])
    return "sft" if p.sft is not None else p.grpo.model.name_or_path


def stage_inputs(p) -> dict[str, dict[str, Path]]:
    """Each stage's input files and folders: {stage: {field: path}} (data files, a local model, a base).
    p: a grpolab.app.pipeline.Pipeline."""
    out: dict[str, dict[str, Path | None]] = {}
    if p.sft is not None:
        out["sft"] = {"sft.data.source": source_path(p.sft.data.source),
                      "sft.model.name_or_path": model_path(p.sft.model.name_or_path)}
    for name, opts in p.reward_models.items():
        base = rm_base(p, opts)
        out[f"reward_models:{name}"] = {
            f"reward_models.{name}.data": None if str(opts["data"]).startswith("builtin:") else Path(opts["data"]),
            f"reward_models.{name}.eval_data": Path(opts["eval_data"]) if opts.get("eval_data") else None,
            f"reward_models.{name}.base": p.sft_dir / "final" if base == "sft" else model_path(base)}
    grpo = {"grpo.data.source": source_path(p.grpo.data.source),
            "grpo.data.eval_source": source_path(p.grpo.data.eval_source)}
    grpo["grpo.model.name_or_path"] = p.sft_dir / "final" if p.sft is not None else model_path(
        p.grpo.model.name_or_path)
    out["grpo"], out["eval"] = grpo, {"grpo.data.eval_source": grpo["grpo.data.eval_source"]}
    return {stage: {k: v for k, v in files.items() if v is not None} for stage, files in out.items()}


def check_inputs(p) -> None:
    """Every stage's input files exist (those an earlier stage writes aside): one ConfigError naming the
    field and the path before any stage runs."""
    for stage, files in stage_inputs(p).items():
        for field, path in files.items():
            if not path.exists() and p.out_dir not in path.parents:
                raise ConfigError(f"{p.source}: {field}: {str(path)!r} does not exist (every stage's inputs are "
                                  "checked before any stage runs)")


def _read(p, field: str, load) -> Any:
    try:
        return load()
    except (ValueError, OSError, KeyError) as e:
        raise ConfigError(f"{p.source}: {field}: {e} (every stage's inputs are read before any stage runs)") from None


class PlainChat:
    """A stand-in tokenizer for the checks when the model's is not at hand (a hub id not in the cache):
    chat messages are checked and joined as text instead of rendered by a template, text is encoded as
    bytes (no length is checked with it)."""

    chat_template = "plain"
    unk_token_id = None

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = False) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode())}


def model_tokenizer(p, name: str, field: str) -> Any:
    """The tokenizer of the model `name` (the pipeline's `field`), loaded without the model: a built-in
    model's, a local folder's, a GGUF's or a shortcut's (a folder that cannot give one is a ConfigError
    naming the field), a hub id's from the Hugging Face cache; else `PlainChat` (never downloaded here)."""
    from grpolab.models.loading import MODEL_SHORTCUTS, load_tokenizer, resolve_model_path
    from grpolab.models.policy import BUILTIN_MODELS, builtin_tokenizer

    if name in BUILTIN_MODELS:
        return builtin_tokenizer(name)
    if name in MODEL_SHORTCUTS or Path(name).expanduser().exists():
        try:
            return load_tokenizer(resolve_model_path(name))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{p.source}: {field}: {e} (read for its tokenizer before any stage runs)") from None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name, local_files_only=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - not in the cache (or not a hub id): the stage fetches it or says why
        return PlainChat()


def prompt_rows(cfg, source: str, tokenizer: Any) -> list:
    """The prompt items of `source` under cfg.data's field names, rendered by `tokenizer`; one item of a
    built-in source (nothing to check there but the probe's row)."""
    from grpolab.data.build import prompt_stream

    stream = prompt_stream(cfg.replace(**{"data.source": source}), tokenizer)
    return list(stream.items) if hasattr(stream, "items") else stream.next_batch(1)


def read_inputs(p, grpo_cfg) -> dict[str, list]:
    """Reads every stage's data files as the stage will (each row parsed); returns the GRPO stage's
    prompts and held-out prompts by field (for the reward probe)."""
    from grpolab.data.build import source_options
    from grpolab.data.preferences import load_pairs
    from grpolab.data.sft_pairs import load_sft_pairs

    first = "sft" if p.sft is not None else "grpo"  # the later stages inherit the SFT stage's tokenizer
    tok = model_tokenizer(p, getattr(p, first).model.name_or_path, f"{first}.model.name_or_path")
    if p.sft is not None and source_path(p.sft.data.source) is not None:
        d = p.sft.data
        _read(p, "sft.data.source", lambda: load_sft_pairs(
            d.source, response_field=d.response_field, prompt_field=d.prompt_field, messages_field=d.messages_field,
            **source_options(p.sft, tok)))
    for name, opts in p.reward_models.items():
        for key in ("data", "eval_data"):
            path = str(opts.get(key) or "")
            if path and not path.startswith("builtin:"):
                _read(p, f"reward_models.{name}.{key}", lambda: load_pairs(path))
    out = {"grpo.data.source": _read(p, "grpo.data.source", lambda: prompt_rows(grpo_cfg, grpo_cfg.data.source, tok))}
    if grpo_cfg.data.eval_source:
        out["grpo.data.eval_source"] = _read(p, "grpo.data.eval_source",
                                             lambda: prompt_rows(grpo_cfg, grpo_cfg.data.eval_source, tok))
    return out


def probe_rewards_on(p, field: str, cfg, rows: list) -> None:
    """Builds cfg's rewards (but the learned ones) and probes each on the first of `rows`; a ConfigError
    naming the pipeline file, `field` and the reward when one cannot be built or fails."""
    from grpolab.agents.agent import probe_meta
    from grpolab.rewards.base import RewardError, probe_reward
    from grpolab.rewards.registry import build_rewards

    specs = [dataclasses.asdict(r) for r in cfg.rewards if r.name not in NOT_PROBED]
    if not specs or not rows:
        return
    try:
        rewards = build_rewards(cfg.replace(rewards=specs))
    except ConfigError as e:
        raise ConfigError(f"{p.source}: {field}: {e}") from None
    first = rows[0]
    for fn, _w in rewards:
        try:
            meta = probe_meta(first, cfg.rollout.max_new_tokens) if cfg.episodes else {**first.meta, "truncated": False}
            probe_reward(fn, [first.prompt], [meta])
        except RewardError as e:
            raise ConfigError(f"{p.source}: {field}: {e} (every stage's rewards are probed before any stage "
                              "runs)") from None


def preflight(p, grpo_cfg, eval_cfg) -> None:
    """Every check of the module docstring, in order; the first failure is a ConfigError naming the
    pipeline file and the field. grpo_cfg / eval_cfg: the GRPO stage's and the evaluation's configs."""
    if p.sft is not None:
        try:
            p.sft.replace(**{"loss.policy_loss": "sft"}).validate()
        except ConfigError as e:
            raise ConfigError(f"{p.source}: sft: {e}") from None
    check_inputs(p)
    rows = read_inputs(p, grpo_cfg)
    probe_rewards_on(p, "grpo.rewards", grpo_cfg, rows["grpo.data.source"])
    held_out = rows.get("grpo.data.eval_source") or rows["grpo.data.source"]
    probe_rewards_on(p, "eval.rewards", eval_cfg, held_out)
    if eval_cfg.eval.group_fields and "grpo.data.eval_source" in rows:
        from grpolab.evaluation.evaluate import group_rows

        try:
            group_rows(held_out, eval_cfg.eval.group_fields)
        except ConfigError as e:
            raise ConfigError(f"{p.source}: {e} (grpo.data.eval_source={eval_cfg.data.eval_source!r})") from None
