"""Prompt sources from the config: the built-in task, JSONL / local HF datasets, reasoning-gym."""

from __future__ import annotations

from grpolab.data.arith import ArithTask
from grpolab.data.stream import ArithStream, ListStream, SeedStream


def arith_task(cfg) -> ArithTask:
    d = cfg.data
    return ArithTask(seed=d.seed, ops=d.arith_ops, unanswerable_share=d.arith_unanswerable_share,
                     eval_fraction=d.arith_eval_fraction, answer_lsb_first=d.arith_answer_lsb_first)


def capped(rows: list, cap: int | None, field: str) -> list:
    """The first `cap` rows (None: all of them); says so on stderr when the cap cuts rows, naming `field`."""
    import sys

    if cap is None or cap >= len(rows):
        return rows
    print(f"grpolab: note: {field}={cap} keeps the first {cap} of the {len(rows)} rows ({len(rows) - cap} unused); "
        f"{field}=null uses them all", file=sys.stderr, flush=True)
    return rows[:cap]


def arith_eval_items(cfg, task: ArithTask | None = None):
    """The held-out evaluation prompts of the built-in task (data.eval_prompts of them). Too many
    for the held-out side is a ConfigError naming the field, raised before any training starts."""
    from grpolab.config import ConfigError

    try:
        return (task or arith_task(cfg)).eval_items(cfg.data.builtin_eval_prompts, seed=cfg.data.seed)
    except ValueError as e:
        raise ConfigError(f"data.eval_prompts={cfg.data.builtin_eval_prompts} "
                          f"(data.arith_unanswerable_share={cfg.data.arith_unanswerable_share}): {e}") from None


def source_options(cfg, tokenizer) -> dict:
    """The loaders' keyword arguments for cfg.data (field names, system prompt, chat template).
    data.chat_template=true with a tokenizer that has no chat template is a ConfigError."""
    from grpolab.config import ConfigError

    d = cfg.data
    if d.chat_template is True and getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(f"data.chat_template=true but the tokenizer of model.name_or_path="
                          f"{cfg.model.name_or_path!r} has no chat template; set data.chat_template=false (plain "
                          "prompts) or auto")
    return dict(tokenizer=tokenizer, system_prompt=d.system_prompt, use_chat_template=d.chat_template is not False)


def prompt_stream(cfg, tokenizer):
    """The GRPO prompt stream of cfg.data.source (seeded by train.seed)."""
    src = cfg.data.source
    if src == "builtin:arith":
        return ArithStream(arith_task(cfg), seed=cfg.train.seed)
    if src == "builtin:seeds":
        return SeedStream(seed=cfg.train.seed)
    kind, _, arg = src.partition(":")
    if kind == "jsonl":
        from grpolab.data.sources import load_jsonl

        items = load_jsonl(arg, prompt_field=cfg.data.prompt_field, messages_field=cfg.data.messages_field,
                           **source_options(cfg, tokenizer))
    elif kind == "hf":
        from grpolab.data.sources import load_hf_dataset

        items = load_hf_dataset(arg, "train", prompt_field=cfg.data.prompt_field,
                                messages_field=cfg.data.messages_field, **source_options(cfg, tokenizer))
    elif kind == "rg":
        from grpolab.data.sources import reasoning_gym_items

        items = reasoning_gym_items(arg, size=10_000, seed=cfg.data.seed, **source_options(cfg, tokenizer))
    else:
        raise ValueError(f"data.source={src!r}: expected builtin:arith, builtin:seeds, jsonl:PATH, hf:PATH or rg:TASK")
    return ListStream(items, seed=cfg.train.seed)
