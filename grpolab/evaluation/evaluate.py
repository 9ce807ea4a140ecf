"""Held-out evaluation: greedy (or sampled) completions scored with the exact rule checks."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from grpolab.rewards.rules import is_correct, is_refusal
from grpolab.rundir.rundir import model_folder
from grpolab.rollout.hf import HFEngine, decode_completions, generate_texts


def evaluate_arith(model, engine: HFEngine, items, greedy: bool = True, generator=None) -> dict:
    """accuracy: share of answerable prompts answered correctly; refusal_recall: share of
    unanswerable prompts refused; false_refusal: share of answerable prompts refused.
    A completion that did not end with EOS counts as wrong (and as no refusal)."""
    texts, trunc = generate_texts(model, engine, [it.prompt for it in items], greedy=greedy, generator=generator)
    ans = [(t, tr, it) for t, tr, it in zip(texts, trunc, items) if it.meta["answerable"]]
    una = [(t, tr, it) for t, tr, it in zip(texts, trunc, items) if not it.meta["answerable"]]
    acc = sum(1 for t, tr, it in ans if not tr and is_correct(t, it.meta)) / max(len(ans), 1)
    rec = sum(1 for t, tr, it in una if not tr and is_refusal(t)) / max(len(una), 1)
    fr = sum(1 for t, tr, it in ans if not tr and is_refusal(t)) / max(len(ans), 1)
    by_op: dict[str, list[int]] = {}
    for t, tr, it in ans:
        by_op.setdefault(it.meta["op"], []).append(int(not tr and is_correct(t, it.meta)))
    by_kind: dict[str, list[int]] = {}
    for t, tr, it in una:
        by_kind.setdefault(it.meta["kind"], []).append(int(not tr and is_refusal(t)))
    return {
        "accuracy": acc, "refusal_recall": rec, "false_refusal": fr,
        "refusal_recall_by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "answerable": len(ans), "unanswerable": len(una),
        "accuracy_by_op": {op: sum(v) / len(v) for op, v in sorted(by_op.items())},
        "examples": [{"prompt": it.prompt, "completion": t} for t, _, it in list(zip(texts, trunc, items))[:12]],
    }


def evaluate_task(model, engine: HFEngine, items, rewards, samples: int = 0, generator=None,
                  group_by: tuple[str, ...] = ()) -> dict:
    """Held-out evaluation of any task by its config's rewards: `rewards` is [(RewardFn, weight)].

    greedy: each reward's mean over the rows it scored, the weighted sum's mean, and `accuracy` (the
    1.0 rate of the first verifier reward that scored a row). With samples = k > 0 also, over k
    completions per prompt sampled at the engine's temperature: the mean reward, pass@1 (mean
    accuracy) and pass@k (share of prompts with at least one correct completion). group_by: metadata
    fields; `by[FIELD][VALUE]` holds the same metrics over the prompts of each value (eval.group_by).
    `completions`: one record per prompt (its metadata, greedy completion, scores, reward, and its
    samples), what completions.jsonl holds.
    """
    from grpolab.rewards.base import combine, score_batch
    from grpolab.rewards.registry import is_verifier
    from grpolab.algo.metrics import correct_rows

    prompts = [it.prompt for it in items]
    verifiers = [fn.name for fn, _ in rewards if is_verifier(fn)]
    encode = engine.tokenizer.encode

    def score(texts, trunc, reps):
        metas = [{**items[i // reps].meta, "truncated": tr, "completion_ids": encode(t, add_special_tokens=False)}
                 for i, (t, tr) in enumerate(zip(texts, trunc))]
        rows = [p for p in prompts for _ in range(reps)]
        scores = {fn.name: score_batch(fn, rows, texts, metas) for fn, _ in rewards}
        return Scored(texts, trunc, reps, scores, combine(scores, {fn.name: w for fn, w in rewards}),
                      correct_rows(scores, verifiers))

    texts, trunc = generate_texts(model, engine, prompts, greedy=True)
    greedy, sampled = score(texts, trunc, 1), None
    if samples > 0:
        stexts, strunc = [], []
        for s in range(0, len(prompts), 64):
            ro = engine.generate_with(model, prompts[s:s + 64], samples, generator=generator)
            stexts += decode_completions(engine.tokenizer, ro)
            strunc += ro.truncated.tolist()
        sampled = score(stexts, strunc, samples)
    out = {"prompts": len(items), **_summary(greedy, sampled, list(range(len(items))))}
    if group_by:
        out["by"] = {f: {v: {"prompts": len(idx), **_summary(greedy, sampled, idx)} for v, idx in groups.items()}
                     for f, groups in group_rows(items, group_by).items()}
    out["examples"] = [{"prompt": p, "completion": t} for p, t in list(zip(prompts, texts))[:12]]
    out["completions"] = completion_records(items, greedy, sampled)
    return out


@dataclass(frozen=True)
class Scored:
    """Completions of the held-out prompts, `reps` per prompt, with their scores ([N] tensors each)."""

    texts: list
    truncated: list
    reps: int
    scores: dict
    total: torch.Tensor
    correct: torch.Tensor | None

    def rows(self, idx: list[int]) -> list[int]:
        """The rows of prompts `idx`."""
        return [i * self.reps + j for i in idx for j in range(self.reps)]


def _summary(greedy: Scored, sampled: Scored | None, idx: list[int]) -> dict:
    """The metrics of `evaluate_task` over the prompts `idx`."""
    from grpolab.algo.metrics import nanmean

    g = torch.tensor(idx, dtype=torch.long)
    out = {"greedy": {"reward": nanmean(greedy.total[g]), **{f"reward/{k}": nanmean(v[g])
                                                             for k, v in greedy.scores.items()}}}
    if greedy.correct is not None:
        out["greedy"]["accuracy"] = nanmean(greedy.correct[g])
    if sampled is not None:
        k = sampled.reps
        out["sampled"] = {"samples": k, "reward": nanmean(sampled.total[torch.tensor(sampled.rows(idx))])}
        if sampled.correct is not None:
            c = sampled.correct.view(-1, k)[g]
            hit, scored = c == 1.0, ~torch.isnan(c).all(-1)
            out["sampled"]["pass@1"] = float(hit[scored].float().mean()) if scored.any() else float("nan")
            out["sampled"][f"pass@{k}"] = float(hit[scored].any(-1).float().mean()) if scored.any() else float("nan")
    return out


def group_rows(items, fields: tuple[str, ...]) -> dict[str, dict[str, list[int]]]:
    """{field: {value: [prompt index]}} in first-seen order (a row without the field: "null"); a
    ConfigError naming eval.group_by when no row has a field."""
    from grpolab.config import ConfigError

    out = {}
    for f in fields:
        if not any(f in it.meta for it in items):
            have = sorted({k for it in items for k in it.meta})
            raise ConfigError(f"eval.group_by: no held-out row has the field {f!r}; their fields: "
                              f"{', '.join(have) or 'none'}")
        groups: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            v = it.meta.get(f)
            groups.setdefault(v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str), []).append(i)
        out[f] = groups
    return out


def _float(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if math.isnan(v) else v


def completion_records(items, greedy: Scored, sampled: Scored | None) -> list[dict]:
    """One JSON-ready record per held-out prompt: prompt, metadata, the greedy completion with each
    reward's score (None: abstained), the weighted reward and `correct`, then its samples likewise."""
    def scored(sc: Scored, r: int) -> dict:
        rec = {"completion": sc.texts[r], "truncated": bool(sc.truncated[r]),
               "scores": {k: _float(v[r]) for k, v in sc.scores.items()}, "reward": _float(sc.total[r])}
        if sc.correct is not None:
            rec["correct"] = _float(sc.correct[r])
        return rec

    out = []
    for i, it in enumerate(items):
        rec = {"prompt": it.prompt, "meta": it.meta, **scored(greedy, i)}
        if sampled is not None:
            rec["samples"] = [scored(sampled, r) for r in sampled.rows([i])]
        out.append(rec)
    return out


