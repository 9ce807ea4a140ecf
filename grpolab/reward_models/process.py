"""Process reward models: the reward-model architecture of grpolab/reward_models/model.py (a decoder
`*ForSequenceClassification` with one output), trained on a score at EVERY completion token, each
labelled right or wrong against the gold completion (algo/process.py), instead of one pairwise score
at EOS. Its reward is the weakest step's score (`process_scores`).

Training data are StepExamples (prompt, completion, target): any completion, the gold target it is
checked against; the labels come from the two token sequences, so no one annotates steps by hand.
Two step scorers: "head" (the score head at each position, trained by a per-step BCE) and "lm" (a
generative process RM: the step's token log-probability under the backbone's own language model,
trained by −log p at right steps and −log(1 − p) at wrong ones; it keeps what an SFT'd backbone
knows about the next digit). A saved process RM is a reward-model folder whose grpolab_rm.json says
`"kind": "process"` and `"step_scorer"`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from grpolab.algo.process import generative_step_loss, prefix_step_labels, process_scores, process_step_loss
from grpolab.reward_models.model import default_append_eos, encode_texts, pad_right, score_positions

PROCESS_KIND = "process"


@dataclass(frozen=True)
class StepExample:
    """A completion of `prompt` and the gold `target` its steps are checked against."""

    prompt: str
    completion: str
    target: str


def encode_steps(tokenizer, prompts: Sequence[str], completions: Sequence[str], targets: Sequence[str] | None = None,
                 *, append_eos: bool | None = None, pad_id: int):
    """Right-padded ids [N, T] and attention mask of prompt + completion (+ EOS), the step mask [N, T]
    (the completion's tokens and EOS) and, given targets, the target ids aligned with them ([N, T], -1
    past the target's end). The prompt's token count is taken from the prompt alone."""
    eos = default_append_eos(tokenizer) if append_eos is None else append_eos
    seqs = encode_texts(tokenizer, prompts, completions, append_eos=eos)
    first = [len(x) for x in encode_texts(tokenizer, prompts, [""] * len(prompts), append_eos=False)]
    ids, mask = pad_right(seqs, pad_id)
    cols = torch.arange(ids.shape[1])
    steps = mask.bool() & (cols[None] >= torch.tensor(first)[:, None])
    if targets is None:
        return ids, mask, steps, None
    tgt = torch.full_like(ids, -1)
    for i, t in enumerate(encode_texts(tokenizer, prompts, targets, append_eos=eos)):
        n = min(len(t), ids.shape[1])
        tgt[i, :n] = torch.tensor(t[:n])
    return ids, mask, steps, tgt


def step_scores(model, ids: torch.Tensor, mask: torch.Tensor, scorer: str = "head") -> torch.Tensor:
    """[N, T] step scores: scorer "head", the score head at every position (reward_model.score_positions);
    "lm", log p(token t | tokens < t) under the backbone's language model, its logits read through
    the input embeddings (tied-embedding backbones; 0 at position 0)."""
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    if scorer == "head":
        return score_positions(model, ids, mask)[0].cpu()  # differentiable copy off a GPU
    from grpolab.algo.logprobs import token_logprobs

    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    logits = hidden[:, :-1] @ model.get_input_embeddings().weight.T
    logp = token_logprobs(logits.float(), ids[:, 1:])
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1).cpu()


@torch.no_grad()
def score_process(model, tokenizer, prompts: Sequence[str], completions: Sequence[str], *,
                  append_eos: bool | None = None, batch_size: int = 64, scorer: str = "head") -> torch.Tensor:
    """[N] float32: each completion's weakest step score (`step_scores`' scorer), in batches, without grad."""
    was = model.training
    model.eval()
    out = []
    try:
        for s in range(0, len(prompts), batch_size):
            ids, mask, steps, _ = encode_steps(tokenizer, prompts[s:s + batch_size], completions[s:s + batch_size],
                                               append_eos=append_eos, pad_id=model.config.pad_token_id)
            out.append(process_scores(step_scores(model, ids, mask, scorer), steps).float().cpu())
    finally:
        model.train(was)
    return torch.cat(out) if out else torch.zeros(0)


def process_batch_loss(model, tokenizer, batch: Sequence[StepExample], scorer: str = "head") -> torch.Tensor:
    """The mean over `batch` of each example's mean step loss (with grad): the step BCE of the score
    head, or with scorer "lm" −log p at right steps and −log(1 − p) at wrong ones."""
    ids, mask, steps, tgt = encode_steps(tokenizer, [e.prompt for e in batch], [e.completion for e in batch],
                                         [e.target for e in batch], pad_id=model.config.pad_token_id)
    labels = prefix_step_labels(ids, tgt, steps)
    if scorer == "lm":
        return generative_step_loss(step_scores(model, ids, mask, "lm"), labels, steps).mean()
    return process_step_loss(step_scores(model, ids, mask), labels, steps).mean()


def train_process_rm(model, tokenizer, examples: Sequence[StepExample], *, steps: int, batch_size: int,
                     lr: float, seed: int = 0, on_step: Callable[[int, float], None] | None = None,
                     scorer: str = "head") -> list[float]:
    """AdamW (warmup then cosine) on the per-step BCE, batches of fresh seeded shuffles of
    `examples`. Returns each step's loss; the model is left in eval mode."""
    from grpolab.algo.optim import adamw, lr_lambda
    from grpolab.data.stream import shuffled_batches

    if not examples or steps < 1 or batch_size < 1:
        raise ValueError(f"train_process_rm: needs examples, steps >= 1 and batch_size >= 1 "
                         f"(got {len(examples)}, {steps}, {batch_size})")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("cosine", max(1, steps // 10), steps))
    batches = shuffled_batches(examples, batch_size, random.Random(seed))
    losses = []
    model.train()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = process_batch_loss(model, tokenizer, next(batches), scorer)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


def step_accuracy(model, tokenizer, examples: Sequence[StepExample], *, batch_size: int = 128,
                  scorer: str = "head") -> float:
    """Share of the examples' steps whose call matches their label: score > 0 (head) or p > 1/2 (lm)."""
    right = total = 0
    with torch.no_grad():
        for s in range(0, len(examples), batch_size):
            chunk = examples[s:s + batch_size]
            ids, mask, steps, tgt = encode_steps(tokenizer, [e.prompt for e in chunk], [e.completion for e in chunk],
                                                 [e.target for e in chunk], pad_id=model.config.pad_token_id)
            sc = step_scores(model, ids, mask, scorer)
            pred = sc > (0.0 if scorer == "head" else math.log(0.5))
            labels = prefix_step_labels(ids, tgt, steps)
            right += int(((pred == labels) & steps).sum())
            total += int(steps.sum())
    return right / max(total, 1)

