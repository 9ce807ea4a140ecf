"""Scoring a rollout with the reward functions, and the per-step statistics (one metrics row)."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from grpolab.algo.advantages import zero_std_groups
from grpolab.algo.metrics import correct_rows, nanmean, pair_accuracy
from grpolab.grpo.episodes import episode_metrics
from grpolab.rewards.base import RewardError, combine, score_batch
from grpolab.rewards.registry import is_verifier
from grpolab.rewards.signature import RewardSignatureError


def score_rollout(rewards, items, texts: Sequence[str], ro, on_error: str, st: "StepStats",
                  max_new_tokens: int | None = None, pool=None, prompts: Sequence[str] | None = None,
                  row_meta: Sequence[dict] | None = None):
    """Scores every completion with every reward function and combines them.

    rewards: list of (RewardFn, weight). Returns (scores: name -> [N] (NaN = abstained),
    combined [N]). on_error: raise | zero (the failing function scores 0 for the batch) |
    skip_group (its rows become NaN: abstain). The count of errors is kept in st, and so are the
    names of the verifier rewards, in config order (the candidates of the `accuracy` metric).
    Each row's metadata: its prompt's meta, `truncated`, `completion_tokens` (generated tokens,
    EOS included), `completion_ids` (those tokens' ids, a list) and, when given, `max_new_tokens`
    (rollout.max_new_tokens; rewards/shaping.py).
    pool: a `rewards.pool.RewardPool` scoring on Ray reward workers (None = in this process).
    prompts: [N] the prompt of each row (default: each item's prompt). row_meta: [N] more metadata
    per row, over the rest (agent episodes: agents.episode.scoring_inputs').
    """
    G = ro.group_size
    prompts = list(prompts) if prompts is not None else [it.prompt for it in items for _ in range(G)]
    trunc = ro.truncated.tolist()
    mask = ro.attention_mask[:, ro.prompt_len:].bool()
    ids = [row[m].tolist() for row, m in zip(ro.input_ids[:, ro.prompt_len:].cpu(), mask.cpu())]
    limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    metas = [{**items[i // G].meta, "truncated": trunc[i], "completion_tokens": len(ids[i]), "completion_ids": ids[i],
              **limit, **(row_meta[i] if row_meta is not None else {})} for i in range(len(texts))]
    scores, weights = {}, {}
    st.verifiers = [fn.name for fn, _w in rewards if is_verifier(fn)]
    st.proxies = [fn.name for fn, w in rewards if w != 0 and not is_verifier(fn)]
    remote = pool.score(prompts, texts, metas, G) if pool is not None else {}
    for fn, w in rewards:
        try:
            if fn.name in remote:  # scored by the reward workers: their scores, or what the function raised
                if isinstance(remote[fn.name], BaseException):
                    raise remote[fn.name]
                scores[fn.name] = remote[fn.name]
            else:
                scores[fn.name] = score_batch(fn, prompts, texts, metas)
        except Exception as e:  # noqa: BLE001 - a user's reward function may raise anything
            if isinstance(e, RewardSignatureError):  # the data, not the reward's luck: on_error does not apply
                raise RewardError(str(e)) from None
            if on_error == "raise":
                if isinstance(e, RewardError):
                    raise
                raise RewardError(f"reward {fn.name!r} raised {type(e).__name__}: {e} "
                                  "(set train.on_reward_error=zero or skip_group to continue past it)") from e
            st.reward_errors += 1
            fill = 0.0 if on_error == "zero" else math.nan
            st.notes.append(f"reward {fn.name!r} raised {type(e).__name__}: {' '.join(str(e).split())[:200]} "
                            f"(train.on_reward_error={on_error}: "
                            f"{'scored 0' if on_error == 'zero' else 'abstained'} on this batch)")
            scores[fn.name] = torch.full((len(texts),), fill)
        weights[fn.name] = w
    return scores, combine(scores, weights)


def _std(x: torch.Tensor) -> float:
    x = x[~torch.isnan(x)]
    return float(x.std(unbiased=False)) if x.numel() > 1 else 0.0


@dataclass(frozen=True)
class StepRecord:
    """What a step's metrics and samples.jsonl read from the rollout, on CPU: one rank's groups
    (`of`), or every rank's in rank order (`merge`), which is how rank 0 sees the whole step."""

    items: list
    texts: list[str]
    scores: dict[str, torch.Tensor]
    """reward name -> [N] (NaN = abstained)."""
    rewards: torch.Tensor
    """[N] combined reward."""
    advantages: torch.Tensor
    """[N]."""
    lengths: torch.Tensor
    """[N] generated tokens (the completion part of the attention mask, whatever the loss mask kept; for
    episodes, the policy's tokens only)."""
    truncated: torch.Tensor
    """[N] bool."""
    group_size: int
    notes: tuple[str, ...] = ()
    """Degraded behaviour of the step (e.g. a reward that raised and was replaced), for the console."""
    episodes: tuple[dict, ...] | None = None
    """Agent runs: per row, the episode's counts and token segments (grpo.episodes.episode_rows); None otherwise."""

    @classmethod
    def of(cls, ro, items, texts, scores: dict[str, torch.Tensor], notes=(), episodes=None) -> "StepRecord":
        """episodes: grpo.episodes.episode_rows' (agent runs; `lengths` then counts policy tokens only)."""
        lengths = ro.attention_mask[:, ro.prompt_len:].sum(-1).cpu() if episodes is None else \
            torch.tensor([e["policy_tokens"] for e in episodes], dtype=torch.long)
        return cls(list(items), list(texts), {k: v.detach().cpu() for k, v in scores.items()},
                   ro.rewards.detach().cpu(), ro.advantages.detach().cpu(), lengths, ro.truncated.cpu(), ro.group_size,
                   tuple(notes), None if episodes is None else tuple(episodes))

    @classmethod
    def merge(cls, records: Sequence["StepRecord"]) -> "StepRecord":
        if len(records) == 1:
            return records[0]
        first = records[0]
        return cls([it for r in records for it in r.items], [t for r in records for t in r.texts],
                   {k: torch.cat([r.scores[k] for r in records]) for k in first.scores},
                   *(torch.cat([getattr(r, f) for r in records]) for f in ("rewards", "advantages", "lengths", "truncated")),
                   first.group_size, tuple(n for r in records for n in r.notes),
                   None if first.episodes is None else tuple(e for r in records for e in r.episodes))


_SUMS = ("kl", "ratio", "clipped_low", "clipped_high", "entropy", "tokens", "mismatch")


class StepStats:
    """Collects timers and microbatch statistics of one step; `finish` makes the metrics row."""

    def __init__(self, step: int):
        self.step = step
        self.times: dict[str, float] = {}
        self.sums: dict[str, float] = {}
        self.ratio_min, self.ratio_max = math.inf, -math.inf
        self.mismatch_max = 0.0  # max |log π_train − log π_sampler| over counted tokens
        self.grad_norms: list[float] = []
        self.losses: list[float] = []
        self.skipped = 0
        self.reward_errors = 0
        self.learn_tokens = 0
        self.verifiers: list[str] = []  # score names of the verifier rewards, in config order
        self.proxies: list[str] = []  # the trained-on rewards that are not verifiers (pair_acc/NAME)
        self.notes: list[str] = []  # degraded behaviour (a reward replaced after an error)
        self.gen_batches: int | None = None  # rollout.dynamic_sampling: batches drawn (alike on every rank)
        self.dropped_groups = 0  # rollout.dynamic_sampling: groups of equal rewards not trained on
        # weight versions between the trainer's policy and the ones that sampled the rollout, over its rows
        self.staleness_sum, self.staleness_rows, self.staleness_max = 0.0, 0, 0
        self.sync_bytes = 0  # sent to the rollout workers after Phase B (0 when the engine samples the policy itself)
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def timer(self, name: str):
        t = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    def set_staleness(self, per_row: torch.Tensor) -> None:
        """Records the rollout's staleness, [N] int: the learner's weight version minus each row's sampler's."""
        self.staleness_sum, self.staleness_rows = float(per_row.sum()), int(per_row.numel())
        self.staleness_max = int(per_row.max()) if per_row.numel() else 0

    def add_micro(self, stats: dict[str, torch.Tensor]) -> None:
        for k in _SUMS:
            self.sums[k] = self.sums.get(k, 0.0) + float(stats[k])
        self.ratio_min = min(self.ratio_min, float(stats["ratio_min"]))
        self.ratio_max = max(self.ratio_max, float(stats["ratio_max"]))
        self.mismatch_max = max(self.mismatch_max, float(stats["mismatch_max"]))

    def absorb(self, other: "StepStats") -> None:
        """Takes what `other` recorded while it generated and scored this step's batch elsewhere
        (rollout.overlap, in a background thread): timers, reward errors, notes, reward names."""
        for k, v in other.times.items():
            self.times[k] = self.times.get(k, 0.0) + v
        self.reward_errors += other.reward_errors
        self.notes += other.notes
        self.verifiers, self.proxies = other.verifiers, other.proxies

    def reduce(self, parallel) -> "StepStats":
        """Sums the microbatch sums, reward errors and dropped groups over ranks, min/max the ratio
        extremes (every rank then holds the step's global statistics); returns self. Timers stay
        this rank's."""
        counts = [self.reward_errors, self.dropped_groups, self.staleness_sum, self.staleness_rows]
        sums, mins, maxs = parallel.reduce_floats([self.sums.get(k, 0.0) for k in _SUMS] + counts, [self.ratio_min],
                                                  [self.ratio_max, self.mismatch_max, self.staleness_max])
        self.sums = dict(zip(_SUMS, sums))
        self.reward_errors, self.dropped_groups = int(sums[-4]), int(sums[-3])
        self.staleness_sum, self.staleness_rows = sums[-2], int(sums[-1])
        self.ratio_min, self.ratio_max, self.mismatch_max, self.staleness_max = mins[0], maxs[0], maxs[1], int(maxs[2])
        return self

    def finish(self, record: StepRecord, s) -> dict:
        tok = max(self.sums.get("tokens", 0.0), 1.0)
        r, adv, scores = record.rewards, record.advantages, record.scores
        lengths = record.lengths.float()
        gen_tokens = float(lengths.sum())
        row = {
            "step": self.step,
            "reward/mean": nanmean(r),
            "reward/std": _std(r),
        }
        for name, sc in scores.items():
            row[f"reward/{name}/mean"] = nanmean(sc)
            row[f"reward/{name}/std"] = _std(sc)
        correct = correct_rows(scores, self.verifiers)
        if correct is not None:
            row["accuracy"] = nanmean(correct)
            for name in self.proxies:  # each trained-on reward that is not a verifier: a proxy of the gold
                if name in scores:
                    row[f"pair_acc/{name}"] = pair_accuracy(scores[name], correct, record.group_size)
        t_total = time.perf_counter() - self.t0
        row.update({
            "adv/mean": float(adv.mean()), "adv/std": float(adv.std(unbiased=False)),
            "adv/min": float(adv.min()), "adv/max": float(adv.max()),
            "groups/zero_std_frac": float(zero_std_groups(r.view(-1, record.group_size)).float().mean()),
            "kl": self.sums.get("kl", 0.0) / tok,
            "clip/low_frac": self.sums.get("clipped_low", 0.0) / tok,
            "clip/high_frac": self.sums.get("clipped_high", 0.0) / tok,
            "ratio/mean": self.sums.get("ratio", 0.0) / tok,
            "ratio/min": self.ratio_min if math.isfinite(self.ratio_min) else 1.0,
            "ratio/max": self.ratio_max if math.isfinite(self.ratio_max) else 1.0,
            "entropy": self.sums.get("entropy", 0.0) / tok,
            "mismatch/mean": self.sums.get("mismatch", 0.0) / tok, "mismatch/max": self.mismatch_max,
            "loss": sum(self.losses) / max(len(self.losses), 1),
            "grad_norm": sum(self.grad_norms) / max(len(self.grad_norms), 1),
            "lr": s.optim.scheduler.get_last_lr()[0],
            "len/mean": float(lengths.mean()), "len/max": float(lengths.max()),
            "len/truncated_frac": float(record.truncated.float().mean()),
            "time/rollout_s": self.times.get("rollout", 0.0), "time/score_s": self.times.get("score", 0.0),
            "time/logprob_s": self.times.get("logprob", 0.0), "time/learn_s": self.times.get("learn", 0.0),
            "time/step_s": t_total,
            "tokens_per_s/rollout": gen_tokens / max(self.times.get("rollout", 0.0), 1e-9),
            "tokens_per_s/learn": self.sums.get("tokens", 0.0) / max(self.times.get("learn", 0.0), 1e-9),
            "skipped_steps": self.skipped,
            "reward_errors": self.reward_errors,
        })
        row.update({"rollout/staleness": self.staleness_sum / max(self.staleness_rows, 1),
                    "rollout/staleness_max": self.staleness_max, "time/sync_s": self.times.get("sync", 0.0)})
        if self.sync_bytes:  # the weights went to rollout workers of their own
            row.update({"sync/seconds": self.times.get("sync", 0.0), "sync/bytes": self.sync_bytes})
        if "rollout_wait" in self.times:  # rollout.overlap: what the step waited for its prefetched batch
            row["time/rollout_wait_s"] = self.times["rollout_wait"]
        if self.gen_batches is not None:
            row.update({"rollout/gen_batches": self.gen_batches, "rollout/dropped_groups": self.dropped_groups})
        if record.episodes is not None:
            row.update(episode_metrics(record.episodes))
        row["mfu"] = s.mfu(row)
        return row
