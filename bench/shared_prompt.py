"""model.shared_prompt against the padded rows: one microbatch's log-prob forward, side by side.

    python bench/shared_prompt.py                                  # fixture, bf16, eager
    python bench/shared_prompt.py --compile                        # torch.compile'd (scope 'model')
    python bench/shared_prompt.py --model smollm2 --geometry 11x32,64x32,128x64 --groups 2 --repeats 5
    python bench/shared_prompt.py --model smollm2 --geometry 11x32,64x32 --groups 2 --padding-free

One microbatch of `--groups` GRPO groups of `--group-size` rows: each group's prompt (Lp tokens,
left-padded by 0-2 tokens) and G completions of Lc columns whose real lengths spread over
[Lc/2, Lc]. For each geometry "LpxLc" the padded forward (`completion_logprobs`) and the grouped
one (`group_size=G`) alternate A B A B; the median time of the training forward + backward and of
the no-grad forward is printed for each, with the ratio grouped / padded (< 1: the grouped forward
is faster) and the tokens each feeds the model. --padding-free: both sides forward only real tokens
(`model.padding_free`: packed rows against packed groups).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import model_dir, set_threads  # noqa: E402
from grpolab.forward.compiled import training_module  # noqa: E402
from grpolab.forward import completion_logprobs  # noqa: E402


def microbatch(groups: int, group_size: int, lp: int, lc: int, vocab: int, seed: int = 0):
    """(input_ids, attention_mask) [groups·G, Lp + Lc] laid out as a rollout is."""
    gen = torch.Generator().manual_seed(seed)
    n = groups * group_size
    ids = torch.randint(3, vocab, (n, lp + lc), generator=gen)
    mask = torch.ones(n, lp + lc, dtype=torch.long)
    for u in range(groups):
        rows = slice(u * group_size, (u + 1) * group_size)
        ids[rows, :lp] = ids[u * group_size, :lp]
        mask[rows, : min(u % 3, lp - 1)] = 0  # left padding of the prompt
    lengths = torch.randint(max(1, lc // 2), lc + 1, (n,), generator=gen)
    mask[:, lp:] = (torch.arange(lc) < lengths[:, None]).long()
    return ids, mask


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def compare(model, module, ids, mask, lp, group_size, dtype, repeats: int, padding_free: bool = False) -> dict:
    def step(grouped: bool, grad: bool):
        def run():
            model.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(grad):
                logp, _ = completion_logprobs(module, ids, mask, lp, compute_dtype=dtype, padding_free=padding_free,
                                              group_size=group_size if grouped else None)
                if grad:
                    (logp * mask[:, lp:]).sum().backward()
        return run

    res = {}
    for grad in (True, False):
        for grouped in (False, True):
            timed(step(grouped, grad), 2)  # warm-up (and compilation)
        padded, grouped = [], []
        for _ in range(repeats):  # interleaved A B A B
            padded += timed(step(False, grad), 1)
            grouped += timed(step(True, grad), 1)
        key = "fwd+bwd" if grad else "no-grad"
        res[key] = (statistics.median(padded), statistics.median(grouped))
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--geometry", default="6x32,24x32,48x16",
                   help="comma-separated LpxLc: prompt columns x completion columns")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (scope 'model', dynamic)")
    p.add_argument("--padding-free", action="store_true", help="both sides: only real tokens (model.padding_free)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    set_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(args.model), attn_implementation="sdpa",
                                                 dtype=torch.float32).train()
    module = training_module(model, args.compile, scope="model")
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    g = args.group_size
    print(f"model {args.model}, {args.dtype}, {'compiled' if args.compile else 'eager'}, "
          f"{'padding-free, ' if args.padding_free else ''}"
          f"{args.groups} groups x {g} rows, median of {args.repeats} interleaved runs")
    print(f"{'Lp x Lc':>8} {'tokens padded/grouped':>22} {'pass':>8} {'padded ms':>10} {'grouped ms':>11} {'ratio':>6}")
    for geo in args.geometry.split(","):
        lp, lc = (int(x) for x in geo.lower().split("x"))
        ids, mask = microbatch(args.groups, g, lp, lc, model.config.vocab_size)
        real = mask.bool()
        tokens = (f"{int(real.sum())}/{int(real[::g, :lp].sum() + real[:, lp:].sum())}" if args.padding_free
                  else f"{ids.numel()}/{args.groups * (lp + g * lc)}")
        for key, (a, b) in compare(model, module, ids, mask, lp, g, dtype, args.repeats, args.padding_free).items():
            print(f"{geo:>8} {tokens:>22} {key:>8} {a * 1e3:10.1f} {b * 1e3:11.1f} {b / a:6.2f}", flush=True)


if __name__ == "__main__":
    main()
