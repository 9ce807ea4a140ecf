"""The config reference, generated from the dataclasses of grpolab.config (`grpolab config PRESET`).

Every field is listed with its value in the given config, its type and its docstring (the string
literal right after the field in its section's module, read with `ast`), plus, for enumerated fields,
the allowed values with a line each, read from the registries (config.validation.registry_choices) or the
fixed lists (config.validation.FIXED_CHOICES). Nothing here is written by hand, so it cannot go stale.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import typing
from dataclasses import dataclass
from typing import Any

from grpolab.config.io import dump_value
from grpolab.config.validation import FIXED_CHOICES, describe, registry_choices
from grpolab.algo.advantages import VALUE_BASED
from grpolab.config import Config, RewardSpec


@dataclass(frozen=True)
class FieldDoc:
    """One line of the reference: dotted path, type, YAML value, docstring, allowed values."""

    path: str
    type: str
    value: str
    doc: str
    choices: dict[str, str] = dataclasses.field(default_factory=dict)
    """Allowed value -> description ('' when the registry gives none); empty when not enumerated."""
    open_choices: bool = False
    """The choices are the known names, not all allowed values (reward names: 'module:attr' too)."""


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (the string literal right after the field), for a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[node.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def type_name(tp: Any) -> str:
    """A readable annotation: 'int', 'float | None', 'tuple[RewardSpec, ...]'."""
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return re.sub(r"grpolab\.config\.\w+\.", "", str(tp).replace("typing.", ""))


def _reward_names() -> dict[str, str]:
    """Known reward names -> description, '[verifier] ' first for verifiers (from the reward registry)."""
    from grpolab.rewards.registry import builtin_rewards, registered_rewards

    entries = {**builtin_rewards(), **registered_rewards()}
    out = {}
    for name in sorted(entries):
        entry = entries[name]
        verifier = entry.verifier if entry.verifier is not None else getattr(entry.factory, "verifier", False)
        out[name] = ("[verifier] " if verifier is True else "") + describe(entry.factory)
    return out


def _section(obj: Any, prefix: str, choices: dict[str, dict[str, str]]) -> list[FieldDoc]:
    cls = type(obj)
    docs, hints = attribute_docs(cls), typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}"
        value = getattr(obj, f.name)
        out.append(FieldDoc(path, type_name(hints[f.name]), dump_value(value), docs.get(f.name, ""),
                            choices.get(path, {})))
    return out


def _rewards(cfg: Config, docs: dict[str, str], hints: dict[str, Any]) -> list[FieldDoc]:
    """The rewards section: the list itself, each entry's values, then each RewardSpec field."""
    out = [FieldDoc("rewards", type_name(hints["rewards"]), "", docs.get("rewards", ""))]
    for i, spec in enumerate(cfg.rewards):
        values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(RewardSpec)}
        out.append(FieldDoc(f"rewards[{i}]", "RewardSpec", dump_value(values), ""))
    spec_docs, spec_hints = attribute_docs(RewardSpec), typing.get_type_hints(RewardSpec)
    for f in dataclasses.fields(RewardSpec):
        values = [getattr(s, f.name) for s in cfg.rewards]
        names = _reward_names() if f.name == "name" else {}
        out.append(FieldDoc(f"rewards[].{f.name}", type_name(spec_hints[f.name]), dump_value(values),
                            spec_docs.get(f.name, ""), names, open_choices=bool(names)))
    return out


def reference_entries(cfg: Config) -> list[FieldDoc]:
    """Every field of `cfg` (sections in order, then each field), as FieldDocs."""
    choices: dict[str, dict[str, str]] = dict(registry_choices())
    for name, allowed in FIXED_CHOICES.items():
        choices[name] = {v: "" for v in allowed}
    docs, hints = attribute_docs(Config), typing.get_type_hints(Config)
    out = []
    for f in dataclasses.fields(Config):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.append(FieldDoc(f.name, type_name(hints[f.name]), "", inspect.cleandoc(type(value).__doc__ or "")))
            out.extend(_section(value, f.name, choices))
        elif f.name == "rewards":
            out.extend(_rewards(cfg, docs, hints))
        else:
            out.append(FieldDoc(f.name, type_name(hints[f.name]), dump_value(value), docs.get(f.name, "")))
    return out


def format_reference(entries: list[FieldDoc], title: str = "") -> str:
    """Plain text: one block per field, `path: type = value`, then the indented docstring and choices."""
    lines = [title, ""] if title else []
    for e in entries:
        if not e.value and "." not in e.path and "[" not in e.path:  # a section header
            lines += ["", f"[{e.path}]  ({e.type})", *_indent(e.doc, 2), ""]
            continue
        lines.append(f"{e.path}: {e.type} = {e.value}")
        if not e.doc and e.path.endswith("]"):  # one entry of a list section: its values only
            continue
        lines += _indent(e.doc or "(no docstring)", 4)
        if e.choices:
            lines.append("    known names (or 'module:attr'):" if e.open_choices else "    choices:")
            names = {_yaml_name(k): d for k, d in e.choices.items()}
            width = max(len(k) for k in names)
            lines += [f"      {k.ljust(width)}  {d}".rstrip() for k, d in names.items()]
    return "\n".join(lines).rstrip() + "\n"


def _yaml_name(choice) -> str:
    """A choice as it is written in YAML (true / false for booleans)."""
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def _indent(text: str, n: int) -> list[str]:
    return [(" " * n + line).rstrip() for line in text.splitlines()]


def derived_sizes(cfg: Config) -> list[str]:
    """What the fields add up to: the step's sequences, optimizer steps per rollout, and how many of
    those learn off-policy without correction (a policy loss without an importance ratio)."""
    lines = [f"sequences per step: {cfg.sequences_per_step} (rollout.prompts_per_step × rollout.group_size)",
             f"optimizer steps per rollout: {cfg.optimizer_steps_per_step} (train.epochs={cfg.train.epochs} × "
             f"{cfg.minibatches_per_epoch} minibatches of {cfg.minibatch_sequences} sequences)"]
    if cfg.off_policy_steps:
        lines.append(off_policy_note(cfg))
    lo = cfg.loss
    if lo.advantage in VALUE_BASED:
        lines.append(f"value head on the policy's trunk: per-token GAE (γ={lo.gae_gamma}, λ={lo.gae_lambda}), value "
                     f"loss × loss.value_coef={lo.value_coef}; Phase A adds a no-grad trunk pass for V_old")
    return lines


def off_policy_note(cfg: Config) -> str:
    return (f"off-policy without correction: {cfg.off_policy_steps} of the {cfg.optimizer_steps_per_step} optimizer "
            f"steps per rollout (loss.policy_loss={cfg.loss.policy_loss!r} has no importance ratio; "
            "train.minibatch_size=0 and train.epochs=1 keep it on-policy)")


def config_reference(cfg: Config, title: str = "") -> str:
    """The text `grpolab config` prints for `cfg`: the derived sizes, then every field."""
    derived = ["derived:", *(f"  {line}" for line in derived_sizes(cfg)), ""]
    return format_reference(reference_entries(cfg), "\n".join([title, "", *derived]) if title else "\n".join(derived))
