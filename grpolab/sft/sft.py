"""SFT: token cross-entropy on (prompt, completion) pairs, as the SFT-to-GRPO spectrum writes it.

Loss = mean over responses of (mean over each response's tokens of -log π). One optimizer step per
batch of `batch_size` sequences, accumulated over microbatches; the normalizer (the batch's
sequence count) is fixed before splitting, so the gradient does not depend on the microbatch size.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Sequence

import torch

from grpolab.algo.losses import agg_normalizer, sft_nll
from grpolab.data.collate import pack_pairs
from grpolab.data.stream import shuffled_batches
from grpolab.forward import completion_logprobs
from grpolab.algo.optim import adamw, lr_lambda
from grpolab.data.arith import BUILTIN_SFT_EXAMPLES


def train_sft(
    model,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    microbatch_size: int,
    lr: float,
    seed: int = 0,
    compute_dtype=None,
    on_step: Callable[[int, float], None] | None = None,
    stop_when: Callable[[int], bool] | None = None,
    check_every: int = 25,
) -> list[float]:
    """Trains `model` in place; returns the loss of every optimizer step.

    stop_when(step) is asked every `check_every` steps; True ends training early.
    Batches are drawn by walking a seeded shuffle of `pairs` (reshuffled each pass).
    """
    if batch_size % microbatch_size:
        raise ValueError(f"sft: batch_size={batch_size} is not a multiple of microbatch_size={microbatch_size}")
    device = next(model.parameters()).device
    opt = adamw([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("cosine", max(1, steps // 20), steps))
    batches = shuffled_batches(pairs, batch_size, random.Random(seed))
    losses = []
    model.train()
    for step in range(steps):
        batch = next(batches)
        packed = pack_pairs(tokenizer, [p for p, _ in batch], [c for _, c in batch])
        normalizer = agg_normalizer(packed.loss_mask, "seq-mean-token-mean")
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for idx in torch.arange(batch_size).split(microbatch_size):
            micro = packed.select(idx)
            logp, _ = completion_logprobs(model, micro.input_ids.to(device), micro.attention_mask.to(device),
                                          micro.prompt_len, compute_dtype=compute_dtype)
            loss = sft_nll(logp, micro.loss_mask.to(device), normalizer.to(device))
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total)
        if on_step is not None:
            on_step(step, total)
        if stop_when is not None and (step + 1) % check_every == 0:
            model.eval()
            stop = stop_when(step)
            model.train()
            if stop:
                break
    return losses


def progress_printer(steps: int, say: Callable[[str], None] = print,
                     every: int | None = None) -> Callable[[int, float], None]:
    """An `on_step` for train_sft that says "[sft] step i/N loss L, S s/step, elapsed E, ETA T" at step 1,
    every `every` steps (default: a tenth of the run, at most 50) and the last; the time per step is
    the mean since the first step began."""
    from grpolab.report.progress import format_duration

    every = every or max(1, min(50, steps // 10))
    t0 = time.perf_counter()

    def on_step(i: int, loss: float) -> None:
        n = i + 1
        if n == 1 or n % every == 0 or n == steps:
            elapsed = time.perf_counter() - t0
            per = elapsed / n
            say(f"[sft] step {n}/{steps} loss {loss:.4f}, {per:.3f} s/step, elapsed {format_duration(elapsed)}, "
                f"ETA {format_duration(per * (steps - n))}")

    return on_step


def sft_builtin(model, tokenizer, task, cfg, say: Callable[[str], None] = print) -> list[float]:
    """SFT of `model` on the built-in task's TRAINING side as `cfg.sft` says: `examples` (None:
    BUILTIN_SFT_EXAMPLES) drawn with
    `refusal_examples` refusals (of `refusal_kinds`), stopping early once greedy accuracy on a probe
    of `probe_prompts` training-side prompts reaches `stop_at_accuracy` (checked every `probe_every`
    steps; 0 = run all `steps`). Held-out prompts are never looked at. It computes in float32 whatever
    model.dtype says (the tiny model's π0 is the same on every CPU kind). Returns the step losses."""
    from grpolab.rollout.hf import HFEngine
    from grpolab.evaluation.evaluate import evaluate_arith

    sc, seed = cfg.sft, cfg.train.seed
    pairs = task.sft_examples(random.Random(seed), sc.examples or BUILTIN_SFT_EXAMPLES,
                              refusal_examples=sc.refusal_examples, answer_noise=sc.answer_noise,
                              refusal_kinds=sc.refusal_kinds or None)
    say(f"[sft] {len(pairs)} examples ({sc.refusal_examples} refusals), at most {sc.steps} steps")
    t = time.perf_counter()
    on_step = progress_printer(sc.steps, say)

    stop_when = None
    if sc.stop_at_accuracy > 0:
        probe = [it for it in task.train_prompts(random.Random(seed + 7), 4 * sc.probe_prompts)
                 if it.meta["answerable"]][: sc.probe_prompts]
        engine = HFEngine(tokenizer, cfg.rollout.max_new_tokens)

        def probe_reached(i):
            acc = evaluate_arith(model, engine, probe)["accuracy"]
            say(f"[sft] step {i + 1}: training-side probe accuracy {acc:.3f}")
            return acc >= sc.stop_at_accuracy

        stop_when = probe_reached

    losses = train_sft(model, tokenizer, pairs, steps=sc.steps, batch_size=sc.batch_size,
                       microbatch_size=sc.microbatch_size, lr=sc.lr, seed=seed, on_step=on_step,
                       stop_when=stop_when, check_every=sc.probe_every)
    say(f"[sft] done after {len(losses)} steps ({time.perf_counter() - t:.0f} s)")
    return losses
