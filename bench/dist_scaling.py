"""Data parallelism on one host: the same GRPO job in one process, on 2 DDP ranks and on 2 FSDP2 ranks.

    python bench/dist_scaling.py --repeats 3                       # the measurement in bench/README.md
    python bench/dist_scaling.py                                   # each configuration once
    python bench/dist_scaling.py --steps 1 --warmup 0 --prompts 2 --group-size 2 --max-new-tokens 4 \
        --minibatch 4 --microbatch 2                               # smoke test (a minute or two)
    python bench/dist_scaling.py --configs fsdp2 --nproc 2         # one configuration only
    python bench/dist_scaling.py --report DIR                      # the table of rank files already in DIR

One job (SmolLM2-135M-Instruct by default, preset `grpo` with loss.kl_coef=0 so no reference model,
`builtin:arith` prompts, exact-match reward; the reward's value does not matter here), with the same
global sizes everywhere: P = `--prompts` × G = `--group-size` completions per step, one optimizer step
per step over `--minibatch` sequences, `--microbatch` sequences per forward/backward on each rank. It
runs, one after the other in this invocation:

    1 process   python bench/dist_scaling.py --worker --parallel none   (no launcher; `--threads` 2)
    DDP         python -m torch.distributed.run --standalone --nproc-per-node N bench/dist_scaling.py
                    --worker --parallel ddp                          (`--rank-threads` 1 per rank)
    FSDP2       the same with --parallel fsdp2

Each worker (rank) runs `--warmup` + `--steps` GRPO steps and writes rank<R>.json: steps/s over the
measured steps (wall clock from the end of the last warm-up step to the end of the last step), the
mean phase times, peak RSS (ru_maxrss over the whole process, and over the training steps alone:
the count restarts after the setup; on CUDA also torch.cuda.max_memory_allocated), and the bytes
this rank holds for parameters, gradients and optimizer state (its local shards under FSDP2:
`DTensor.to_local()`), plus, separately, the rollout engine's full unsharded sampling copy that FSDP2
keeps on every rank (`setup.data.engine.model`; with DDP and one process the engine samples from the policy
itself). With `--repeats N` the driver runs the three N times, alternating (1 process, DDP, FSDP2,
1 process, ...), so that a busy minute on a shared host slows each alike; the table gives each one's
median steps/s, and the ratios of the runs side by side in brackets. It prints one table and writes
all of it to `--json`.

`--device cuda` runs the workers on GPUs (NCCL); bench/gpu_check.sh is one FSDP2 step that way.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIGS = ("single", "ddp", "fsdp2")
"""The driver's configurations: one process without a launcher, DDP ranks, FSDP2 ranks."""
LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
"""torchrun's variables: removed from the 1-process run's environment, so it starts no process group."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model.name_or_path (shortcut, HF folder or .gguf)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step, global (P)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="longest completion")
    p.add_argument("--minibatch", type=int, default=16, help="sequences per optimizer step, global")
    p.add_argument("--microbatch", type=int, default=4, help="sequences per forward/backward, per rank")
    p.add_argument("--steps", type=int, default=3, help="measured GRPO steps")
    p.add_argument("--warmup", type=int, default=1, help="GRPO steps run before the measured ones")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32", help="model.dtype")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="train.seed")
    p.add_argument("--device", default="cpu", help="model.device of the workers: cpu (gloo) or cuda (NCCL)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the 1-process run")
    p.add_argument("--rank-threads", type=int, default=1, help="torch threads of each rank")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the DDP and FSDP2 runs")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="what the driver runs")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each configuration, alternating; the table gives the median speed")
    p.add_argument("--work-dir", default="", help="where the ranks write their JSON (default: a temporary folder)")
    p.add_argument("--json", default="runs/dist_scaling.json", help="the driver's results ('' = not written)")
    p.add_argument("--timeout-min", type=float, default=30.0, help="limit of each configuration's run")
    p.add_argument("--report", default="", metavar="DIR",
                   help="print the table of the rank files in DIR (one subfolder per configuration, or rank*.json "
                        "directly in DIR) and exit")
    # worker mode (what the driver and bench/gpu_check.sh start)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--parallel", choices=("none", "ddp", "fsdp2"), default="none",
                   help="worker: train.parallel (none = one process, no launcher)")
    p.add_argument("--out", default="", help="worker: the folder its rank<R>.json goes to")
    return p.parse_args(argv)


# --------------------------------------------------------------------------- worker (one rank)


def bench_config(args: argparse.Namespace, parallel: str):
    from grpolab import config as C

    overrides = [
        f"model.name_or_path={args.model}", f"model.dtype={args.dtype}", f"model.device={args.device}",
        "data.source=builtin:arith", "rewards=[exact_match:1.0]", "loss.kl_coef=0",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        f"train.steps={args.warmup + args.steps}", "train.epochs=1", f"train.minibatch_size={args.minibatch}",
        f"train.microbatch_size={args.microbatch}", f"train.lr={args.lr}", f"train.seed={args.seed}",
        f"train.parallel={'ddp' if parallel == 'none' else parallel}",
        "run.tensorboard=false", "run.progress=false",
    ]
    return C.from_preset("grpo", overrides)


def local_bytes(t: Any) -> int:
    """Bytes of the part of `t` this rank holds: a DTensor's local shard, a tensor's own elements."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(policy, optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state that this rank holds (each parameter counted once,
    tied ones included)."""
    import torch

    params = list({id(p): p for p in policy.parameters()}.values())
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params),
        "optimizer": sum(local_bytes(v) for st in optimizer.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor)),
    }


def module_bytes(module) -> int:
    """Parameters and buffers of a module (distinct storages)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += local_bytes(t)
    return total


