"""Training reward models on preference pairs, and measuring them on pairs.

Loss (Bradley-Terry, as the GRPO loop with two reward models writes it): per pair -log σ(s_chosen - s_rejected); per
optimizer step the mean over the batch's pairs. Batch and microbatch sizes count PAIRS; the
normalizer (batch_size) is fixed before splitting, and each microbatch's loss is its pairs' sum
divided by it, so the accumulated gradient does not depend on the microbatch size
(tests/reward_models/test_reward_model_training.py checks 1 x 8 against 8 x 1). Chosen and rejected texts
of a microbatch go through the model in one forward pass (2m sequences).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from grpolab.algo.losses import pairwise_logsigmoid
from grpolab.algo.optim import adamw, lr_lambda
from grpolab.data.preferences import PrefPair
from grpolab.reward_models.model import default_append_eos, encode_texts, pad_right, score_ids, score_positions, score_texts


@dataclass
class RMResult:
    train_losses: list[float]
    """Loss (mean over the batch's pairs) of every optimizer step."""
    heldout_accuracy: float | None
    """Share of eval pairs with s_chosen > s_rejected (None without eval pairs)."""
    heldout_margin: float | None
    """Mean s_chosen - s_rejected over the eval pairs."""
    seconds: float = 0.0


def accumulate_pair_gradients(
    model, tokenizer, batch: Sequence[PrefPair], *, microbatch_size: int, append_eos: bool | None = None,
    lm_coef: float = 0.0, divergence_coef: float = 0.0,
) -> float:
    """Adds to `.grad` the gradient of mean_i loss_i over `batch`, in microbatches of
    `microbatch_size` pairs (one forward each, chosen and rejected together). Returns the batch loss.
    The caller zeroes the gradients and steps the optimizer.

    loss_i = -log σ(s_chosen_i - s_rejected_i)
             + divergence_coef * (the same at the first token where the two texts part; see
               algo.losses.divergence_pairwise_logsigmoid)
             + lm_coef * (mean next-token NLL of the chosen completion, logits read through the
               input embeddings: an auxiliary LM loss that keeps the backbone predicting good
               completions). The two extra terms need a decoder RM (`score_positions`)."""
    eos = default_append_eos(tokenizer) if append_eos is None else append_eos
    dense = lm_coef > 0 or divergence_coef > 0
    normalizer = len(batch)  # fixed before splitting: gradients do not depend on the microbatch size
    total = 0.0
    for start in range(0, len(batch), microbatch_size):
        micro = batch[start : start + microbatch_size]
        m = len(micro)
        seqs = encode_texts(tokenizer, [p.prompt for p in micro] * 2,
                            [p.chosen for p in micro] + [p.rejected for p in micro], append_eos=eos)
        if not dense:
            scores = score_ids(model, seqs)  # [2m]: chosen rows, then rejected rows
            loss = pairwise_logsigmoid(scores[:m], scores[m:])
        else:
            loss = _dense_pair_loss(model, tokenizer, micro, seqs, lm_coef, divergence_coef)
        loss = loss.sum() / normalizer
        loss.backward()
        total += float(loss.detach())
    return total


def _dense_pair_loss(model, tokenizer, micro: Sequence[PrefPair], seqs, lm_coef: float,
                     divergence_coef: float) -> torch.Tensor:
    """Per-pair loss [m] with the divergence and LM terms (see accumulate_pair_gradients)."""
    from grpolab.algo.losses import divergence_pairwise_logsigmoid
    from grpolab.algo.logprobs import sequence_logprob, token_logprobs

    m = len(micro)
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in pad_right(seqs, model.config.pad_token_id))
    pos_scores, hidden = score_positions(model, ids, mask)
    rows = torch.arange(2 * m, device=device)
    scores = pos_scores[rows, mask.sum(1) - 1]
    loss = pairwise_logsigmoid(scores[:m], scores[m:])
    if divergence_coef > 0:
        loss = loss + divergence_coef * divergence_pairwise_logsigmoid(
            pos_scores[:m], pos_scores[m:], ids[:m], ids[m:], mask[:m], mask[m:])
    if lm_coef > 0:
        emb = model.get_input_embeddings().weight
        logits = hidden[:m, :-1] @ emb.T  # position t predicts token t+1
        logp = token_logprobs(logits.float(), ids[:m, 1:])
        first = torch.tensor(_prompt_lens(tokenizer, [p.prompt for p in micro]), device=device)
        cols = torch.arange(1, ids.shape[1], device=device)
        counts = mask[:m, 1:].bool() & (cols[None] >= first[:, None])  # completion tokens (and EOS)
        loss = loss - lm_coef * sequence_logprob(logp, counts, mean=True)
    return loss


def _prompt_lens(tokenizer, prompts: Sequence[str]) -> list[int]:
    """Token counts of each prompt alone, as encode_texts tokenizes it (special tokens included)."""
    return [len(ids) for ids in encode_texts(tokenizer, prompts, [""] * len(prompts), append_eos=False)]


def _batches(pairs: Sequence[PrefPair], batch_size: int, rng: random.Random):
    """Endless batches walking seeded shuffles of `pairs` (reshuffled each pass)."""
    from grpolab.data.stream import shuffled_batches

    return shuffled_batches(pairs, batch_size, rng)


