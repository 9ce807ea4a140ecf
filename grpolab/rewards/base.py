"""The reward-function protocol, calling reward functions safely, and the weighted combination.

A reward function scores a batch of completions. It gets the prompts, the completions and one
metadata dict per row (e.g. the gold answer of the task), and returns one float per row, or None
where it abstains (e.g. a math verifier on a row with no gold answer). Abstentions become NaN in
the score tensor; `combine` skips them row by row (the row's weighted sum uses the other rewards).

Building rewards by name lives in grpolab.rewards.registry; `register_reward`, `reward_names`
and `build_reward` are re-exported here for existing callers.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from grpolab.algo.advantages import group_normalize
from grpolab.rewards.registry import build_reward, register_reward, reward_names
from grpolab.rewards.signature import RewardSignatureError

__all__ = ["RewardError", "RewardFn", "RewardSetupError", "build_reward", "call_with_timeout", "combine",
           "probe_reward", "probe_rewards", "register_reward", "reward_names", "score_batch"]


@runtime_checkable
class RewardFn(Protocol):
    """Scores completions: one float (or None to abstain) per row.

    Built rewards also carry `verifier: bool` (see grpolab.rewards.registry) and, during training,
    `timeout_s` (train.reward_timeout_s); reward classes must not use those attribute names for
    anything else.
    """

    name: str

    def __call__(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        metadata: Sequence[dict[str, Any]],
    ) -> list[float | None]: ...


class RewardError(RuntimeError):
    """A reward function failed or broke the protocol; the message names it and the row."""


class RewardSetupError(RewardError):
    """A reward that cannot be called on this data (its parameters do not fit the rows' fields):
    found by the start-up probe, always fatal (train.on_reward_error does not apply)."""


def score_batch(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    metadata: Sequence[dict[str, Any]],
) -> torch.Tensor:
    """Calls one reward function and checks what it returns.

    Returns: [N] float32 tensor, NaN where the function abstained (returned None).
    Raises RewardError naming the function and the row for a wrong count, a non-number or inf,
    and naming the function when a call runs longer than `fn.timeout_s` seconds (set from
    train.reward_timeout_s by build_setup; absent or 0 = no limit).
    """
    n = len(completions)
    out = call_with_timeout(fn, (prompts, completions, metadata), getattr(fn, "timeout_s", 0) or 0)
    if out is None or not hasattr(out, "__len__") or len(out) != n:
        got = "None" if out is None else (len(out) if hasattr(out, "__len__") else type(out).__name__)
        raise RewardError(f"reward {fn.name!r} returned {got} scores for {n} completions; it must return one per row")
    vals = []
    for i, v in enumerate(out):
        if v is None:
            vals.append(math.nan)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward {fn.name!r} returned {v!r} for row {i}; expected a float or None") from None
        if not math.isfinite(f):
            raise RewardError(
                f"reward {fn.name!r} returned {f} for row {i} (prompt {str(prompts[i])[:60]!r}); "
                "return None to abstain instead"
            )
        vals.append(f)
    return torch.tensor(vals, dtype=torch.float32)


def call_with_timeout(fn: RewardFn, args: tuple, timeout_s: float) -> Any:
    """fn(*args), or RewardError when it has not returned after timeout_s seconds (0 = no limit).

    The call runs in a daemon thread with the caller's grad mode. Python cannot kill a thread: a
    hung call keeps running in the background (and a process exit does not wait for it); what
    the run does next is train.on_reward_error's choice. A reward that may hang in C code or loop
    forever on purpose belongs in a subprocess with a hard limit (see sandbox/sandbox.py).
    """
    if not timeout_s:
        return fn(*args)
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def target() -> None:
        try:
            with torch.set_grad_enabled(grad):
                box["out"] = fn(*args)
        except BaseException as e:  # handed to the caller's thread
            box["err"] = e

    worker = threading.Thread(target=target, name=f"reward-{fn.name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardError(
            f"reward {fn.name!r} did not return within train.reward_timeout_s={timeout_s:g} s on a batch of "
            f"{len(args[1])} completions (first prompt {str(args[0][0])[:60]!r}); it may hang. The call cannot "
            "be killed and keeps running in a background thread; raise the limit if it is just slow, or set "
            "train.on_reward_error=zero or skip_group to continue without it"
        )
    if "err" in box:
        raise box["err"]
    return box["out"]


def probe_reward(fn: RewardFn, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]) -> None:
    """Calls fn once on one empty completion per prompt, before any generation, so that a
    reward that crashes, breaks the protocol or hangs is reported at start-up.

    Raises RewardError naming the function (and the row where one is at fault).
    """
    try:
        score_batch(fn, prompts, [""] * len(prompts), [{**m, "completion_ids": []} for m in metadata])
    except RewardSignatureError as e:
        raise RewardSetupError(f"{e} [found at start-up, probing the first prompts]") from None
    except RewardError as e:
        raise RewardError(f"{e} [found at start-up: probed with an empty completion per prompt]") from e
    except Exception as e:  # noqa: BLE001 - a user's reward function may raise anything
        raise RewardError(f"reward {fn.name!r} raised {type(e).__name__}: {e} when probed at start-up with an "
                          "empty completion for each of the first prompts (set train.on_reward_error=zero or "
                          "skip_group to continue past reward errors)") from e


def probe_rewards(rewards: Sequence[tuple[RewardFn, float]], prompts: Sequence[str],
                  metadata: Sequence[dict[str, Any]], on_error: str) -> None:
    """`probe_reward` for each (fn, weight). A failure raises when on_error is "raise"; otherwise
    it is printed as a warning and train.on_reward_error applies to it during training."""
    for fn, _weight in rewards:
        try:
            probe_reward(fn, prompts, metadata)
        except RewardError as e:
            if on_error == "raise" or isinstance(e, RewardSetupError):
                raise
            print(f"grpolab: warning: {e}", file=sys.stderr)


def combine(scores: dict[str, torch.Tensor], weights: dict[str, float],
            aggregation: str = "sum_then_normalize", group_size: int = 1, eps: float = 1e-6) -> torch.Tensor:
    """Weighted sum of several reward functions' scores into one scalar per row.

    scores: name -> [N] (NaN = abstained). A row's abstaining functions are left out of its sum;
    a row where every function abstained gets NaN (the advantage functions give it 0).
    aggregation (TRL's multi_objective_aggregation): "sum_then_normalize" sums the raw scores (the
    advantage estimator normalizes the sum); "normalize_then_sum" (GDPO, arXiv 2601.05242) first
    normalizes each function's scores within each group of `group_size` consecutive rows,
    (s - group mean) / (group sample std + eps) with `algo.advantages.group_normalize` (0 for an
    abstention, a group with < 2 scores or equal scores), as TRL does; then the weighted sum.
    Returns: [N] float32.
    """
    if aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        raise ValueError(f"aggregation must be sum_then_normalize or normalize_then_sum, got {aggregation!r}")
    names = list(scores)
    stacked = torch.stack([scores[k] for k in names], dim=0)  # [K, N]
    w = torch.tensor([weights[k] for k in names], dtype=stacked.dtype).unsqueeze(1)  # [K, 1]
    present = ~torch.isnan(stacked)
    if aggregation == "normalize_then_sum":
        stacked = torch.stack([group_normalize(row.view(-1, group_size), "sample", eps).flatten() for row in stacked])
    total = torch.where(present, stacked * w, torch.zeros_like(stacked)).sum(0)
    return torch.where(present.any(0), total, torch.full_like(total, math.nan))