def write_completions(path, records: list[dict], append: bool = False, **extra) -> None:
    """Writes (or appends) `records` to the JSONL file at `path`, each with the `extra` fields first
    (e.g. model="final")."""
    with open(path, "a" if append else "w") as f:
        for rec in records:
            f.write(json.dumps({**extra, **rec}, default=str) + "\n")


def eval_items(cfg, tokenizer) -> list:
    """The held-out prompts: data.eval_source (every row, or its first data.eval_prompts), or builtin:arith's split, or
    builtin:seeds' held-out seeds."""
    from grpolab.config import ConfigError
    from grpolab.data.build import arith_eval_items, capped, prompt_stream

    if cfg.data.eval_source:
        stream = prompt_stream(cfg.replace(**{"data.source": cfg.data.eval_source}), tokenizer)
        return capped(list(stream.items), cfg.data.eval_prompts, "data.eval_prompts")
    if cfg.data.source == "builtin:arith":
        return arith_eval_items(cfg)
    if cfg.data.source == "builtin:seeds":
        from grpolab.data.stream import held_out_seeds

        return held_out_seeds(cfg.data.builtin_eval_prompts)
    raise ConfigError(f"data.eval_source: the held-out prompts of data.source={cfg.data.source!r} are needed for "
                      "grpolab eval (e.g. data.eval_source=jsonl:heldout.jsonl); training prompts are not held out")


