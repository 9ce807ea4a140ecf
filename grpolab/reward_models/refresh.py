"""Iterated reward-model updates during GRPO (`rm_refresh.*`): the RMs keep learning where the policy goes.

Every `rm_refresh.every_steps` steps (production RLHF's iterated RM rounds):
1. the completions of the steps since the last refresh are grouped by prompt;
2. pairs of distinct completions of a prompt are queued for annotation: per group, the completion the
   RM ranks highest (where an over-optimized policy is being pushed) against another one of the group,
   groups in seeded random order, round after round;
3. the labeler (the preference source: a reward function, called on queued pairs' completions only)
   judges them in queue order until `labels_per_refresh` pairs are judged: the higher score is
   preferred, equal scores are a tie (no training pair), a None/NaN on either side is no judgement
   (not counted, e.g. a check that abstains on the prompt); every judged pair counts against the budget;
4. each refreshed RM trains `train_steps` AdamW steps on batches mixing its saved training pairs
   (`replay_share`, against forgetting) with every pair labelled so far in this run, with the loss
   terms it was trained with; its "fixed" normalization constants are measured again.

Metrics of a refresh step: `rm_refresh/labels` (judged this refresh), `rm_refresh/labels_total`,
`rm_refresh/pairs` (judged and not tied), and per RM `rm_refresh/NAME/pair_acc_before` (its accuracy on
the new pairs before training on them: the RM's accuracy on the current policy's own samples) and
`.../pair_acc_after`, `.../loss`. The labelled pairs are appended to the run's `rm_labels.jsonl`.
A checkpoint holds the refreshed RMs, the labelled pool and the pending rollouts (exact resume).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from grpolab.data.preferences import PrefPair
from grpolab.reward_models.model import load_train_pairs

STATE_DIR = "rm_refresh"
LABELS_FILE = "rm_labels.jsonl"


def select_pairs(groups: Sequence[dict], scores: Sequence[Sequence[float]], budget: int,
                 rng: random.Random) -> list[tuple[int, int, int]]:
    """Up to `budget` (group, i, j) pairs of DISTINCT completion texts, i = the group's highest-scored
    completion not yet paired with everything, j a random partner not yet paired with i.
    groups: [{"texts": [...]}, ...]; scores: the RM's score of each text of each group."""
    open_groups = [g for g, grp in enumerate(groups) if len(set(grp["texts"])) > 1]
    rng.shuffle(open_groups)
    used: set[tuple[int, str, str]] = set()
    out: list[tuple[int, int, int]] = []
    while open_groups and len(out) < budget:
        still = []
        for g in open_groups:
            if len(out) >= budget:
                break
            pair = _next_pair(groups[g]["texts"], scores[g], g, used, rng)
            if pair is not None:
                out.append((g, *pair))
                still.append(g)
        open_groups = still
    return out


def _next_pair(texts: Sequence[str], sc: Sequence[float], g: int, used: set, rng: random.Random):
    """The next pair of group g: its best-scored text that still has an unpaired partner, and one such
    partner at random; None when every pair of distinct texts of the group is used."""
    first = {}
    for i, t in enumerate(texts):
        first.setdefault(t, i)
    distinct = sorted(first.values(), key=lambda i: -sc[i])
    for i in distinct:
        partners = [j for j in distinct if j != i and (g, *sorted((texts[i], texts[j]))) not in used]
        if partners:
            j = rng.choice(partners)
            used.add((g, *sorted((texts[i], texts[j]))))
            return i, j
    return None


def judge(labeler, chosen_groups: Sequence[dict], picks: Sequence[tuple[int, int, int]]):
    """Calls the labeler once on the picked pairs' completions; returns (judged, pairs): how many pairs
    got a judgement (ties included) and the PrefPairs of those with a preference."""
    prompts, texts, metas = [], [], []
    for g, i, j in picks:
        grp = chosen_groups[g]
        for k in (i, j):
            prompts.append(grp["prompt"])
            texts.append(grp["texts"][k])
            metas.append(grp["metas"][k])
    if not texts:
        return 0, []
    raw = list(labeler(prompts, texts, metas))
    if len(raw) != len(texts):
        raise ValueError(f"rm_refresh.labeler {getattr(labeler, 'name', labeler)!r} returned {len(raw)} "
                         f"scores for {len(texts)} completions")
    vals = [math.nan if v is None else float(v) for v in raw]
    judged, pairs = 0, []
    for n, (g, i, j) in enumerate(picks):
        a, b = vals[2 * n], vals[2 * n + 1]
        if math.isnan(a) or math.isnan(b):
            continue
        judged += 1
        if a != b:
            grp = chosen_groups[g]
            hi, lo = (i, j) if a > b else (j, i)
            pairs.append(PrefPair(grp["prompt"], grp["texts"][hi], grp["texts"][lo]))
    return judged, pairs


