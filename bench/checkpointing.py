"""model.gradient_checkpointing: peak RSS and step time of the same GRPO job with and without it.

    python bench/checkpointing.py                        # SmolLM2-135M-Instruct, the measurement in bench/README.md
    python bench/checkpointing.py --model builtin:tiny --steps 1 --max-new-tokens 8   # smoke test (seconds)

Each setting runs in a fresh process (`--worker`): `--warmup` + `--steps` GRPO steps of preset grpo
(loss.kl_coef=0: no reference model), `builtin:arith` prompts, P = `--prompts` × G = `--group-size`
completions of up to `--max-new-tokens` tokens, one optimizer step over all of them in microbatches of
`--microbatch` sequences (the activations checkpointing saves grow with it), float32, `--threads` threads.
The worker reports peak RSS (ru_maxrss of the process: model load, rollout and learning together) and the
mean step time and learning-phase time of the measured steps; the driver prints both settings and the ratios.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def _worker(args) -> None:
    import grpolab

    with tempfile.TemporaryDirectory() as tmp:
        sizes = {"rollout.prompts_per_step": args.prompts, "rollout.group_size": args.group_size,
                 "rollout.max_new_tokens": args.max_new_tokens, "train.minibatch_size": 0,
                 "train.microbatch_size": args.microbatch, "train.steps": args.warmup + args.steps}
        cfg = {"model.name_or_path": args.model, "model.dtype": "float32", "model.device": args.device,
               "model.gradient_checkpointing": args.checkpointing, "loss.kl_coef": 0.0,
               "run.threads": args.threads, "run.out_dir": str(Path(tmp) / "run"), "run.progress": False,
               "run.tensorboard": False, "run.checkpoint_every": 0, **sizes}
        rows = grpolab.train("grpo", cfg).metrics[args.warmup:]
    print(json.dumps({"checkpointing": args.checkpointing,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "step_s": sum(r["time/step_s"] for r in rows) / len(rows),
                      "learn_s": sum(r.get("time/learn_s", 0.0) for r in rows) / len(rows)}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--microbatch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
    results = []
    for on in (False, True):
        cmd = [sys.executable, __file__, *forwarded, "--worker", *(["--checkpointing"] if on else [])]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    off, on = results
    for r in results:
        print(f"gradient_checkpointing={str(r['checkpointing']).lower():5}  peak RSS {r['peak_rss_mb']:7.0f} MB  "
              f"step {r['step_s']:6.2f} s  learning {r['learn_s']:6.2f} s")
    print(f"with / without: peak RSS {on['peak_rss_mb'] / off['peak_rss_mb']:.2f}x, step time "
          f"{on['step_s'] / off['step_s']:.2f}x, learning time {on['learn_s'] / max(off['learn_s'], 1e-9):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