def evaluate_model(model_path, cfg, samples: int = 0, best_of: int = 0) -> dict:
    """`grpolab eval`: the model at `model_path` (an HF folder or a run directory) by `evaluate_policy`."""
    from grpolab.models.loading import load_model

    model, tok = load_model(model_folder(model_path), device=cfg.model.device)
    return evaluate_policy(model, tok, cfg, samples, best_of=best_of)


def evaluate_policy(model, tokenizer, cfg, samples: int = 0, items=None, best_of: int = 0) -> dict:
    """A policy on cfg's held-out prompts (`eval_items`, or `items`), scored by cfg's rewards
    (`evaluate_task`), generating as training does (rollout.* sampling, model.dtype compute dtype,
    sampling seeded by train.seed; an agent run: `evaluate_episodes`); for the built-in task's own split also its refusal metrics
    (`evaluate_arith`, under "arith"). best_of = n > 0: also greedy vs best-of-n by the model's own
    sequence likelihood (`evaluation.best_of_n.best_of_n_eval`, under "best_of_n"). What `grpolab eval`, the
    demo and bench/real_model.py report."""
    from grpolab.rewards.registry import build_rewards
    from grpolab.models.loading import resolve_compute_dtype

    items = eval_items(cfg, tokenizer) if items is None else items
    r = cfg.rollout
    engine = HFEngine(tokenizer, r.max_new_tokens, r.temperature, r.top_p, r.top_k,
                      compute_dtype=resolve_compute_dtype(cfg.model.dtype, cfg.model.device))
    if cfg.episodes:
        return evaluate_episodes(model, engine, items, cfg, samples)
    gen = torch.Generator(device=cfg.model.device).manual_seed(cfg.train.seed)
    rewards = build_rewards(cfg)
    res = evaluate_task(model, engine, items, rewards, samples=samples, generator=gen, group_by=cfg.eval.group_fields)
    arith = cfg.data.source == "builtin:arith" and not cfg.data.eval_source
    if arith:
        res["arith"] = {k: v for k, v in evaluate_arith(model, engine, items).items() if k != "examples"}
    if best_of > 0:
        from grpolab.evaluation.best_of_n import best_of_n_eval

        res["best_of_n"] = best_of_n_eval(model, engine, items, rewards, best_of, gen, arith=arith)
    return res


