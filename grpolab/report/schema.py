"""The one list of metrics.jsonl keys, and light validators for the run-directory files.

`METRICS` names every key the GRPO loop writes per step, with a one-line description and a unit.
Per reward function NAME the loop also writes `reward/NAME/mean` and `reward/NAME/std`
(`REWARD_FN_KEYS`). Later work may add keys: unknown extra keys are allowed everywhere.

Values: `int` keys hold JSON integers; `float` keys hold JSON numbers or `null` (a non-finite
float is written as null, because NaN is not valid JSON).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class MetricSpec:
    key: str
    description: str
    unit: str
    kind: Literal["float", "int"] = "float"
    required: bool = True


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("step", "GRPO step index (one rollout batch and its learning phase)", "step", "int"),
    MetricSpec("reward/mean", "mean combined (weighted) reward over the N = P×G completions",
               "reward"),
    MetricSpec("reward/std", "std of the combined reward over the N completions", "reward"),
    MetricSpec("accuracy", "share of verifiable rows scored correct (absent without a verifier)",
               "fraction", required=False),
    MetricSpec("adv/mean", "mean advantage over the N completions", "advantage"),
    MetricSpec("adv/std", "std of the advantages", "advantage"),
    MetricSpec("adv/min", "smallest advantage", "advantage"),
    MetricSpec("adv/max", "largest advantage", "advantage"),
    MetricSpec("groups/zero_std_frac", "share of prompt groups whose G rewards are all equal",
               "fraction"),
    MetricSpec("kl", "mean per-token KL estimate to the reference policy", "nats/token"),
    MetricSpec("clip/low_frac", "share of tokens clipped at 1-ε_low (negative advantage)",
               "fraction"),
    MetricSpec("clip/high_frac", "share of tokens clipped at 1+ε_high (positive advantage)",
               "fraction"),
    MetricSpec("ratio/mean", "mean importance ratio π_new/π_old over tokens", "ratio"),
    MetricSpec("ratio/min", "smallest importance ratio", "ratio"),
    MetricSpec("ratio/max", "largest importance ratio", "ratio"),
    MetricSpec("entropy", "mean per-token entropy of the policy", "nats/token"),
    MetricSpec("loss", "policy loss (mean over the step's minibatches)", "loss"),
    MetricSpec("grad_norm", "gradient norm before clipping (mean over minibatches)", "L2 norm"),
    MetricSpec("lr", "learning rate at the end of the step", "dimensionless"),
    MetricSpec("len/mean", "mean completion length", "tokens"),
    MetricSpec("len/max", "longest completion", "tokens"),
    MetricSpec("len/truncated_frac", "share of completions cut at the max new tokens", "fraction"),
    MetricSpec("time/rollout_s", "generation time (phase A)", "s"),
    MetricSpec("time/score_s", "reward scoring time", "s"),
    MetricSpec("time/logprob_s", "old/reference log-prob forward passes", "s"),
    MetricSpec("time/learn_s", "learning phase (phase B)", "s"),
    MetricSpec("time/step_s", "whole step, wall clock", "s"),
    MetricSpec("tokens_per_s/rollout", "generated tokens per second in the rollout", "tokens/s"),
    MetricSpec("tokens_per_s/learn", "trained tokens (prompt+completion) per second, phase B",
               "tokens/s"),
    MetricSpec("mfu", "model FLOP utilisation against peak_flops (metrics.model_flops_per_token)",
               "fraction"),
    MetricSpec("skipped_steps", "optimizer steps skipped so far (e.g. non-finite gradients)",
               "count", "int"),
    MetricSpec("reward_errors", "reward-function calls that raised so far", "count", "int"),
    MetricSpec("rollout/gen_batches", "rollout.dynamic_sampling: batches of prompts_per_step prompts generated "
               "in the step (1 = no extra batch; verl's num_gen_batches)", "count", "int", required=False),
    MetricSpec("rollout/dropped_groups", "rollout.dynamic_sampling: groups of equal rewards generated in the step "
               "and not trained on (every rank's)", "count", "int", required=False),
    MetricSpec("mismatch/mean", "mean |log π_train − log π_sampler| over trained tokens (train/inference "
               "mismatch; π_old against the sampler's own log-probs)", "nats/token", required=False),
    MetricSpec("mismatch/max", "largest |log π_train − log π_sampler| over trained tokens", "nats", required=False),
    MetricSpec("rollout/staleness", "weight versions between the policy that learns and the one that sampled "
               "the rollout, mean over its rows (episodes) (rollout.overlap=K: up to K)", "versions", required=False),
    MetricSpec("rollout/staleness_max", "rollout/staleness: the largest over the rows (≤ rollout.overlap)", "versions",
               "int", required=False),
    MetricSpec("time/sync_s", "sending the new weights to the rollout engine after phase B", "s", required=False),
    MetricSpec("time/rollout_wait_s", "rollout.overlap: waiting for the batch prefetched during earlier steps",
               "s", required=False),
    MetricSpec("sync/seconds", "rollout.workers: weight sync to the workers (object store put + every worker's "
               "load; with rollout.overlap ≥ 2 the put + the wait for the previous sync)", "s", required=False),
    MetricSpec("sync/bytes", "rollout.workers: bytes of weights sent to the workers per sync", "bytes", "int",
               required=False),
    MetricSpec("rm_refresh/labels", "rm_refresh: pairs of the policy's completions the labeler judged at this "
               "step's refresh (ties included; within rm_refresh.labels_per_refresh)", "pairs", "int", required=False),
    MetricSpec("rm_refresh/labels_total", "rm_refresh: pairs judged so far in the run", "pairs", "int", required=False),
    MetricSpec("rm_refresh/pairs", "rm_refresh: judged pairs with a preference (the new RM training pairs)", "pairs",
               "int", required=False),
    MetricSpec("value/loss", "loss.advantage=gae: value loss 0.5·max((V-R)², (clip(V)-R)²) per trained token",
               "reward²", required=False),
    MetricSpec("value/clip_frac", "loss.advantage=gae: share of trained tokens where the clipped value term "
               "was the larger (no value gradient)", "fraction", required=False),
    MetricSpec("value/mean", "loss.advantage=gae: mean V_old over the counted tokens", "reward", required=False),
    MetricSpec("value/explained_var", "loss.advantage=gae: 1 - Var(R - V_old)/Var(R) over the counted tokens "
               "(1 = V_old predicts the returns)", "fraction", required=False),
)

METRIC_BY_KEY: dict[str, MetricSpec] = {m.key: m for m in METRICS}

REWARD_FN_KEYS: tuple[MetricSpec, ...] = (
    MetricSpec("reward/{name}/mean", "mean score of reward function NAME (abstentions skipped)",
               "reward"),
    MetricSpec("reward/{name}/std", "std of reward function NAME's scores", "reward"),
)

_REWARD_FN_RE = re.compile(r"^reward/(?P<name>.+)/(?P<stat>mean|std)$")
_PAIR_ACC_RE = re.compile(r"^pair_acc/(?P<name>.+)$")
PAIR_ACC_KEY = MetricSpec(
    "pair_acc/{name}", "with a verifier among the rewards, for each trained-on reward NAME that is not one: "
    "the share of (correct, wrong) completion pairs of a prompt that NAME ranks right (ties 1/2), on the "
    "policy's own samples; null when no group had both", "fraction", required=False)


def reward_fn_names(row_or_keys: Any) -> list[str]:
    """Reward-function names found in keys like `reward/NAME/mean`, in first-seen order."""
    names: list[str] = []
    for key in row_or_keys:
        m = _REWARD_FN_RE.match(key)
        if m and m["name"] not in names:
            names.append(m["name"])
    return names


def describe(key: str) -> MetricSpec | None:
    """The spec of a key, including per-reward-function keys; None for an unknown extra key."""
    if key in METRIC_BY_KEY:
        return METRIC_BY_KEY[key]
    m = _REWARD_FN_RE.match(key)
    if m:
        spec = REWARD_FN_KEYS[0 if m["stat"] == "mean" else 1]
        return MetricSpec(key, spec.description.replace("NAME", m["name"]), spec.unit)
    m = _PAIR_ACC_RE.match(key)
    if m:
        return MetricSpec(key, PAIR_ACC_KEY.description.replace("NAME", m["name"]), "fraction", required=False)
    m = _REFRESH_RE.match(key)
    if m:
        return MetricSpec(key, f"rm_refresh of {m['name']}: " + _REFRESH_STATS[m["stat"]],
                          "loss" if m["stat"] == "loss" else "fraction", required=False)
    return None


_REFRESH_RE = re.compile(r"^rm_refresh/(?P<name>.+)/(?P<stat>pair_acc_before|pair_acc_after|loss)$")
_REFRESH_STATS = {
    "pair_acc_before": "its accuracy on the newly labelled pairs of the policy's samples, before training on them",
    "pair_acc_after": "its accuracy on the newly labelled pairs, after the refresh",
    "loss": "mean pairwise loss of the refresh's optimizer steps"}


def _type_problem(key: str, value: Any, kind: str) -> str | None:
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key!r} must be an integer, got {value!r}"
        return None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{key!r} must be a number or null, got {value!r}"
    if not math.isfinite(value):
        return f"{key!r} is {value!r}: write non-finite floats as null"
    return None


def validate_metrics_row(row: Any, *, reward_names: list[str] | None = None) -> None:
    """Raises ValueError listing every problem of one metrics.jsonl row.

    Checks: row is a dict; every required key of METRICS is present with the right type
    (float keys: finite number or null; int keys: integer); `step` >= 0; every
    `reward/NAME/mean|std` key is a number or null, and present for each of `reward_names`
    when given. Unknown extra keys are allowed.
    """
    if not isinstance(row, dict):
        raise ValueError(f"metrics row must be a JSON object, got {type(row).__name__}")
    problems = [f"missing key {m.key!r}" for m in METRICS if m.required and m.key not in row]
    for key, value in row.items():
        spec = describe(key)
        if spec is not None:
            problem = _type_problem(key, value, spec.kind)
            if problem:
                problems.append(problem)
    if isinstance(row.get("step"), int) and not isinstance(row["step"], bool) and row["step"] < 0:
        problems.append(f"'step' must be >= 0, got {row['step']}")
    for name in reward_names or []:
        for stat in ("mean", "std"):
            if f"reward/{name}/{stat}" not in row:
                problems.append(f"missing key 'reward/{name}/{stat}' for reward function {name!r}")
    if problems:
        step = row.get("step", "?")
        raise ValueError(f"metrics row (step {step}): " + "; ".join(problems))


def validate_sample_row(row: Any) -> None:
    """Raises ValueError naming the first bad field of one samples.jsonl row (one prompt group).

    A completion may hold an `episode` (a multi-turn agent episode): turns, tool_calls and tool_errors
    (integers >= 0), stop_reason (a string, e.g. one of STOP_REASONS), env_reward (number or null) and
    segments, a list of {source: one of EPISODE_SOURCES, text: string, tokens: integer >= 0}.
    """
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"samples row: {msg}")

    need(isinstance(row, dict), f"must be a JSON object, got {type(row).__name__}")
    need(isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool),
         f"'step' must be an integer, got {row.get('step')!r}")
    need(isinstance(row.get("prompt"), str), "'prompt' must be a string")
    need(isinstance(row.get("meta", {}), dict), "'meta' must be an object")
    comps = row.get("completions")
    need(isinstance(comps, list), "'completions' must be a list")
    for i, c in enumerate(comps):
        where = f"completions[{i}]"
        need(isinstance(c, dict), f"{where} must be an object")
        need(isinstance(c.get("text"), str), f"{where}.text must be a string")
        need(isinstance(c.get("rewards", {}), dict), f"{where}.rewards must be an object")
        for name, v in c.get("rewards", {}).items():
            need(v is None or _type_problem(name, v, "float") is None,
                 f"{where}.rewards[{name!r}] must be a number or null, got {v!r}")
        for field in ("reward", "advantage"):
            v = c.get(field)
            need(v is None or _type_problem(field, v, "float") is None,
                 f"{where}.{field} must be a number or null, got {v!r}")
        if "episode" in c:
            _check_episode(c["episode"], f"{where}.episode", need)


EPISODE_SOURCES = ("prompt", "policy", "env")
"""Sources of an episode segment: policy tokens are sampled and trained; prompt and env are context."""
STOP_REASONS = ("done", "max_turns", "max_turn_tokens", "max_episode_tokens", "env_error")
"""Stop reasons an agent episode records; the validator accepts any string, later ones included."""


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_episode(ep: Any, where: str, need: Any) -> None:
    """Checks the optional `episode` of one completion (a multi-turn agent episode); `where` names it
    (e.g. "completions[2].episode") and `need(cond, msg)` raises the row's ValueError."""
    need(isinstance(ep, dict), f"{where} must be an object")
    for field in ("turns", "tool_calls", "tool_errors"):
        need(_is_count(ep.get(field)), f"{where}.{field} must be an integer >= 0, got {ep.get(field)!r}")
    need(isinstance(ep.get("stop_reason"), str), f"{where}.stop_reason must be a string, got {ep.get('stop_reason')!r}")
    v = ep.get("env_reward")
    need(v is None or _type_problem("env_reward", v, "float") is None,
         f"{where}.env_reward must be a number or null, got {v!r}")
    segments = ep.get("segments")
    need(isinstance(segments, list), f"{where}.segments must be a list")
    for j, seg in enumerate(segments):
        at = f"{where}.segments[{j}]"
        need(isinstance(seg, dict), f"{at} must be an object")
        need(seg.get("source") in EPISODE_SOURCES,
             f"{at}.source must be one of {', '.join(EPISODE_SOURCES)}, got {seg.get('source')!r}")
        need(isinstance(seg.get("text"), str), f"{at}.text must be a string")
        need(_is_count(seg.get("tokens")), f"{at}.tokens must be an integer >= 0, got {seg.get('tokens')!r}")
