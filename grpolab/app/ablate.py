"""`grpolab ablate`: the spectrum from on-policy SFT to GRPO (and its relatives), run side by side.

Each variant trains on the built-in task from the same π0 with the same budget of generated
completions, over several seeds, and is evaluated greedily on the same held-out prompts:

- π0, one per seed: the demo's tiny model SFT'd to partial competence (`demo.build_pi0`), built once
  in OUT/pi0-seedS/pi0/ and loaded from there by every variant of that seed (never rebuilt);
- a variant is a preset (its own loss, advantage, epochs and minibatches: what makes it that
  preset; a preset's minibatch count per epoch is kept when the step's size changes) with the
  ablation's shared sizes: P prompts × G completions, max_new_tokens, steps, one constant lr;
  plus `rl_sharpening` (the grpo preset rewarded by log π0(y|x); exact_match at weight 0 only
  logs accuracy) and `sft_sharpening` (best-of-G by log π0(y|x) on P × steps training prompts,
  then SFT on the winners: `sft.sharpen.sharpen_sft`);
- the budget: every variant generates P × G × steps completions. DAPO's dynamic sampling draws
  extra batches, so its run stops after the step where its count reaches the budget (fewer
  optimizer steps: the price of the extra samples), overshooting by at most that step's batches;
- the reward has three levels (`three_level_reward`): +1 correct (the answer, or the refusal
  "cannot" on an unanswerable prompt), −1 a wrong answer, −2 no answer (truncated, malformed, or
  the refusal of an answerable prompt). It must be negative somewhere: with a reward that never is,
  ReLU(r) = r and on-policy SFT would be REINFORCE. A refusal must cost more than a wrong answer:
  at +1/−1 refusing everything beats answering at π0's accuracy, and runs drift into it.

OUT/VARIANT-seedS/ is a normal run directory (config.yaml, metrics.jsonl, samples.jsonl, final/,
eval.json with the held-out curve; the last checkpoint is dropped, final/ holds the weights). A
finished one is skipped when the ablation runs again with the same settings. OUT/ablate.json holds
the table, OUT/ablate.html the curves, table and summary (grpolab.report.ablate).
OUT is claimed like a run folder (rundir.claim): an earlier ablation there is continued, the user's files
or another command's run refused (`overwrite` moves them aside, nothing is deleted).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import multiprocessing
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from grpolab import config as C
from grpolab.rewards.rules import is_correct, is_integer

SHARPENING = ("rl_sharpening", "sft_sharpening")
DEFAULT_VARIANTS = ("onpolicy_sft", "reinforce", "reinforce_norm", "grpo_no_is", "grpo_no_kl", "grpo", "dr_grpo",
                    "dapo", "ppo", *SHARPENING)
DEFAULT_STEPS = 100
QUICK_STEPS = 30
EVAL_POINTS = 5
"""Held-out evaluations during a run (plus π0 and the final one)."""
THREE_LEVEL_REWARD = "{name: 'grpolab.app.ablate:three_level_reward', label: three_level, weight: 1.0}"
SHARED_OVERRIDES = (
    "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=8",
    "train.lr=1e-4", "train.lr_schedule=constant", "train.warmup_steps=0",
    f"rewards=[{THREE_LEVEL_REWARD}, {{name: exact_match, weight: 0.0}}]",
    "run.tensorboard=false", "run.progress=false", "run.checkpoint_every=0",
)
"""The ablation's settings, applied to every variant (and π0's SFT settings come from the demo)."""
VARIANT_OVERRIDES = {"rl_sharpening": ("rewards=[self_likelihood:1.0, exact_match:0.0]",)}
"""A variant's own values, applied after the user's overrides."""
FIXED_FIELDS = ("model.name_or_path", "data.source", "data.eval_source", "train.seed", "train.steps")


def three_level_reward(prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[dict]) -> list[float]:
    """Seed 004's rewards (correct 1, wrong −1, format error −2) on the built-in task: +1 correct and
    finished (the answer, or the refusal on an unanswerable prompt); −1 a wrong integer (on an
    unanswerable prompt too); −2 no answer: truncated, neither an integer nor the refusal, or the
    refusal of an answerable prompt."""
    def score(text: str, m: dict) -> float:
        if m["truncated"]:
            return -2.0
        if is_correct(text, m):
            return 1.0
        return -1.0 if is_integer(text) else -2.0

    return [score(c, m) for c, m in zip(completions, metadata)]


def default_variants(say: Callable[[str], None] = print) -> tuple[str, ...]:
    """DEFAULT_VARIANTS, leaving out (with a note) presets this grpolab does not have."""
    missing = [v for v in DEFAULT_VARIANTS if v not in SHARPENING and v not in C.PRESETS]
    if missing:
        say(f"[ablate] note: no preset {', '.join(missing)} in this grpolab; left out of the defaults")
    return tuple(v for v in DEFAULT_VARIANTS if v not in missing)


def preset_of(variant: str) -> str:
    """The preset a variant starts from (ValueError naming --presets for an unknown one)."""
    if variant in SHARPENING:
        return "grpo"
    if variant == "sft":
        raise ValueError("--presets: sft trains on offline data; π0 (the table's first row) is the SFT baseline")
    if variant not in C.PRESETS:
        raise ValueError(f"--presets: unknown variant {variant!r}; choose from "
                         f"{', '.join([p for p in C.PRESETS if p != 'sft'] + list(SHARPENING))}")
    return variant


@dataclasses.dataclass(frozen=True)
class Ablation:
    """What to run: variants × seeds, `steps` steps each, into `out` (absolute; `overwrite`: see the module)."""

    out: Path
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    steps: int = DEFAULT_STEPS
    overrides: tuple[str, ...] = ()
    jobs: int = 2
    threads: int = 1
    """torch threads per worker process (0 = torch's default)."""
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or self.jobs < 1 or not self.seeds or not self.variants:
            raise ValueError(f"--steps={self.steps} and --jobs={self.jobs} must be >= 1, and --seeds / --presets "
                             "must name at least one")
        for v in self.variants:
            preset_of(v)
        for ov in self.overrides:
            if ov.partition("=")[0].strip() in FIXED_FIELDS:
                raise ValueError(f"override {ov!r}: the ablation sets {ov.partition('=')[0].strip()} itself "
                                 "(π0 is built on the built-in task; --seeds and --steps set the rest)")

    def base(self, seed: int) -> list[str]:
        """The overrides every config of `seed` shares: the demo's model/data/SFT settings, the ablation's."""
        from grpolab.app.demo import DEMO_OVERRIDES

        pi0 = [o for o in DEMO_OVERRIDES if o.split(".")[0] in ("model", "data", "sft")]
        return pi0 + list(SHARED_OVERRIDES) + [f"train.steps={self.steps}", f"train.seed={seed}"]

    def pi0_config(self, seed: int) -> C.Config:
        """π0's config: its model, data and SFT settings (and the shared ones, for the record)."""
        return _config("grpo", self.base(seed) + [f"run.out_dir={self.pi0_dir(seed)}"], self.overrides)

    def pi0_dir(self, seed: int) -> Path:
        return self.out / f"pi0-seed{seed}"

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / f"{variant}-seed{seed}"

    def variant_config(self, variant: str, seed: int) -> C.Config:
        """The variant's preset, the shared settings (its minibatch count per epoch kept), the user's
        overrides, then the variant's own values."""
        shared = self.base(seed) + [f"model.name_or_path={self.pi0_dir(seed) / 'pi0'}",
                                    f"run.out_dir={self.run_dir(variant, seed)}"]
        cfg = _config(preset_of(variant), shared, self.overrides, VARIANT_OVERRIDES.get(variant, ()))
        if cfg.sequences_per_step * cfg.train.steps != self.budget:
            raise ValueError(f"{variant}: rollout sizes differ from the other variants' (the budget must be equal)")
        return cfg

    @property
    def budget(self) -> int:
        """Generated completions per run: P × G × steps."""
        cfg = self.pi0_config(self.seeds[0])
        return cfg.sequences_per_step * self.steps


def _config(preset: str, shared: Sequence[str], user: Sequence[str], own: Sequence[str] = ()) -> C.Config:
    """The preset, then `shared`, the preset's Phase-B sizes at this step size, `user`, the preset's own
    step sizes (`_step_sizes`), `own`; validated."""
    from grpolab.config.io import apply_overrides

    merged = apply_overrides(C.Config(), [*shared, *user, *own])  # not validated yet
    sizes = _step_sizes(preset, merged.rollout.prompts_per_step, merged.train.steps)
    n = int(sizes[0].partition("=")[2]) * merged.rollout.group_size if sizes else merged.sequences_per_step
    return C.from_preset(preset, [*shared, *_phase_b_sizes(preset, n), *user, *sizes, *own])


def _step_sizes(preset: str, prompts: int, steps: int) -> list[str]:
    """A preset that sets its own prompts per step and steps (sft_o1: half the prompts, twice the
    steps) keeps their ratios to the defaults, so its budget P × G × steps stays the ablation's."""
    own, default = C.from_preset(preset), C.Config()
    p = prompts * own.rollout.prompts_per_step / default.rollout.prompts_per_step
    t = steps * own.train.steps / default.train.steps
    if (p, t) == (prompts, steps):
        return []
    if p != int(p) or t != int(t) or p * t != prompts * steps:
        raise ValueError(f"rollout.prompts_per_step={prompts}, --steps={steps}: the {preset} preset scales them by "
                         f"{own.rollout.prompts_per_step}/{default.rollout.prompts_per_step} and "
                         f"{own.train.steps}/{default.train.steps}; choose values that stay whole numbers")
    return [f"rollout.prompts_per_step={int(p)}", f"train.steps={int(t)}"]


def _phase_b_sizes(preset: str, n: int) -> list[str]:
    """The preset's minibatches per epoch at its own step size, kept at the ablation's N sequences
    per step; one forward per minibatch (microbatch = minibatch)."""
    own = C.from_preset(preset)
    if own.train.minibatch_size == 0:
        return [f"train.microbatch_size={n}"]
    k = own.minibatches_per_epoch
    if n % k:
        raise ValueError(f"rollout.prompts_per_step × rollout.group_size = {n} must be a multiple of {k}: the "
                         f"{preset} preset takes {k} minibatches per epoch")
    return [f"train.minibatch_size={n // k}", f"train.microbatch_size={n // k}"]


# ----------------------------------------------------------------------------- one task


def _arith_eval(model, tokenizer, cfg) -> Callable[[], dict]:
    """A function returning the built-in task's greedy held-out metrics of `model` now."""
    from grpolab.data.build import arith_eval_items
    from grpolab.rollout.hf import HFEngine
    from grpolab.evaluation.evaluate import evaluate_arith

    items = arith_eval_items(cfg)
    engine = HFEngine(tokenizer, cfg.rollout.max_new_tokens)
    def evaluate() -> dict:
        res = evaluate_arith(model, engine, items)
        return {k: res[k] for k in ("accuracy", "refusal_recall", "false_refusal")}

    return evaluate


def build_pi0(ab: Ablation, seed: int) -> dict:
    """OUT/pi0-seedS/: π0 (pi0/ folder) and eval.json {pi0: held-out metrics, wall_s}."""
    import torch

    from grpolab.app.demo import build_pi0 as demo_pi0
    from grpolab.rundir.rundir import claim, mark_finished, write_config, write_eval

    cfg = ab.pi0_config(seed)
    path = claim(ab.pi0_dir(seed), "ablate-pi0", overwrite=True, field="--out", say=_err)
    write_config(cfg, path)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model, tok, _ = demo_pi0(cfg, path)
    payload = {"seed": seed, "pi0": _arith_eval(model, tok, cfg)(), "wall_s": time.perf_counter() - t0}
    write_eval(path, payload)
    mark_finished(path)
    return payload


class BudgetHook:
    """A Setup hook: counts the generated completions (P × G per batch; DAPO's dynamic sampling draws
    several batches) and tokens, evaluates on held-out prompts every `eval_every` steps and at the
    end, and ends the loop after the step in which the count reaches `budget`."""

    def __init__(self, setup, budget: int, eval_every: int, evaluate: Callable[[], dict]):
        self.setup, self.budget, self.eval_every, self.evaluate = setup, budget, eval_every, evaluate
        self.completions, self.tokens, self.steps = 0, 0.0, 0
        self.curve: list[dict] = []

    def __call__(self, step: int, row: dict, *rest) -> None:
        n = self.setup.cfg.sequences_per_step * int(row.get("rollout/gen_batches") or 1)
        self.completions += n
        self.tokens += row["len/mean"] * n  # kept groups' mean length (exact without dynamic sampling)
        self.steps = step + 1
        spent = self.completions >= self.budget
        if spent or self.steps % self.eval_every == 0 or self.steps == self.setup.cfg.train.steps:
            self.curve.append({"step": self.steps, "completions": self.completions, **self.evaluate()})
        if spent and self.steps < self.setup.cfg.train.steps and self.setup.services.stop is not None:
            self.setup.services.stop.requested = True  # no signal number: the run ends as finished


def _train_grpo(ab: Ablation, cfg: C.Config, path: Path) -> dict:
    from grpolab.grpo.run import train_in_run_dir
    from grpolab.grpo.setup import build_setup

    setup = build_setup(cfg)  # the policy (and reference, and self-likelihood reward) load π0
    hook = BudgetHook(setup, ab.budget, max(1, cfg.train.steps // EVAL_POINTS),
                      _arith_eval(setup.models.policy, setup.models.tokenizer, cfg))
    setup.services.hooks.append(hook)
    code = train_in_run_dir(setup, path)
    if code != 0:
        raise RuntimeError(f"training stopped with exit code {code}")
    shutil.rmtree(path / "checkpoints", ignore_errors=True)  # final/ holds the weights
    return {"after": {k: v for k, v in hook.curve[-1].items() if k not in ("step", "completions")},
            "curve": hook.curve, "completions": hook.completions, "tokens": hook.tokens, "steps": hook.steps,
            "optimizer_steps_per_step": cfg.optimizer_steps_per_step}


def _train_sft_sharpening(cfg: C.Config, path: Path) -> dict:
    """Best-of-G by log π0(y|x) on P × steps training prompts (P × G × steps completions), then
    train.steps SFT steps of sft.batch_size winners at train.lr."""
    import torch

    from grpolab.data.build import prompt_stream
    from grpolab.rewards.self_likelihood import SelfLikelihood
    from grpolab.rollout.hf import HFEngine
    from grpolab.models.policy import load_policy
    from grpolab.sft.sharpen import sharpen_sft

    model, tok = load_policy(cfg)
    r, steps = cfg.rollout, cfg.train.steps
    engine = HFEngine(tok, r.max_new_tokens, r.temperature, r.top_p, r.top_k)
    prompts = [it.prompt for it in prompt_stream(cfg, tok).next_batch(r.prompts_per_step * steps)]
    scorer = SelfLikelihood(model=model, tokenizer=tok)  # a frozen copy of π0
    gen = torch.Generator().manual_seed(cfg.train.seed)
    res = sharpen_sft(model, engine, prompts, r.group_size, scorer, steps=steps, batch_size=cfg.sft.batch_size,
                      microbatch_size=cfg.sft.microbatch_size, lr=cfg.train.lr, seed=cfg.train.seed, generator=gen)
    model.save_pretrained(path / "final")
    tok.save_pretrained(path / "final")
    texts = [t for row in res.best.candidates for t in row]
    finished = (~res.best.candidate_truncated.flatten()).tolist()
    tokens = sum(len(tok.encode(t, add_special_tokens=False)) + int(f) for t, f in zip(texts, finished))
    after = _arith_eval(model, tok, cfg)()
    return {"after": after, "curve": [{"step": steps, "completions": len(texts), **after}],
            "completions": len(texts), "tokens": float(tokens), "steps": steps, "optimizer_steps_per_step": 1,
            "sft": {"pairs": len(res.pairs), "first_loss": res.losses[0], "final_loss": res.losses[-1]}}


def run_variant(ab: Ablation, variant: str, seed: int) -> dict:
    """Trains and evaluates one (variant, seed) in OUT/VARIANT-seedS/; returns its eval.json payload."""
    from grpolab.rundir.rundir import claim, mark_finished, write_config, write_eval

    cfg = ab.variant_config(variant, seed)
    pi0 = json.loads((ab.pi0_dir(seed) / "eval.json").read_text())["pi0"]
    path = claim(ab.run_dir(variant, seed), "ablate", overwrite=True, field="--out", say=_err)
    write_config(cfg, path)
    t0 = time.perf_counter()
    res = _train_sft_sharpening(cfg, path) if variant == "sft_sharpening" else _train_grpo(ab, cfg, path)
    payload = {"variant": variant, "preset": cfg.preset, "seed": seed, "budget": ab.budget, "before": pi0, **res,
               "wall_s": time.perf_counter() - t0}
    payload["curve"] = [{"step": 0, "completions": 0, **pi0}] + payload["curve"]
    write_eval(path, payload)
    mark_finished(path)
    return payload


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the whole ablation

PI0_FIELDS = ("model.", "data.", "sft.", "train.seed", "rollout.max_new_tokens")
"""The fields π0 depends on: a finished π0 of other values is not reused."""


def _flat(cfg: C.Config, only: Sequence[str] = ()) -> dict[str, Any]:
    """Dotted field -> value, without the paths (run.out_dir, model.name_or_path), optionally only
    the fields starting with one of `only`."""
    d = dataclasses.asdict(cfg)
    flat = {f"{sec}.{k}": v for sec, sub in d.items() if isinstance(sub, dict) for k, v in sub.items()}
    flat["rewards"] = d["rewards"]
    flat = {k: v for k, v in flat.items() if k not in ("run.out_dir", "model.name_or_path")}
    return {k: v for k, v in flat.items() if not only or k.startswith(tuple(only))}


def stored(path: Path, cfg: C.Config, only: Sequence[str] = ()) -> dict | None:
    """The eval.json payload of the finished run at `path`, or None when there is none yet. A finished
    run made with other settings (of the fields in `only`, default all) is a ValueError naming --out."""
    from grpolab.rundir.rundir import read_run

    if read_run(path).get("status") != "finished" or not (path / "eval.json").is_file():
        return None
    old, new = _flat(C.load(str(path / "config.yaml")), only), _flat(cfg, only)
    diff = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if diff:
        k = diff[0]
        raise ValueError(f"--out: {path} holds a finished run of other settings ({k}: {old.get(k)!r} there, "
                         f"{new.get(k)!r} now); give another --out, or move that folder aside")
    return json.loads((path / "eval.json").read_text())


def _init_worker(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def _work(ab: Ablation, variant: str, seed: int) -> dict:
    """One task (variant "pi0": build π0), its output going to OUT/logs/VARIANT-seedS.log."""
    import traceback

    log = ab.out / "logs" / f"{variant}-seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            return build_pi0(ab, seed) if variant == "pi0" else run_variant(ab, variant, seed)
        except BaseException:
            traceback.print_exc()
            raise


class _Inline:
    """An executor that runs each task when it is submitted, in this process (--jobs 1)."""

    def __init__(self, threads: int):
        _init_worker(threads)

    def submit(self, fn, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to the caller like a worker's error
            fut.set_exception(e)
        return fut

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _executor(ab: Ablation):
    if ab.jobs == 1:
        return _Inline(ab.threads)
    return cf.ProcessPoolExecutor(ab.jobs, mp_context=multiprocessing.get_context("spawn"),
                                  initializer=_init_worker, initargs=(ab.threads,))


def _pending(ab: Ablation, say: Callable[[str], None]) -> tuple[dict, dict, list[int], dict[int, list[str]]]:
    """What is already done (π0 per seed, payload per (variant, seed)) and what is left to run. All
    configs are built here, so a bad override or a folder of other settings fails before any work."""
    pi0, runs, todo_pi0, todo = {}, {}, [], {}
    for s in ab.seeds:
        built = stored(ab.pi0_dir(s), ab.pi0_config(s), PI0_FIELDS)
        if built:
            pi0[s] = built
        else:
            todo_pi0.append(s)  # its runs are redone on the new π0
        todo[s] = []
        for v in ab.variants:
            cfg = ab.variant_config(v, s)
            got = stored(ab.run_dir(v, s), cfg) if built else None
            if got:
                runs[(v, s)] = got
            else:
                todo[s].append(v)
    if runs:
        say(f"[ablate] {len(runs)} finished run(s) found in {ab.out}: skipped")
    return pi0, runs, todo_pi0, todo


def execute(ab: Ablation, say: Callable[[str], None] = print) -> tuple[dict, dict, list[str], int]:
    """Builds the missing π0s and runs the missing (variant, seed) runs, `ab.jobs` at a time; a
    seed's runs start when its π0 is there. Returns (π0 payload per seed, run payload per (variant,
    seed), failures: one line each, how many runs were found finished)."""
    pi0, runs, todo_pi0, todo = _pending(ab, say)
    reused = len(runs)
    failed: list[str] = []
    with _executor(ab) as ex:
        futs = {ex.submit(_work, ab, "pi0", s): ("pi0", s) for s in todo_pi0}
        futs |= {ex.submit(_work, ab, v, s): (v, s) for s in pi0 for v in todo[s]}
        while futs:
            done, _ = cf.wait(futs, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                v, s = futs.pop(fut)
                log = ab.out / "logs" / f"{v}-seed{s}.log"
                try:
                    res = fut.result()
                except Exception as e:  # noqa: BLE001 - the other runs go on; reported at the end
                    failed.append(f"{v} seed {s}: {type(e).__name__}: {' '.join(str(e).split())[:300]} (log: {log})")
                    say(f"[ablate] FAILED {failed[-1]}")
                    continue
                if v == "pi0":
                    pi0[s] = res
                    say(f"[ablate] π0 seed {s}: held-out accuracy {res['pi0']['accuracy']:.3f} ({res['wall_s']:.0f} s)")
                    futs |= {ex.submit(_work, ab, w, s): (w, s) for w in todo[s]}
                else:
                    runs[(v, s)] = res
                    say(f"[ablate] {v} seed {s}: held-out accuracy {res['before']['accuracy']:.3f} → "
                        f"{res['after']['accuracy']:.3f} ({res['wall_s']:.0f} s)")
    return pi0, runs, failed, reused


def settings(ab: Ablation) -> dict:
    """The ablation's settings, as ablate.json records them."""
    cfg = ab.pi0_config(ab.seeds[0])
    return {"variants": list(ab.variants), "seeds": list(ab.seeds), "steps": ab.steps,
            "prompts_per_step": cfg.rollout.prompts_per_step, "group_size": cfg.rollout.group_size,
            "max_new_tokens": cfg.rollout.max_new_tokens, "lr": cfg.train.lr, "lr_schedule": cfg.train.lr_schedule,
            "budget_completions": ab.budget, "eval_prompts": cfg.data.builtin_eval_prompts,
            "rewards": [s.display_name + f":{s.weight:g}" for s in cfg.rewards],
            "overrides": list(ab.overrides), "jobs": ab.jobs, "threads": ab.threads}


def run_ablation(ab: Ablation, say: Callable[[str], None] = print) -> dict:
    """Runs what is missing, then writes OUT/ablate.json and OUT/ablate.html and prints the table and
    the summary. Returns ablate.json's data (its "failed" lists runs that raised)."""
    from grpolab.report.ablate import ablation_data, format_table, jsonable, write_html

    from grpolab.rundir.rundir import claim, mark_finished

    t0 = time.perf_counter()
    claim(ab.out, "ablate", resume=True, overwrite=ab.overwrite, field="--out", say=say)
    say(f"[ablate] {len(ab.variants)} variants × {len(ab.seeds)} seeds, {ab.budget} generated completions each, "
        f"{ab.jobs} job(s); logs in {ab.out / 'logs'}")
    pi0, runs, failed, reused = execute(ab, say)
    data = ablation_data(settings(ab), pi0, {f"{v}-seed{s}": p for (v, s), p in runs.items()},
                         wall_s=time.perf_counter() - t0)
    data["failed"], data["reused_runs"] = failed, reused
    tmp = ab.out / "ablate.json.tmp"
    tmp.write_text(json.dumps(jsonable(data), indent=1, allow_nan=False))
    tmp.replace(ab.out / "ablate.json")
    page = write_html(ab.out, data)
    if not failed:
        mark_finished(ab.out)
    print(format_table(data))
    print("\n".join(data["summary"]))
    print(f"wall time {data['wall_s']:.0f} s ({len(runs) - reused} run(s) trained, {reused} reused); report: {page}")
    return data