def evaluate_episodes(model, engine: HFEngine, items, cfg, samples: int = 0) -> dict:
    """An agent run's held-out evaluation (cfg.episodes: an environment or tools): the episodes of
    `items` under cfg's environment, tools and limits, greedy, and with samples = k > 0 also k sampled
    episodes per item (seeded by train.seed). Each part: `evaluation.episodes.episode_metrics` and each
    episode scored as training scores it: "reward/NAME" per reward function (the environment's reward
    is "reward/environment") and "reward", their weighted sum (the mean over episodes). Without an
    environment, "solved" is the share of episodes the first verifier reward scored 1.0, "accuracy"
    that rate over the episodes it scored (neither without a verifier). "completions": one record per
    item (the prompt as the policy saw it, its transcript, counts and scores, then its samples)."""
    from grpolab.agents.agent import AgentSpec, episode_item
    from grpolab.agents.episode import EnvironmentReward
    from grpolab.evaluation.episodes import run_agent_episodes
    from grpolab.rewards.registry import build_rewards

    rows = [episode_item(it) for it in items]
    rewards = build_rewards(cfg) + ([(EnvironmentReward(), cfg.environment.reward_weight)]
                                    if cfg.environment.name else [])
    with AgentSpec.from_config(cfg).build() as agent:
        parts = {"greedy": (run_agent_episodes(engine, agent, rows, model=model), 1)}
        if samples > 0:
            parts["sampled"] = (run_agent_episodes(engine, agent, rows, model=model, greedy=False, seed=cfg.train.seed,
                                                   samples_per_item=samples), samples)
    out: dict = {"prompts": len(rows)}
    records = [{"prompt": it.prompt, "meta": it.meta} for it in items]
    for part, (episodes, reps) in parts.items():
        metrics, recs = _scored_episodes(episodes, [it.meta for it in items for _ in range(reps)], rewards, cfg,
                                         engine.tokenizer.decode)
        out[part] = {**({"samples": reps} if part == "sampled" else {}), **metrics}
        for r, (e, rec) in enumerate(zip(episodes, recs)):
            if part == "greedy":
                records[r].update(rec, prompt=engine.tokenizer.decode(e.prompt_ids))  # as the policy saw it
            else:
                records[r // reps].setdefault("samples", []).append(rec)
    out["completions"] = records
    return out


def _scored_episodes(episodes, metas, rewards, cfg, decode) -> tuple[dict, list[dict]]:
    """(the metrics of `evaluate_episodes` for one part, one completions record per episode)."""
    from grpolab.algo.metrics import correct_rows, nanmean
    from grpolab.evaluation.episodes import episode_metrics, score_episodes
    from grpolab.rewards.registry import is_verifier

    scores, total = score_episodes(episodes, metas, rewards, decode, cfg.rollout.max_new_tokens) if rewards \
        else ({}, torch.full((len(episodes),), math.nan))
    correct = None if cfg.environment.name else correct_rows(scores, [fn.name for fn, _ in rewards if is_verifier(fn)])
    m = episode_metrics(episodes, None if correct is None else (correct == 1.0).tolist())
    del m["reward/mean"]  # the environment's reward is reward/environment
    if correct is not None:
        m["accuracy"] = nanmean(correct)
    elif not cfg.environment.name:  # nothing tells a solved episode
        for key in ("solved", "accuracy", "turns_to_solve/mean"):
            del m[key]
    if rewards:
        m.update({"reward": nanmean(total), **{f"reward/{k}": nanmean(v) for k, v in scores.items()}})
    recs = [_episode_record(e, {k: _float(v[r]) for k, v in scores.items()}, _float(total[r]),
                            None if correct is None else _float(correct[r])) for r, e in enumerate(episodes)]
    return m, recs


def _episode_record(e, scores: dict, reward: float | None, correct: float | None) -> dict:
    """An episode as completions.jsonl keeps it: its last reply, transcript, counts and scores."""
    from grpolab.agents.episode import last_reply

    return {"completion": last_reply(e), "messages": [dict(m) for m in e.messages], "turns": e.turns,
            "tool_calls": e.tool_calls, "tool_errors": dict(e.tool_errors), "stop_reason": e.stop_reason,
            "truncated": e.truncated, "env_reward": e.reward, "scores": scores, "reward": reward, "correct": correct}


def format_eval(res: dict) -> str:
    """The float metrics of an `evaluate_policy` result as a two-column table (per group too: `by`)."""
    rows = [(part, k, v) for part in ("greedy", "sampled") for k, v in res.get(part, {}).items()]
    bo = res.get("best_of_n", {})
    rows += [(f"bo{bo['n']}:{part}", k, v) for part in ("greedy", "best_of_n", "sampled")
             for k, v in bo.get(part, {}).items()]
    rows += [(f"{field}={value} {part}", k, v) for field, groups in res.get("by", {}).items()
             for value, m in groups.items() for part in ("greedy", "sampled") for k, v in m.get(part, {}).items()]
    return "\n".join(f"{part:<18} {k:<28} {v:.4f}" for part, k, v in rows if isinstance(v, float))
