"""`grpolab demo --agent`: a tiny chat model → SFT on scripted tool-use and guessing transcripts (π0) →
GRPO on each of two environments from that π0 → held-out evaluation; offline, on a CPU.

The tasks (app/demo_agent_data.py): the calculator task (multiply two 3-digit numbers; the model must
call the `calculator` tool, copy the operands into a well-formed call and the result into its answer)
and GuessNumber (a secret in [1, n], "higher" / "lower" replies: a multi-turn environment whose
replies depend on the moves). The folder holds pi0/ (the starting policy), one GRPO run directory per
task (config, metrics, samples with the transcripts, checkpoints, final/, eval.json, report.html) and
eval.json with π0's and the final policy's held-out figures of both.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

from grpolab import config as C
from grpolab.agents.agent import AgentSpec
from grpolab.app import demo_agent_data as data
from grpolab.config.io import override_strings
from grpolab.grpo.run import train_in_run_dir
from grpolab.grpo.setup import build_setup
from grpolab.parallel.launch import apply_threads
from grpolab.report.progress import Progress
from grpolab.rollout.hf import HFEngine
from grpolab.rundir.checkpoint import resolve_resume, step_of
from grpolab.rundir.rundir import claim, mark_finished, write_config, write_eval

AGENT_OVERRIDES = [
    "model.dtype=float32",  # the recipe as measured (auto would pick bf16 on CPUs with native bf16)
    "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.temperature=1.0",
    "train.epochs=1", "train.minibatch_size=64", "train.microbatch_size=32",
    "train.lr=3e-4", "train.lr_schedule=constant", "train.warmup_steps=0", "run.samples_every=5",
]
"""Both tasks' GRPO settings, on top of the grpo_no_kl preset."""
TASKS = {
    "calculator": (data.calculator_spec, ["train.steps=40"]),
    "guess": (data.guess_spec, ["train.steps=60", "train.lr=6e-4", "loss.std=none"]),
}
"""Task name -> (its AgentSpec, its own overrides). The guessing game's advantages are not divided by the
group's std (loss.std=none): once a group solves every game, only the turn cost tells its episodes
apart, and std-normalising those 0.05 steps into unit advantages makes the updates noise."""
QUICK_OVERRIDES = ["train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.minibatch_size=16",
                   "train.microbatch_size=16", "data.eval_prompts=16"]
"""--quick: a smoke run of the whole path (minutes, not a result)."""
QUICK_SFT = {"steps": 20}
HELDOUT = 200


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def agent_config(spec: AgentSpec, seed: int = 0, task_overrides: list[str] | None = None,
                 overrides: list[str] | None = None, quick: bool = False) -> C.Config:
    """The GRPO config of one task: the environment, tools and limits of `spec`, held-out seeds as the
    evaluation items, AGENT_OVERRIDES, the task's own, QUICK_OVERRIDES when quick, then `overrides`."""
    fields = {"environment.name": spec.environment, "environment.kwargs": dict(spec.environment_kwargs),
              "rollout.tools": list(spec.tools), "rollout.max_turns": spec.max_turns,
              "rollout.max_episode_tokens": spec.max_episode_tokens, "rollout.max_new_tokens": spec.max_turn_tokens,
              "data.source": "builtin:seeds", "data.eval_prompts": HELDOUT, "rewards": [], "train.seed": seed}
    ov = AGENT_OVERRIDES + list(task_overrides or []) + (QUICK_OVERRIDES if quick else []) + list(overrides or [])
    return C.from_preset("grpo_no_kl", override_strings(fields) + ov)


def evaluate(model, tok, cfg: C.Config) -> dict:
    """Held-out episodes (seeds 0 .. data.eval_prompts-1) of cfg's environment and tools: greedy
    metrics, and under "sampled" one episode per item sampled at rollout.temperature (the policy as
    it acts in training; greedy turns hide a behaviour that π0 samples only sometimes)."""
    from grpolab.evaluation.episodes import evaluate_agent

    r = cfg.rollout
    engine = HFEngine(tok, r.max_new_tokens, r.temperature, r.top_p, r.top_k, compute_dtype=torch.float32)
    items = data.heldout_items(cfg.data.builtin_eval_prompts)
    with AgentSpec.from_config(cfg).build() as agent:
        greedy = evaluate_agent(engine, agent, items, model=model)
        sampled = evaluate_agent(engine, agent, items, model=model, greedy=False, seed=cfg.train.seed)
    return {**greedy, "sampled": sampled}


