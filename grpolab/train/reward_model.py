"""Reward models: a sequence classifier with one output, trained on preference pairs.

Loss (Bradley-Terry, as seed 000 writes it): per pair -log σ(s_chosen - s_rejected); per
optimizer step the mean over the batch's pairs. Batch and microbatch sizes count PAIRS; the
normalizer (batch_size) is fixed before splitting, and each microbatch's loss is its pairs' sum
divided by it, so the accumulated gradient does not depend on the microbatch size
(tests/train/test_reward_model_training.py checks 1 x 8 against 8 x 1). Chosen and rejected texts
of a microbatch go through the model in one forward pass (2m sequences).

Which token is scored: transformers' `*ForSequenceClassification` decoders (Qwen2, Llama, ...)
pool the logit of the RIGHTMOST token whose id is not `config.pad_token_id` (an encoder such as BERT
pools its first token). Sequences are therefore RIGHT-padded here: with a causal model the padding
after the last real token changes nothing before it, so a padded row scores like the same row alone.
The scored text is `prompt + completion`, tokenized as one text (the tokenizer's own special
tokens, e.g. BERT's [CLS]/[SEP], are added unless the text already starts with BOS), then EOS is
appended when the tokenizer has an EOS distinct from its pad token (with pad == eos the pooling
would skip it anyway). The scored token is then EOS, which has seen the whole completion.

A saved reward model is a normal HF folder (config.json, model.safetensors, tokenizer files) plus
`grpolab_rm.json`: `append_eos`, and `score_mean` / `score_std`, the mean and population std of
the model's scores over the chosen AND rejected completions of (up to 1024 of) its training pairs,
measured after training; `RewardModelReward(normalize="fixed")` uses them.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from grpolab.algo.losses import pairwise_logsigmoid
from grpolab.algo.optim import adamw, lr_lambda
from grpolab.data.preferences import PrefPair

RM_INFO_FILE = "grpolab_rm.json"
TINY_BASE = "builtin:tiny"


# --------------------------------------------------------------------------- encoding and scoring


def default_append_eos(tokenizer) -> bool:
    """True when the tokenizer has an EOS token distinct from its pad token (see module docstring)."""
    eos = tokenizer.eos_token_id
    return eos is not None and eos != tokenizer.pad_token_id


def encode_texts(tokenizer, prompts: Sequence[str], completions: Sequence[str], *, append_eos: bool) -> list[list[int]]:
    """Token ids of each `prompt + completion` (plus EOS when append_eos): N lists of ids.

    The texts are tokenized in two batched calls (those that start with BOS, which get no second
    one, and the others), not one call per row."""
    if len(prompts) != len(completions):
        raise ValueError(f"encode_texts: {len(prompts)} prompts but {len(completions)} completions")
    bos, eos = tokenizer.bos_token, tokenizer.eos_token_id
    texts = [prompt + completion for prompt, completion in zip(prompts, completions)]
    out: list[list[int]] = [[] for _ in texts]
    for special in (True, False):
        rows = [i for i, t in enumerate(texts) if bool(bos and t.startswith(bos)) != special]
        if rows:
            encoded = tokenizer([texts[i] for i in rows], add_special_tokens=special)["input_ids"]
            for i, ids in zip(rows, encoded):
                out[i] = list(ids)
    if append_eos:
        for ids in out:
            if not ids or ids[-1] != eos:
                ids.append(eos)
    return out


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pads id lists: returns input_ids [N, T] int64 and attention_mask [N, T] int64 (1 = real)."""
    if any(len(s) == 0 for s in seqs):
        raise ValueError("pad_right: an empty sequence cannot be scored")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