def peak_rss_gb() -> float:
    """Peak resident memory of this process since it started, or since `reset_peak_rss` (Linux
    ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def reset_peak_rss() -> bool:
    """Restarts the peak-RSS count from the current RSS (Linux: "5" to /proc/self/clear_refs), so that
    the training steps' peak is seen apart from the model load's; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class StepClock:
    """Setup hook: the wall-clock time at the end of each step, and its metrics row."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.ends: list[float] = []
        self.rows: list[dict] = []

    def __call__(self, step, row, record) -> None:
        self.ends.append(time.perf_counter())
        self.rows.append(row)

    def measured(self, warmup: int) -> dict[str, Any]:
        start = self.ends[warmup - 1] if warmup > 0 else self.t0
        rows = self.rows[warmup:]
        n = len(rows)
        elapsed = self.ends[-1] - start
        mean = lambda key: sum(r[key] for r in rows) / max(n, 1)
        return {"measured_steps": n, "elapsed_s": elapsed, "steps_per_s": n / elapsed if elapsed > 0 else 0.0,
                "step_s": mean("time/step_s"), "rollout_s": mean("time/rollout_s"),
                "logprob_s": mean("time/logprob_s"), "learn_s": mean("time/learn_s"),
                "reward_mean": mean("reward/mean"), "len_mean": mean("len/mean")}


def run_worker(args: argparse.Namespace) -> dict:
    """One rank (or the one process): build the setup, train, write rank<R>.json to --out."""
    import torch

    from grpolab.parallel.launch import close_parallel, init_parallel
    from grpolab.grpo import loop as grpo
    from grpolab.grpo.setup import build_setup
    from grpolab.models.loading import resolve_compute_dtype

    threads = args.rank_threads if args.parallel != "none" else args.threads
    if threads > 0:
        torch.set_num_threads(threads)
    cfg = bench_config(args, args.parallel)
    cuda = torch.device(args.device).type == "cuda"
    par = init_parallel(cfg.model.device, cfg.train.parallel, resolve_compute_dtype(cfg.model.dtype, cfg.model.device))
    if args.parallel == "none" and par.active:
        raise SystemExit("--parallel none runs without a launcher (torchrun set WORLD_SIZE and RANK)")
    if args.parallel != "none" and not par.active:
        raise SystemExit(f"--parallel {args.parallel} runs under torchrun (python -m torch.distributed.run ...)")
    try:
        t = time.perf_counter()
        setup = build_setup(cfg, parallel=par)
        setup_s = time.perf_counter() - t
        setup_rss = peak_rss_gb()
        steps_rss = reset_peak_rss()
        clock = StepClock()
        setup.services.hooks.append(clock)
        grpo.train(setup)
        if cuda:
            torch.cuda.synchronize()
        held = state_bytes(setup.models.policy, setup.optim.optimizer)
        engine_model = getattr(setup.data.engine, "model", None)
        engine_copy = module_bytes(engine_model) if engine_model is not None and engine_model is not setup.models.policy else 0
        result = {
            "config": "single" if args.parallel == "none" else args.parallel,
            "strategy": par.strategy, "rank": par.rank, "world_size": par.world_size,
            "threads": torch.get_num_threads(), "device": args.device, "model": args.model,
            "sizes": {"prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
                      "minibatch": args.minibatch, "microbatch": args.microbatch, "dtype": args.dtype,
                      "warmup": args.warmup, "steps": args.steps},
            "setup_s": setup_s, **clock.measured(args.warmup),
            "bytes": {**held, "total": sum(held.values()), "engine_copy": engine_copy},
            "peak_rss_gb": max(setup_rss, peak_rss_gb()), "peak_rss_setup_gb": setup_rss,
            "peak_rss_steps_gb": peak_rss_gb() if steps_rss else None,
        }
        if cuda:
            result["cuda_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{par.rank}.json").write_text(json.dumps(result, indent=2) + "\n")
        return result
    finally:
        close_parallel()


# --------------------------------------------------------------------------- driver


def worker_argv(args: argparse.Namespace, parallel: str, out: Path) -> list[str]:
    """The worker's own arguments (the job's sizes, its strategy and output folder)."""
    return ["--worker", "--parallel", parallel, "--out", str(out), "--model", args.model,
            "--prompts", str(args.prompts), "--group-size", str(args.group_size),
            "--max-new-tokens", str(args.max_new_tokens), "--minibatch", str(args.minibatch),
            "--microbatch", str(args.microbatch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--dtype", args.dtype, "--lr", str(args.lr), "--seed", str(args.seed), "--device", args.device,
            "--threads", str(args.threads), "--rank-threads", str(args.rank_threads)]


def command(args: argparse.Namespace, config: str, out: Path) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of one configuration: the worker alone, or under torchrun."""
    script = str(Path(__file__).resolve())
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    if config == "single":
        env["OMP_NUM_THREADS"] = str(args.threads)
        return [sys.executable, script, *worker_argv(args, "none", out)], env
    env["OMP_NUM_THREADS"] = str(args.rank_threads)
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
             script, *worker_argv(args, config, out)], env)