def run_task(name: str, pi0, tok, cfg: C.Config, run_dir: Path, resume: bool) -> dict:
    """GRPO on one task from a copy of π0 in run_dir; returns {"pi0": ..., "final": ...} held-out metrics."""
    run_dir = claim(run_dir, "demo", resume=resume, say=_say)
    write_config(cfg, run_dir)
    resume_from = resolve_resume("auto", run_dir, say=_say, checkpoint_every=cfg.run.checkpoint_every) if resume else None
    policy = copy.deepcopy(pi0).train()
    before = evaluate(pi0, tok, cfg)
    _say(f"[{name}] π0: {summary(before)}")
    start = min(step_of(resume_from), cfg.train.steps) if resume_from is not None else 0
    setup = build_setup(cfg, policy=policy, tokenizer=tok,
                        progress=Progress(cfg.train.steps, enabled=cfg.run.progress, start_step=start))
    code = train_in_run_dir(setup, run_dir, resume_from, resume_hint="the same command plus --resume --out DIR")
    if code != 0:
        raise SystemExit(code)
    after = evaluate(policy, tok, cfg)
    _say(f"[{name}] final: {summary(after)}")
    write_eval(run_dir, {"pi0": before, "final": after, "seed": cfg.train.seed})
    mark_finished(run_dir)
    return {"pi0": before, "final": after}


def summary(m: dict) -> str:
    def one(x: dict) -> str:
        turns = x["turns_to_solve/mean"]
        return (f"solved {x['solved']:.3f}, turns to solve {'-' if turns is None else f'{turns:.2f}'}, tool calls "
                f"{x['tool_calls/mean']:.2f}/episode ({x['tool_calls/well_formed']:.3f} well-formed)")

    return f"greedy: {one(m)}; sampled: {one(m['sampled'])}"


def run_agent_demo(seed: int = 0, quick: bool = False, out: str = "", overrides: list[str] | None = None,
                   report: bool = True, resume: bool = False, overwrite: bool = False,
                   tasks: tuple[str, ...] = tuple(TASKS)) -> dict:
    """The whole agent demo (module docstring); returns the top eval.json payload."""
    if resume and not out:
        raise C.ConfigError("demo --agent --resume needs the demo's folder: add --out DIR")
    configs = {t: agent_config(TASKS[t][0](), seed, TASKS[t][1], overrides, quick) for t in tasks}  # checked first
    apply_threads(configs[tasks[0]])  # run.threads
    root = claim(Path(out) if out else Path("runs") / f"demo-agent-{time.strftime('%Y%m%d-%H%M%S')}", "demo",
                 resume=resume, overwrite=overwrite, say=_say)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    pi0, tok = build_or_load_pi0(root / "pi0", seed, reuse=resume, sft=QUICK_SFT if quick else None)
    results = {t: run_task(t, pi0, tok, configs[t], root / t, resume) for t in tasks}
    payload = {"seed": seed, "tasks": results, "wall_s": time.perf_counter() - t0}
    write_eval(root, payload)
    mark_finished(root)
    print(format_table(results))
    if report:
        from grpolab.report.html import write_report

        for t in tasks:
            print(f"report: {write_report(root / t)}")
    print(f"run directory: {root}")
    return payload


def build_or_load_pi0(path: Path, seed: int, reuse: bool, sft: dict | None = None):
    """π0 (`demo_agent_data.build_agent_pi0`, its SFT settings updated by `sft`), saved to `path`;
    reuse: loaded from there when it is."""
    if reuse and (path / "model.safetensors").is_file():
        from grpolab.models.loading import load_model

        _say(f"[demo] π0 from {path}")
        return load_model(str(path), dtype="float32")
    model, tok = data.build_agent_pi0(seed, sft_kwargs=sft, say=_say)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


TABLE_KEYS = ("solved", "turns_to_solve/mean", "tool_calls/mean", "tool_calls/well_formed")


def format_table(results: dict) -> str:
    """π0's and the final policy's held-out metrics per task, greedy and sampled."""
    rows = []
    for task, r in results.items():
        for mode in ("greedy", "sampled"):
            before, after = (r[w] if mode == "greedy" else r[w]["sampled"] for w in ("pi0", "final"))
            rows += [(f"{task} {mode} {k}", before[k], after[k]) for k in TABLE_KEYS
                     if before[k] is not None and after[k] is not None]
    width = max([len("held-out metric")] + [len(name) for name, _, _ in rows]) + 2
    lines = [f"{'held-out metric':<{width}}{'π0':>8}{'final':>8}"]
    lines += [f"{name:<{width}}{a:>8.3f}{b:>8.3f}" for name, a, b in rows]
    return "\n".join(lines)