def judge_within(labeler, groups: Sequence[dict], picks: Sequence[tuple[int, int, int]], budget: int):
    """`judge` on `picks` in order, chunk after chunk, until `budget` pairs are judged (a pair the
    labeler abstains on costs nothing) or the picks run out; returns (judged, pairs)."""
    judged, pairs, start = 0, [], 0
    while judged < budget and start < len(picks):
        chunk = picks[start : start + budget - judged]
        start += len(chunk)
        n, new = judge(labeler, groups, chunk)
        judged, pairs = judged + n, pairs + new
    return judged, pairs


def groups_of(record) -> list[dict]:
    """A StepRecord's groups as {"prompt", "texts", "metas"} (the metadata the rewards saw)."""
    G = record.group_size
    out = []
    for g, item in enumerate(record.items):
        rows = range(g * G, (g + 1) * G)
        out.append({"prompt": item.prompt, "texts": [record.texts[r] for r in rows],
                    "metas": [{**item.meta, "truncated": bool(record.truncated[r]),
                               "completion_tokens": int(record.lengths[r])} for r in rows]})
    return out


class RMRefresh:
    """The refresh of a run's reward models (module docstring). `targets`: {reward name: RewardModelReward}
    (members of an ensemble are named NAME/0, NAME/1, ...); `labeler`: a reward function."""

    def __init__(self, rc, targets: dict[str, Any], labeler, seed: int, run_dir: Path | None = None):
        if not targets:
            raise ValueError("rm_refresh: no reward_model reward to refresh among the run's rewards")
        self.rc, self.targets, self.labeler, self.seed = rc, targets, labeler, seed
        self.run_dir = run_dir
        self.replay = {name: load_train_pairs(rm.path) for name, rm in targets.items()}
        self.pool: list[PrefPair] = []
        self.pending: list[dict] = []
        self.labels_total = 0

    def after_step(self, step: int, record) -> dict:
        """Buffers the step's groups; on a refresh step labels and trains. Returns the metrics."""
        self.pending += groups_of(record)
        if (step + 1) % self.rc.every_steps:
            return {"rm_refresh/labels_total": self.labels_total}
        groups, self.pending = self.pending, []
        return {**self.refresh(step, groups), "rm_refresh/labels_total": self.labels_total}

    def refresh(self, step: int, groups: list[dict]) -> dict:
        rng = random.Random(f"{self.seed}:rm_refresh:{step}")
        share = self.rc.labels_per_refresh // len(self.targets)
        row: dict[str, float] = {}
        new_pairs: dict[str, list[PrefPair]] = {}
        judged_all = 0
        for name, rm in self.targets.items():
            sc = self._group_scores(rm, groups)
            judged, pairs = judge_within(self.labeler, groups, select_pairs(groups, sc, 4 * share, rng), share)
            judged_all += judged
            new_pairs[name] = pairs
        self.labels_total += judged_all
        fresh = [p for ps in new_pairs.values() for p in ps]
        self.pool += fresh
        self._log_labels(step, fresh)
        row.update({"rm_refresh/labels": judged_all, "rm_refresh/pairs": len(fresh)})
        for name, rm in self.targets.items():
            row.update(self._train(name, rm, new_pairs[name], rng))
        return row

    def _group_scores(self, rm, groups: list[dict]) -> list[list[float]]:
        texts = [t for g in groups for t in g["texts"]]
        prompts = [g["prompt"] for g in groups for _ in g["texts"]]
        flat = rm.scores(prompts, texts).tolist() if texts else []
        out, k = [], 0
        for g in groups:
            out.append(flat[k : k + len(g["texts"])])
            k += len(g["texts"])
        return out

    def _train(self, name: str, rm, new: list[PrefPair], rng: random.Random) -> dict:
        from grpolab.reward_models.training import evaluate_pairs, fit_calibration, score_stats, train_reward_pairs

        rc, key = self.rc, f"rm_refresh/{name}"
        row = {}
        if new:
            row[f"{key}/pair_acc_before"] = evaluate_pairs(rm.model, rm.tokenizer, new)[0]
        if not self.pool:
            return row
        replay = self.replay[name]
        n_replay = round(rc.batch_size * rc.replay_share) if replay else 0
        batches = [rng.sample(replay, min(n_replay, len(replay))) +
                   [self.pool[rng.randrange(len(self.pool))] for _ in range(rc.batch_size - n_replay)]
                   for _ in range(rc.train_steps)]
        losses = train_reward_pairs(rm.model, rm.tokenizer, batches, lr=rc.lr,
                                    lm_coef=float(rm.info.get("lm_coef", 0.0)),
                                    divergence_coef=float(rm.info.get("divergence_coef", 0.0)))
        row[f"{key}/loss"] = sum(losses) / len(losses)
        if new:
            row[f"{key}/pair_acc_after"] = evaluate_pairs(rm.model, rm.tokenizer, new)[0]
        recent = replay[-128:] + self.pool[-128:]
        if rm.normalize == "fixed":
            rm.mean, rm.std = score_stats(rm.model, rm.tokenizer, recent)
        elif rm.normalize == "calibrated":
            rm.calibration = torch.tensor(fit_calibration(rm.model, rm.tokenizer, recent), dtype=torch.float64)
        return row

    def _log_labels(self, step: int, pairs: list[PrefPair]) -> None:
        if self.run_dir is None or not pairs:
            return
        with open(self.run_dir / LABELS_FILE, "a") as f:
            for p in pairs:
                f.write(json.dumps({"step": step, **asdict(p)}) + "\n")

    def export(self, out: Path) -> dict[str, Path]:
        """Saves each refreshed RM as a reward-model folder out/NAME (its info with the refresh's
        normalization constants and label count; its training pairs plus the labelled ones);
        returns {name: folder}."""
        from grpolab.reward_models.model import save_reward_model

        paths = {}
        for name, rm in self.targets.items():
            calib = rm.info.get("calibration") if rm.calibration is None else rm.calibration.tolist()
            info = {**rm.info, "score_mean": rm.mean, "score_std": rm.std, "calibration": calib, "refreshed_from": rm.path,
                    "refresh_labels": self.labels_total}
            paths[name] = save_reward_model(rm.model, rm.tokenizer, out / name.replace("/", "_"), info=info,
                                            pairs=self.replay[name] + self.pool)
        return paths

    # ---- checkpoints: the refreshed weights, the labelled pool, the rollouts waiting for the next refresh
    def save(self, d: Path) -> None:
        from safetensors.torch import save_model

        out = d / STATE_DIR
        out.mkdir()
        for i, (name, rm) in enumerate(self.targets.items()):
            save_model(rm.model, str(out / f"rm{i}.safetensors"))
        state = {"names": list(self.targets), "labels_total": self.labels_total,
                 "norm": [[rm.mean, rm.std] for rm in self.targets.values()],
                 "calibration": [None if rm.calibration is None else rm.calibration.tolist() for rm in self.targets.values()],
                 "pool": [asdict(p) for p in self.pool], "pending": self.pending}
        (out / "state.json").write_text(json.dumps(state))

    def load(self, d: Path) -> None:
        from grpolab.rundir.checkpoint import CheckpointError, load_weights

        src = d / STATE_DIR
        if not (src / "state.json").is_file():
            raise CheckpointError(f"checkpoint {d} has no {STATE_DIR}/ but this config refreshes reward models "
                                  "(rm_refresh.every_steps > 0); was it saved without rm_refresh?")
        state = json.loads((src / "state.json").read_text())
        if state["names"] != list(self.targets):
            raise CheckpointError(f"checkpoint {d}: refreshed reward models {state['names']}, this run refreshes "
                                  f"{list(self.targets)}")
        for i, rm in enumerate(self.targets.values()):
            load_weights(rm.model, src / f"rm{i}.safetensors")
            rm.mean, rm.std = state["norm"][i]
            ab = state["calibration"][i]
            rm.calibration = None if ab is None else torch.tensor(ab, dtype=torch.float64)
        self.labels_total = int(state["labels_total"])
        self.pool = [PrefPair(**p) for p in state["pool"]]
        self.pending = state["pending"]


