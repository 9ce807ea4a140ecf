"""Rollout and reward workers on a local Ray cluster: step time with the engine in the trainer, on a
rollout worker, on a worker overlapping the next rollout with learning, and with a reward that
sleeps a second per call (scored in the trainer, on reward workers, and on reward workers with
overlap). One process drives every run in turn, on one local cluster.

    python bench/ray_rollout.py [--steps 8] [--warmup 2] [--sleep 1.0]

Prints one line per setting (median s/step over the timed steps, its rollout / score / learn /
sync parts, staleness) and the ratios against the first setting, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = ["model.hidden_size=128", "model.num_layers=4", "model.num_heads=4", "rollout.prompts_per_step=8",
         "rollout.group_size=8", "rollout.max_new_tokens=24", "train.minibatch_size=32", "train.microbatch_size=16",
         "train.epochs=2", "loss.kl_coef=0", "run.progress=false", "run.tensorboard=false",
         "run.checkpoint_every=0", "run.samples_every=1000"]


def sleepy(seconds: float = 1.0):
    """A reward that sleeps `seconds` per call (a slow verifier or sandbox); scores the length."""
    def score(prompts, completions, metadata):
        time.sleep(seconds)
        return [min(len(c), 8) / 8 for c in completions]
    return score


def settings(sleep: float) -> list[tuple[str, list[str]]]:
    slow = f'rewards=[{{name: "ray_rollout:sleepy", kwargs: {{seconds: {sleep}}}}}]'
    return [
        ("engine in the trainer (2 threads)", ["run.threads=2"]),
        ("1 rollout worker", ["run.threads=1", "rollout.workers=1"]),
        ("1 rollout worker, overlap", ["run.threads=1", "rollout.workers=1", "rollout.overlap=1"]),
        (f"{sleep:g} s reward, scored in the trainer", ["run.threads=1", "rollout.workers=1", slow]),
        (f"{sleep:g} s reward, 2 reward workers", ["run.threads=1", "rollout.workers=1", "rollout.reward_workers=2",
                                                   slow]),
        (f"{sleep:g} s reward, 2 reward workers, overlap", ["run.threads=1", "rollout.workers=1",
                                                            "rollout.reward_workers=2", "rollout.overlap=1", slow]),
    ]


def run(name: str, overrides: list[str], steps: int, warmup: int, out: Path) -> dict:
    import torch

    from grpolab import config as C
    from grpolab.grpo.run import train_in_run_dir
    from grpolab.grpo.setup import build_setup

    cfg = C.from_preset("grpo", MODEL + overrides + [f"train.steps={warmup + steps}", f"run.out_dir={out}"])
    torch.set_num_threads(cfg.run.threads)
    shutil.rmtree(out, ignore_errors=True)
    assert train_in_run_dir(build_setup(cfg), out) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][warmup:]

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    res = {"setting": name, "s_per_step": med("time/step_s"), "rollout_s": med("time/rollout_s"),
           "score_s": med("time/score_s"), "learn_s": med("time/learn_s"), "sync_s": med("time/sync_s"),
           "wait_s": med("time/rollout_wait_s"), "staleness": max(r["rollout/staleness"] for r in rows),
           "sync_bytes": rows[-1].get("sync/bytes", 0)}
    print(f"{name:48s} {res['s_per_step']:6.2f} s/step  rollout {res['rollout_s']:5.2f}  score {res['score_s']:5.2f}  "
          f"learn {res['learn_s']:5.2f}  sync {res['sync_s']:5.3f}  wait {res['wait_s']:5.2f}  "
          f"staleness {res['staleness']}", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sleep", type=float, default=1.0, help="seconds the slow reward sleeps per call")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])  # the workers import sleepy
    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    print(f"{os.cpu_count()} CPUs; P=8 x G=8, 24 new tokens, 4-layer 128-wide model, mu=2; reward calls: one per "
          f"group on reward workers, one per batch in the trainer", flush=True)
    out = Path(tempfile.mkdtemp(prefix="grpolab-ray-bench-"))
    results = [run(name, ov, args.steps, args.warmup, out / str(i)) for i, (name, ov) in enumerate(settings(args.sleep))]
    base = results[0]["s_per_step"]
    for r in results:
        r["vs_first"] = r["s_per_step"] / base
    print(json.dumps({"bench": "ray_rollout", "results": results}))
    ray.shutdown()
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