def score_ids(model, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """One forward over right-padded `seqs`. Returns [N] float32 scores (with grad if enabled)."""
    device = next(model.parameters()).device
    ids, mask = pad_right(seqs, model.config.pad_token_id)
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    return out.logits[:, 0].float()


@torch.no_grad()
def score_texts(
    model, tokenizer, prompts: Sequence[str], completions: Sequence[str], *,
    append_eos: bool | None = None, batch_size: int = 64,
) -> torch.Tensor:
    """Scores of `prompt + completion` for each row, in batches, without grad. Returns [N] float32 (CPU)."""
    if batch_size < 1:
        raise ValueError(f"score_texts: batch_size must be >= 1, got {batch_size}")
    eos = default_append_eos(tokenizer) if append_eos is None else append_eos
    seqs = encode_texts(tokenizer, prompts, completions, append_eos=eos)
    was_training = model.training
    model.eval()
    try:
        parts = [score_ids(model, seqs[i : i + batch_size]).cpu() for i in range(0, len(seqs), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(parts) if parts else torch.zeros(0)


# --------------------------------------------------------------------------- building


def _with_pad(tokenizer):
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError("reward model: the tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _set_pad(model, pad_id: int):
    model.config.pad_token_id = pad_id
    model.config.get_text_config().pad_token_id = pad_id
    return model


def rm_from_causal_lm(lm, *, seed: int = 0):
    """A `*ForSequenceClassification` (num_labels=1) with `lm`'s config and backbone weights; the
    score head is new (seeded). `lm` is left unchanged."""
    from transformers import AutoModelForSequenceClassification

    config = type(lm.config).from_dict(lm.config.to_dict())
    config.num_labels = 1
    config.tie_word_embeddings = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    prefix = lm.base_model_prefix
    getattr(rm, prefix).load_state_dict(getattr(lm, prefix).state_dict(), strict=True)
    return rm


def build_reward_model(base: Any, tokenizer, *, seed: int = 0, **tiny_kwargs: Any):
    """A trainable fp32 reward model (one score per sequence), pad_token_id set from `tokenizer`.

    base: "builtin:tiny" (a fresh `build_tiny_model(tokenizer, seed=seed, **tiny_kwargs)` backbone),
        a causal LM object (its config and backbone weights), or a path accepted by
        `grpolab.models.loading.resolve_model_path` (HF folder, .gguf, shortcut) holding a causal LM
        or an encoder, loaded with `AutoModelForSequenceClassification(num_labels=1)`.
    The new score head is drawn under a forked RNG seeded with `seed`.
    """
    tokenizer = _with_pad(tokenizer)
    if isinstance(base, torch.nn.Module):
        return _set_pad(rm_from_causal_lm(base, seed=seed), tokenizer.pad_token_id)
    if base == TINY_BASE:
        from grpolab.models.tiny import build_tiny_model

        return _set_pad(rm_from_causal_lm(build_tiny_model(tokenizer, seed=seed, **tiny_kwargs), seed=seed),
                        tokenizer.pad_token_id)
    if tiny_kwargs:
        raise ValueError(f"build_reward_model: {sorted(tiny_kwargs)} apply only to base={TINY_BASE!r}")
    from transformers import AutoModelForSequenceClassification

    from grpolab.models.loading import resolve_model_path

    path = resolve_model_path(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, use_safetensors=True, local_files_only=True,
            trust_remote_code=False,
        )
    return _set_pad(rm, tokenizer.pad_token_id)


def base_tokenizer(base: str, **tiny_kwargs: Any):
    """The tokenizer that goes with `base`: the built-in char tokenizer for "builtin:tiny", else the
    folder's own (pad = eos when it has no pad token)."""
    if base == TINY_BASE:
        from grpolab.models.tiny import build_char_tokenizer

        return build_char_tokenizer(**tiny_kwargs)
    from grpolab.models.loading import load_tokenizer, resolve_model_path

    return _with_pad(load_tokenizer(resolve_model_path(base)))


# --------------------------------------------------------------------------- training


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


def score_positions(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder RM's score at EVERY position, and the hidden states it reads.

    ids, mask: [N, T] right-padded. Returns (scores [N, T] float32, hidden [N, T, H]); the score
    of a row (what the model's own pooling gives) is scores[i, mask[i].sum() - 1]. Needs a
    `*ForSequenceClassification` decoder with a `score` head (Qwen2, Llama, Mistral, ...)."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Module) or not hasattr(model, "base_model"):
        raise ValueError(f"reward model: lm_coef / divergence_coef need a decoder sequence classifier with "
                         f"a `score` head (Qwen2, Llama, ...); {type(model).__name__} has none")
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    return head(hidden)[..., 0].float(), hidden


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
    scores = _pair_scores(model, tokenizer, pairs[:max_pairs], scorer)
    return float(scores.mean()), float(scores.std(correction=0))


def _pair_scores(model, tokenizer, pairs: Sequence[PrefPair], scorer: Callable | None = None) -> torch.Tensor:
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
    scores = _pair_scores(model, tokenizer, sub, scorer)
    labels = torch.cat([torch.ones(len(sub)), torch.zeros(len(sub))])
    return [float(x) for x in fit_logistic(scores, labels)]


# --------------------------------------------------------------------------- saving and loading


def save_reward_model(model, tokenizer, out_dir: str | Path, *, info: dict[str, Any] | None = None,
                      pairs: Sequence[PrefPair] | None = None) -> Path:
    """Writes an HF folder (config.json, model.safetensors, tokenizer files) plus RM_INFO_FILE
    (`append_eos` and `info`, e.g. score_mean/score_std, lm_coef, divergence_coef) and, given
    `pairs`, the training pairs (train_pairs.jsonl: what rm_refresh replays to continue training
    without forgetting). Written to a temporary folder, then
    renamed; an existing `out_dir` is replaced only if it is empty, a reward-model folder, or holds
    only the run.json of the command that claimed it (kept)."""
    from grpolab.train.rundir import RUN_FILE

    out = Path(out_dir).expanduser()
    claimed_only = out.is_dir() and {p.name for p in out.iterdir()} <= {RUN_FILE}  # `grpolab rm` claimed it
    if out.exists() and not claimed_only and (not out.is_dir() or not (out / RM_INFO_FILE).is_file()):
        raise FileExistsError(f"reward model output {out} exists and is not a reward-model folder; "
                              "choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {"append_eos": default_append_eos(tokenizer), **(info or {})}
        (tmp / RM_INFO_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if pairs:
            from grpolab.train.rm_refresh import write_train_pairs

            write_train_pairs(tmp, pairs)
        if (out / RUN_FILE).is_file():
            shutil.copy2(out / RUN_FILE, tmp / RUN_FILE)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_reward_model(path: str | Path, device: str | torch.device = "cpu", *, dtype: torch.dtype = torch.float32):
    """(model in eval mode on `device`, tokenizer, info dict from RM_INFO_FILE or {}) of a saved RM.

    Raises FileNotFoundError naming the path when it is missing or not an HF model folder, and
    ValueError when the model has more than one output.
    """
    from transformers import AutoModelForSequenceClassification

    from grpolab.models.loading import load_tokenizer, refuse_custom_code

    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"reward model not found: {p} is not a folder (train one with `grpolab rm`)")
    if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise FileNotFoundError(f"reward model folder {p} has no config.json or *.safetensors weights")
    refuse_custom_code(p)
    model = AutoModelForSequenceClassification.from_pretrained(
        p, dtype=dtype, use_safetensors=True, local_files_only=True, trust_remote_code=False
    )
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {p}: num_labels={model.config.num_labels}; a reward model has one output")
    tokenizer = _with_pad(load_tokenizer(p))
    if model.config.pad_token_id is None:
        _set_pad(model, tokenizer.pad_token_id)
    info_file = p / RM_INFO_FILE
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    return model.to(device).eval(), tokenizer, info


# --------------------------------------------------------------------------- helpers


@contextmanager
def torch_threads(n: int | None):
    """Sets torch's intra-op thread count for the block (None: unchanged), then restores it."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
