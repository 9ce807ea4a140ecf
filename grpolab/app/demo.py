"""`grpolab demo`: build a tiny model → SFT to π0 → GRPO → held-out evaluation, all offline on a CPU.

Everything is seeded; the held-out evaluation prompts are facts the task's hashed split keeps out
of both SFT and GRPO (see grpolab/data/arith.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from grpolab import config as C
from grpolab.data.build import arith_eval_items, arith_task
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model, count_params
from grpolab.report.progress import Progress
from grpolab.evaluation.evaluate import evaluate_policy
from grpolab.rundir.checkpoint import resolve_resume, step_of
from grpolab.rundir.rundir import make_run_dir, write_config, write_eval
from grpolab.grpo.run import train_in_run_dir
from grpolab.rundir.rundir import mark_finished
from grpolab.grpo.setup import build_setup
from grpolab.sft.sft import sft_builtin

# The demo's settings on top of the grpo_no_kl preset (a KL term can be added with loss.kl_coef=...).
DEMO_OVERRIDES = [
    "model.hidden_size=128", "model.num_layers=4", "model.num_heads=4",
    "model.dtype=float32",  # the recipe as measured (auto would pick bf16 on CPUs with native bf16)
    "rollout.prompts_per_step=32", "rollout.group_size=8", "rollout.max_new_tokens=8",
    "train.steps=400", "train.epochs=2", "train.minibatch_size=128", "train.microbatch_size=128",
    "train.lr=1e-4", "train.lr_schedule=cosine", "train.warmup_steps=10", "sft.steps=1500", "sft.batch_size=64", "sft.microbatch_size=64", "sft.lr=1e-3",
    "sft.examples=40000", "sft.refusal_examples=200", "sft.refusal_kinds=[missing_operand]",
    "sft.stop_at_accuracy=0.35", "sft.probe_every=10",
    "data.eval_prompts=256", "data.arith_unanswerable_share=0.4",
    "rewards=[exact_match:1.0, refusal:1.0]",
]
QUICK_OVERRIDES = ["train.steps=120"]
OUTCOME_RM_OVERRIDES = [
    "loss.kl_coef=0.1",
    "rm_refresh.every_steps=5", "rm_refresh.rewards=[accuracy_rm]", "rm_refresh.labeler=exact_match",
    "rm_refresh.labels_per_refresh=256", "rm_refresh.train_steps=16", "rm_refresh.batch_size=64",
    "rm_refresh.lr=3e-4", "rm_refresh.replay_share=0.5",
]
"""With an outcome (or ensemble) accuracy RM: a KL penalty to π0 (β = 0.1) and the accuracy RM
refreshed every 5 steps on 256 judged pairs of the policy's own completions, judged by the answer
check (rm_refresh.every_steps=0 turns it off)."""
GOLD = [{"name": "exact_match", "weight": 0.0}, {"name": "refusal", "weight": 0.0}]
"""With --rewards rm: the rule checks, logged beside the RMs as the gold reward (weight 0: never trained on)."""


def demo_config(quick: bool = False, seed: int = 0, overrides: list[str] | None = None,
                rewards: str = "rules", accuracy_rm: str = "process") -> C.Config:
    """The demo's config; rewards="rm" with an outcome or ensemble accuracy RM adds OUTCOME_RM_OVERRIDES
    (a process RM is labelled per step: rm_refresh trains pairwise RMs)."""
    rm = OUTCOME_RM_OVERRIDES if rewards == "rm" and accuracy_rm != "process" else []
    ov = DEMO_OVERRIDES + rm + (QUICK_OVERRIDES if quick else []) + [f"train.seed={seed}"] + list(overrides or [])
    return C.from_preset("grpo_no_kl", ov)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


RMS_FILE = "demo_rms.json"
"""reward_models/demo_rms.json: the trained RMs' paths and held-out accuracies, read back by --resume."""