def train_reward_model(
    model,
    tokenizer,
    pairs: Sequence[PrefPair],
    *,
    steps: int | None = None,
    epochs: float | None = None,
    batch_size: int = 8,
    microbatch_size: int = 1,
    lr: float = 1e-5,
    seed: int = 0,
    warmup_steps: int | None = None,
    max_grad_norm: float = 1.0,
    eval_pairs: Sequence[PrefPair] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    lm_coef: float = 0.0,
    divergence_coef: float = 0.0,
) -> RMResult:
    """Trains `model` in place with AdamW (no weight decay), linear warmup then cosine decay.

    Give `steps` (optimizer steps) or `epochs` (passes over `pairs`: steps = ceil(epochs*len/batch)).
    batch_size / microbatch_size count pairs; batch_size must be a multiple of microbatch_size.
    lm_coef, divergence_coef: weights of the auxiliary terms (see accumulate_pair_gradients).
    """
    if lm_coef < 0 or divergence_coef < 0:
        raise ValueError(f"train_reward_model: lm_coef and divergence_coef must be >= 0, got {lm_coef}, "
                         f"{divergence_coef}")
    if (steps is None) == (epochs is None):
        raise ValueError("train_reward_model: give exactly one of steps or epochs")
    if not pairs:
        raise ValueError("train_reward_model: no training pairs")
    if microbatch_size < 1 or batch_size % microbatch_size:
        raise ValueError(f"train_reward_model: batch_size={batch_size} is not a multiple of "
                         f"microbatch_size={microbatch_size}")
    if steps is None:
        steps = math.ceil(epochs * len(pairs) / batch_size)
    t0 = time.perf_counter()
    warmup = max(1, steps // 10) if warmup_steps is None else warmup_steps
    batches = _batches(pairs, batch_size, random.Random(seed))
    losses = train_reward_pairs(model, tokenizer, (next(batches) for _ in range(steps)), lr=lr,
                                schedule=lr_lambda("cosine", warmup, steps), microbatch_size=microbatch_size,
                                max_grad_norm=max_grad_norm, on_step=on_step, lm_coef=lm_coef,
                                divergence_coef=divergence_coef)
    acc = margin = None
    if eval_pairs:
        acc, margin = evaluate_pairs(model, tokenizer, eval_pairs)
    return RMResult(losses, acc, margin, time.perf_counter() - t0)


def train_reward_pairs(
    model, tokenizer, batches: Iterable[Sequence[PrefPair]], *, lr: float, schedule: Callable[[int], float] | None = None,
    microbatch_size: int | None = None, max_grad_norm: float = 1.0, on_step: Callable[[int, float], None] | None = None,
    lm_coef: float = 0.0, divergence_coef: float = 0.0,
) -> list[float]:
    """One AdamW step (no weight decay, gradient clipped to max_grad_norm) per batch of pairs, the
    learning rate lr × schedule(step) (constant without one); the model is left in eval mode.
    microbatch_size: pairs per forward (None = the whole batch). Returns each step's loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule is not None else None
    losses = []
    model.train()
    for step, batch in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = accumulate_pair_gradients(model, tokenizer, batch, microbatch_size=microbatch_size or len(batch),
                                         lm_coef=lm_coef, divergence_coef=divergence_coef)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss)
        if on_step is not None:
            on_step(step, loss)
    model.eval()
    return losses


def pair_margins(model, tokenizer, pairs: Sequence[PrefPair], *, batch_size: int = 128) -> torch.Tensor:
    """s_chosen - s_rejected of each pair, without grad. Returns [N] float32 (CPU)."""
    if not pairs:
        raise ValueError("pair_margins: no pairs")
    prompts = [p.prompt for p in pairs]
    chosen = score_texts(model, tokenizer, prompts, [p.chosen for p in pairs], batch_size=batch_size)
    rejected = score_texts(model, tokenizer, prompts, [p.rejected for p in pairs], batch_size=batch_size)
    return chosen - rejected


def evaluate_pairs(model, tokenizer, pairs: Sequence[PrefPair], *, batch_size: int = 128) -> tuple[float, float]:
    """(pairwise accuracy: share with s_chosen > s_rejected, strictly; mean s_chosen - s_rejected)."""
    diff = pair_margins(model, tokenizer, pairs, batch_size=batch_size)
    return float((diff > 0).float().mean()), float(diff.mean())


def score_stats(model, tokenizer, pairs: Sequence[PrefPair], *, max_pairs: int = 1024,
                scorer: Callable | None = None) -> tuple[float, float]:
    """(mean, population std) of the scores (scorer: score_texts by default) of the chosen and
    rejected completions of the first `max_pairs` pairs: the "fixed" normalization of RewardModelReward."""
    scores = pair_scores(model, tokenizer, pairs[:max_pairs], scorer)
    return float(scores.mean()), float(scores.std(correction=0))


def pair_scores(model, tokenizer, pairs: Sequence[PrefPair], scorer: Callable | None = None) -> torch.Tensor:
    """[2n]: the chosen completions' scores, then the rejected ones' (scorer: score_texts by default)."""
    sub = list(pairs)
    return (scorer or score_texts)(model, tokenizer, [p.prompt for p in sub] * 2,
                                   [p.chosen for p in sub] + [p.rejected for p in sub])


def fit_calibration(model, tokenizer, pairs: Sequence[PrefPair], *, max_pairs: int = 1024,
                    scorer: Callable | None = None) -> list[float]:
    """(a, b) of P(good | s) = σ(a·s + b), a logistic fit of the first `max_pairs` pairs' chosen
    (good) and rejected (bad) scores: RewardModelReward's "calibrated" normalization."""
    from grpolab.algo.calibration import fit_logistic

    sub = list(pairs[:max_pairs])
    scores = pair_scores(model, tokenizer, sub, scorer)
    labels = torch.cat([torch.ones(len(sub)), torch.zeros(len(sub))])
    return [float(x) for x in fit_logistic(scores, labels)]
