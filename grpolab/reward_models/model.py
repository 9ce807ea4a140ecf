"""Reward models: a sequence classifier with one output, scored on `prompt + completion`; building,
saving and loading one (training: grpolab/reward_models/training.py).

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
import os
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

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

    from grpolab.models.loading import read_weights, resolve_model_path

    path = resolve_model_path(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = read_weights("reward model base", path, lambda: AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32, use_safetensors=True, local_files_only=True,
            trust_remote_code=False,
        ))
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


# --------------------------------------------------------------------------- saving and loading


TRAIN_PAIRS_FILE = "train_pairs.jsonl"
"""In a saved RM folder: the pairs it was trained on (what a refresh replays)."""


def load_train_pairs(path: str | Path) -> list[PrefPair]:
    """The pairs a saved RM folder was trained on (TRAIN_PAIRS_FILE), [] when it has none."""
    f = Path(path) / TRAIN_PAIRS_FILE
    if not f.is_file():
        return []
    return [PrefPair(**json.loads(line)) for line in f.read_text().splitlines() if line.strip()]


MAX_SAVED_PAIRS = 20_000
"""At most this many training pairs are kept in an RM folder (a seeded sample of larger sets): enough
to replay against forgetting without copying a whole preference dataset."""


def write_train_pairs(path: str | Path, pairs: Sequence[PrefPair]) -> None:
    """Saves `pairs` (a seeded sample of MAX_SAVED_PAIRS when there are more) as the RM folder's
    TRAIN_PAIRS_FILE (one JSON object per line)."""
    if len(pairs) > MAX_SAVED_PAIRS:
        pairs = random.Random(0).sample(list(pairs), MAX_SAVED_PAIRS)
    with open(Path(path) / TRAIN_PAIRS_FILE, "w") as f:
        for p in pairs:
            f.write(json.dumps(asdict(p)) + "\n")




def save_reward_model(model, tokenizer, out_dir: str | Path, *, info: dict[str, Any] | None = None,
                      pairs: Sequence[PrefPair] | None = None) -> Path:
    """Writes an HF folder (config.json, model.safetensors, tokenizer files) plus RM_INFO_FILE
    (`append_eos` and `info`, e.g. score_mean/score_std, lm_coef, divergence_coef) and, given
    `pairs`, the training pairs (train_pairs.jsonl: what rm_refresh replays to continue training
    without forgetting). Written to a temporary folder, then
    renamed; an existing `out_dir` is replaced only if it is empty, a reward-model folder, or holds
    only the run.json and lock file of the command that claimed it (kept: the lock file is moved into
    the new folder, its lock still held)."""
    from grpolab.manifest import write_manifest
    from grpolab.rundir.lock import LOCK_FILE
    from grpolab.rundir.rundir import RUN_FILE

    out = Path(out_dir).expanduser()
    claimed_only = out.is_dir() and {p.name for p in out.iterdir()} <= {RUN_FILE, LOCK_FILE}  # `grpolab rm` claimed it
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
            write_train_pairs(tmp, pairs)
        write_manifest(tmp)
        if (out / RUN_FILE).is_file():
            shutil.copy2(out / RUN_FILE, tmp / RUN_FILE)
        if (out / LOCK_FILE).is_file():
            os.rename(out / LOCK_FILE, tmp / LOCK_FILE)  # the same file: a lock on it stays held
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

    from grpolab.manifest import check_manifest
    from grpolab.models.loading import load_tokenizer, read_weights, refuse_custom_code

    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"reward model not found: {p} is not a folder (train one with `grpolab rm`)")
    if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
        raise FileNotFoundError(f"reward model folder {p} has no config.json or *.safetensors weights")
    refuse_custom_code(p)
    check_manifest(p, "reward model")
    model = read_weights("reward model", p, lambda: AutoModelForSequenceClassification.from_pretrained(
        p, dtype=dtype, use_safetensors=True, local_files_only=True, trust_remote_code=False
    ))
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {p}: num_labels={model.config.num_labels}; a reward model has one output")
    tokenizer = _with_pad(load_tokenizer(p))
    if model.config.pad_token_id is None:
        _set_pad(model, tokenizer.pad_token_id)
    info_file = p / RM_INFO_FILE
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    return model.to(device).eval(), tokenizer, info