def build_pi0(cfg: C.Config, run_dir: Path, reuse: bool = False):
    """Tiny model + tokenizer, SFT'd briefly on the task's training side (few refusal examples);
    reuse: load the π0 that run_dir/pi0 holds instead (a resumed demo)."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=cfg.model.hidden_size, num_layers=cfg.model.num_layers,
                             num_heads=cfg.model.num_heads, seed=cfg.train.seed)
    task = arith_task(cfg)
    _say(f"[demo] model: {count_params(model) / 1e6:.2f}M params")
    if reuse:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(run_dir / "pi0" / "model.safetensors"), strict=False)
        model.tie_weights()
        _say(f"[demo] π0 from {run_dir / 'pi0'}")
        return model, tok, task
    sft_builtin(model, tok, task, cfg, say=_say)
    model.save_pretrained(run_dir / "pi0")
    tok.save_pretrained(run_dir / "pi0")
    return model, tok, task


def with_reward_models(cfg: C.Config, task, tok, run_dir: Path, policy=None, w_acc: float = 1.0, w_ref: float = 1.0,
                       rm_options: dict | None = None, reuse: bool = False):
    """Trains the accuracy and refusal reward models and puts them in the config as the
    GRPO rewards: reward = w_acc·RM_acc + w_ref·RM_ref, each RM a learned verifier: 1 when its
    calibrated probability that the completion is right (a logistic fit on its own training pairs)
    exceeds 1/2, else 0, so that a group it judges all wrong gives no advantage, as a rule check's
    would; the rule checks follow at weight 0 (GOLD). policy (π0): half of the accuracy RM's training
    pairs reject its own sampled mistakes. rm_options: keyword arguments of build_demo_reward_models
    (e.g. steps; accuracy: "process" unless given). reuse: the RMs that run_dir holds (RMS_FILE), if
    it holds them. Returns (config, {name: held-out pair accuracy})."""
    from grpolab.app.demo_reward_models import build_demo_reward_models

    record = run_dir / "reward_models" / RMS_FILE
    if reuse and record.is_file():
        _say(f"[demo] the accuracy and refusal reward models of {record.parent}")
        rms = json.loads(record.read_text())
    else:
        _say("[demo] training the accuracy and refusal reward models")
        rms = build_demo_reward_models(task, tok, run_dir / "reward_models", seed=cfg.train.seed, policy=policy,
                                       progress=_say, **{"accuracy": "process", **(rm_options or {})})
        record.write_text(json.dumps(rms, indent=2, default=str))
    weights = {"accuracy_rm": w_acc, "refusal_rm": w_ref}
    judge = {"normalize": "calibrated", "threshold": 0.5}  # each RM a learned verifier (see RewardModelReward)
    specs = [{"name": "reward_model", "label": name, "weight": weights[name],
              "kwargs": {"path": str(info["path"]), **judge}} for name, info in rms.items()]
    if "paths" in rms["accuracy_rm"]:  # an ensemble: the least convinced member counts (Coste et al. 2023's WCO)
        specs[0] = {"name": "reward_model_ensemble", "label": "accuracy_rm", "weight": w_acc,
                    "kwargs": {"paths": rms["accuracy_rm"]["paths"], "mode": "min", "normalize": "calibrated"}}
    return cfg.replace(rewards=specs + GOLD), {name: info["heldout_accuracy"] for name, info in rms.items()}


def rm_policy_accuracy(setup, policy, tok, items, cfg) -> dict[str, float]:
    """Each trained-on RM's pair accuracy on the policy's own samples of the held-out prompts, against
    its gold (accuracy RM: the answer check; refusal RM: the refusal check), the RMs as they are now."""
    from grpolab.rewards.rules import ExactMatch, Refusal
    from grpolab.evaluation.reward_models import policy_pair_accuracy

    rms = {fn.name: fn for fn, w in setup.data.rewards if w and fn.name in ("accuracy_rm", "refusal_rm")}
    gold = {"accuracy_rm": ExactMatch(), "refusal_rm": Refusal()}
    return policy_pair_accuracy(rms, gold, policy, tok, items, group_size=cfg.rollout.group_size,
                                max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.train.seed)


def refreshed_heldout(setup, task, seed: int) -> dict[str, float]:
    """Held-out pair accuracy of the RMs rm_refresh trained on (the same held-out pairs as before)."""
    from grpolab.reward_models.training import evaluate_pairs
    from grpolab.app.demo_reward_models import heldout_pairs

    if setup.services.rm_refresh is None:
        return {}
    return {name: evaluate_pairs(rm.model, rm.tokenizer, heldout_pairs(task, name, seed))[0]
            for name, rm in setup.services.rm_refresh.targets.items()}


def run_demo(cfg: C.Config, run_dir: Path | None = None, report: bool = True, rewards: str = "rules",
             overwrite: bool = False, rm_options: dict | None = None, resume: bool = False) -> dict:
    """Runs the whole demo; returns the eval.json payload. rewards: rules (exact match + refusal
    checks) or rm (two learned reward models, trained first with `rm_options`, the rule checks
    logged beside them as the gold); evaluation always uses the exact rule checks. resume: continue
    the demo in cfg.run.out_dir from its last GRPO checkpoint (π0 and the RMs as saved there; from
    the start where none was saved yet), to the same result as an uninterrupted run."""
    if resume and not (run_dir or cfg.run.out_dir):
        raise C.ConfigError("demo --resume needs the demo's folder: add --out DIR")
    eval_items = arith_eval_items(cfg)  # fails here, before any training, if the held-out side is too small
    torch.manual_seed(cfg.train.seed)
    run_dir = run_dir or make_run_dir(cfg, "demo", command="demo", overwrite=overwrite, resume=resume)
    resume_from = resolve_resume("auto", run_dir, say=_say, checkpoint_every=cfg.run.checkpoint_every) if resume else None
    write_config(cfg, run_dir)
    t0 = time.perf_counter()
    model, tok, task = build_pi0(cfg, run_dir, reuse=resume_from is not None)
    rm_acc = {}
    if rewards == "rm":
        cfg, rm_acc = with_reward_models(cfg, task, tok, run_dir, policy=model, rm_options=rm_options,
                                         reuse=resume_from is not None)
        write_config(cfg, run_dir)
    pi0_eval = evaluate_policy(model, tok, cfg, items=eval_items)  # what `grpolab eval` reports
    before = pi0_eval["arith"]
    _say(f"[eval] π0: accuracy {before['accuracy']:.3f} refusal_recall {before['refusal_recall']:.3f} "
         f"false_refusal {before['false_refusal']:.3f}")
    start = min(step_of(resume_from), cfg.train.steps) if resume_from is not None else 0
    progress = Progress(cfg.train.steps, enabled=cfg.run.progress, start_step=start)
    setup = build_setup(cfg, policy=model, tokenizer=tok, progress=progress)
    rm_on_policy = {"pi0": rm_policy_accuracy(setup, model, tok, eval_items, cfg)} if rm_acc else {}
    code = train_in_run_dir(setup, run_dir, resume_from,  # metrics, samples, checkpoints, final/
                            resume_hint=f"the same command plus --resume --out {run_dir}")
    if code != 0:
        raise SystemExit(code)
    final_eval = evaluate_policy(model, tok, cfg, items=eval_items)
    after = final_eval["arith"]
    payload = {
        "before": before, "after": after,
        "by_rewards": {"pi0": pi0_eval["greedy"], "final": final_eval["greedy"]},  # the training rewards, greedy
        "rewards": [{"name": s.display_name, "weight": s.weight} for s in cfg.rewards if s.weight],
        "gold": [s.display_name for s in cfg.rewards if not s.weight],  # logged beside, never trained on
        "reward_models": rm_acc,
        "eval_prompts": len(eval_items), "seed": cfg.train.seed,
        "wall_s": time.perf_counter() - t0,
    }
    if rm_acc:
        rm_on_policy["final"] = rm_policy_accuracy(setup, model, tok, eval_items, cfg)
        payload.update(rm_pair_accuracy_on_policy=rm_on_policy,
                       reward_models_after=refreshed_heldout(setup, task, cfg.train.seed))
    write_eval(run_dir, payload)
    mark_finished(run_dir)
    print(format_table(before, after))
    if report:
        from grpolab.report.html import write_report

        print(f"report: {write_report(run_dir)}")
    print(f"run directory: {run_dir}")
    return payload


def format_table(before: dict, after: dict) -> str:
    lines = [f"{'held-out metric':<18}{'π0':>8}{'final':>8}{'change':>9}"]
    for k in ("accuracy", "refusal_recall", "false_refusal"):
        lines.append(f"{k:<18}{before[k]:>8.3f}{after[k]:>8.3f}{after[k] - before[k]:>+9.3f}")
    return "\n".join(lines)