def load_ranks(folder: Path, repeat: int = 0) -> list[dict]:
    """The rank*.json of one run's folder, in rank order, each tagged with the run's `repeat`."""
    ranks = [{**json.loads(f.read_text()), "repeat": repeat} for f in folder.glob("rank*.json")]
    return sorted(ranks, key=lambda r: r["rank"])


def _median(values: list[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def _per_run(ranks: list[dict]) -> dict[int, list[dict]]:
    runs: dict[int, list[dict]] = {}
    for r in ranks:
        runs.setdefault(r.get("repeat", 0), []).append(r)
    return dict(sorted(runs.items()))


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration from its ranks' results (all its runs; a rank dict's "repeat" says
    which run). A run's speed is its slowest rank's steps/s; the row's is the median over runs, and its
    ratio to the 1-process run is the ratio of medians, with the ratios of the runs of the same repeat
    in `speed_vs_single_runs`. Memory figures are the largest per rank; param+grad+optimizer bytes are
    also given over DDP's. Ratios are None where the 1-process or DDP run is missing."""
    rows = []
    for config, ranks in results.items():
        if not ranks:
            continue
        runs = _per_run(ranks)
        b = [r["bytes"] for r in ranks]
        speeds = {i: min(r["steps_per_s"] for r in rs) for i, rs in runs.items()}
        rows.append({
            "config": config, "ranks": ranks[0]["world_size"], "world_size": ranks[0]["world_size"],
            "threads": ranks[0]["threads"], "device": ranks[0]["device"], "runs": len(runs),
            "steps_per_s": _median(list(speeds.values())), "steps_per_s_runs": speeds,
            "rollout_s": _median([max(r["rollout_s"] for r in rs) for rs in runs.values()]),
            "learn_s": _median([max(r["learn_s"] for r in rs) for rs in runs.values()]),
            "step_s": _median([max(r["step_s"] for r in rs) for rs in runs.values()]),
            "peak_rss_gb": max(r["peak_rss_gb"] for r in ranks),
            "peak_rss_setup_gb": max((r["peak_rss_setup_gb"] for r in ranks if r.get("peak_rss_setup_gb") is not None),
                                     default=None),
            "peak_rss_steps_gb": max((r["peak_rss_steps_gb"] for r in ranks if r.get("peak_rss_steps_gb") is not None),
                                     default=None),
            "cuda_peak_gb": max((r["cuda_peak_gb"] for r in ranks if "cuda_peak_gb" in r), default=None),
            "state_mb": max(x["total"] for x in b) / 1e6,
            "params_mb": max(x["params"] for x in b) / 1e6, "grads_mb": max(x["grads"] for x in b) / 1e6,
            "optimizer_mb": max(x["optimizer"] for x in b) / 1e6,
            "engine_copy_mb": max(x["engine_copy"] for x in b) / 1e6,
        })
    by = {r["config"]: r for r in rows}
    base, ddp = by.get("single"), by.get("ddp")
    for r in rows:
        r["speed_vs_single"] = r["steps_per_s"] / base["steps_per_s"] if base and base["steps_per_s"] else None
        r["speed_vs_single_runs"] = [r["steps_per_s_runs"][i] / base["steps_per_s_runs"][i]
                                     for i in r["steps_per_s_runs"] if base and base["steps_per_s_runs"].get(i)]
        r["state_vs_ddp"] = r["state_mb"] / ddp["state_mb"] if ddp and ddp["state_mb"] else None
    return rows


LABELS = {"single": "1 process", "ddp": "DDP", "fsdp2": "FSDP2"}


def _num(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _speedup(r: dict) -> str:
    if r["speed_vs_single"] is None:
        return "—"
    runs = r["speed_vs_single_runs"]
    return f"{r['speed_vs_single']:.2f}×" + (f" ({', '.join(f'{x:.2f}' for x in runs)})" if len(runs) > 1 else "")


def _rss(r: dict) -> str:
    """Peak RSS of the setup (model load) and of the training steps, or the process's where the count
    could not be restarted after the setup."""
    if r.get("peak_rss_setup_gb") is None or r.get("peak_rss_steps_gb") is None:
        return f"{r['peak_rss_gb']:.2f}"
    return f"{r['peak_rss_setup_gb']:.2f} / {r['peak_rss_steps_gb']:.2f}"


def format_table(rows: list[dict]) -> str:
    """A Markdown table: per configuration its ranks, speed, memory, and the two ratios."""
    cuda = any(r.get("cuda_peak_gb") is not None for r in rows)
    head = ["config", "ranks × threads", "steps/s", "vs 1 process", "gen / learn s", "peak RSS / rank GB: setup / steps",
            *(["peak GPU mem / rank GB"] if cuda else []), "param+grad+optim / rank MB", "vs DDP",
            "engine copy / rank MB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [LABELS.get(r["config"], r["config"]), f"{r['world_size']} × {r['threads']}",
                 f"{r['steps_per_s']:.3f}", _speedup(r), f"{r['rollout_s']:.2f} / {r['learn_s']:.2f}",
                 _rss(r),
                 *([_num(r.get("cuda_peak_gb"), ".2f")] if cuda else []),
                 f"{r['state_mb']:.0f} ({r['params_mb']:.0f} + {r['grads_mb']:.0f} + {r['optimizer_mb']:.0f})",
                 _num(r["state_vs_ddp"], ".2f"), f"{r['engine_copy_mb']:.0f}" if r["engine_copy_mb"] else "— (shared)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _load_tree(folder: Path) -> list[dict]:
    """The rank files of a configuration's folder: directly in it (one run) or in its run<i>/ subfolders."""
    if any(folder.glob("rank*.json")):
        return load_ranks(folder)
    runs = sorted((d for d in folder.glob("run*") if d.is_dir()), key=lambda d: int(d.name[3:] or 0))
    return [r for d in runs for r in load_ranks(d, int(d.name[3:] or 0))]


def report_dir(folder: Path) -> dict[str, list[dict]]:
    """{config: ranks} from a work folder (one subfolder per configuration) or one configuration's folder."""
    own = _load_tree(folder)
    if own:
        return {own[0]["config"]: own}
    found = {c: _load_tree(folder / c) for c in CONFIGS if (folder / c).is_dir()}
    return {c: ranks for c, ranks in found.items() if ranks}


def run_driver(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="dist_scaling_"))
    results: dict[str, list[dict]] = {c: [] for c in args.configs}
    runs: list[dict] = []
    for repeat in range(args.repeats):  # the configurations alternate, so a slow minute hits each alike
        for config in args.configs:
            out = work / config / f"run{repeat}"
            out.mkdir(parents=True, exist_ok=True)
            for old in out.glob("rank*.json"):
                old.unlink()
            argv, env = command(args, config, out)
            print(f"[dist_scaling] {config} run {repeat + 1}/{args.repeats}: {' '.join(argv)}", flush=True)
            t = time.perf_counter()
            proc = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=args.timeout_min * 60)
            wall = time.perf_counter() - t
            runs.append({"config": config, "repeat": repeat, "argv": argv, "returncode": proc.returncode,
                         "wall_s": wall, "started": time.strftime("%H:%M:%S", time.localtime(time.time() - wall))})
            if proc.returncode != 0:
                print(proc.stdout[-4000:] + proc.stderr[-8000:], file=sys.stderr)
                print(f"[dist_scaling] {config} failed (exit {proc.returncode}); rank files in {out}", file=sys.stderr)
                continue
            ranks = load_ranks(out, repeat)
            results[config] += ranks
            r = summarize({config: ranks})[0]
            print(f"[dist_scaling] {config}: {r['steps_per_s']:.3f} steps/s, peak RSS {r['peak_rss_gb']:.2f} GB/rank, "
                  f"param+grad+optim {r['state_mb']:.0f} MB/rank ({wall:.0f} s in all)", flush=True)
    rows = summarize(results)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import cpu_description  # bench/common.py

    host = cpu_description() if Path("/proc/cpuinfo").is_file() else "unknown CPU"
    print(f"\n== {args.model}, P={args.prompts} × G={args.group_size}, max_new_tokens={args.max_new_tokens}, "
          f"minibatch {args.minibatch} (global), microbatch {args.microbatch} (per rank), {args.dtype}, "
          f"{args.steps} steps after {args.warmup} warm-up, {args.repeats} run(s) each; {args.device}, {host}, "
          f"{os.cpu_count()} cores ==")
    print(format_table(rows))
    failed = sorted({r["config"] for r in runs if r["returncode"] != 0})
    summary = {"args": vars(args), "host": host, "cores": os.cpu_count(), "work_dir": str(work), "runs": runs,
               "rows": rows, "ranks": results, "failed": failed}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"written: {args.json} (rank files in {work})")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        if not args.out:
            raise SystemExit("--worker needs --out DIR")
        run_worker(args)
        return 0
    if args.report:
        print(format_table(summarize(report_dir(Path(args.report)))))
        return 0
    return 1 if run_driver(args)["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
