"""The built-in tiny causal LM and its character tokenizer: everything `grpolab demo` needs, offline.

- `build_char_tokenizer` makes a character-level tokenizer (one id per character, a fixed alphabet)
  with the `tokenizers` library, wrapped as a transformers fast tokenizer, so it saves and loads
  with `save_pretrained` / `AutoTokenizer.from_pretrained` like any hub tokenizer.
- `build_tiny_model` makes a freshly initialised, seeded Qwen2 (or Llama) causal LM sized to it.

Both are plain transformers objects: the rest of grpolab treats them like any other HF model.
"""

from __future__ import annotations

import re

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPECIAL_TOKENS = (PAD, EOS, BOS)  # ids 0, 1, 2 in this order
BASE_ALPHABET = "0123456789+-*/=?() abcdefghijklmnopqrstuvwxyz"
WORDS = ("cannot",)  # whole-word tokens: the built-in task's refusal

_ARCHS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


def char_alphabet(extra_chars: str = "") -> str:
    """The tokenizer's characters in id order (after the 3 special tokens); duplicates dropped."""
    for ch in extra_chars:
        if ch == "\n" or ch == "\r":
            raise ValueError(f"extra_chars: line breaks are not supported (got {ch!r})")
    return "".join(dict.fromkeys(BASE_ALPHABET + extra_chars))


def build_char_tokenizer(extra_chars: str = "", *, model_max_length: int = 64,
                         words: tuple[str, ...] = WORDS) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over a fixed alphabet, plus a few whole-word tokens.

    Vocabulary: `<pad>`=0, `<eos>`=1, `<bos>`=2, then one id per character of
    `BASE_ALPHABET + extra_chars` (digits, `+-*/=?() `, a-z, then extras). Encoding adds no special
    tokens ("12+7=" -> 5 ids); decoding joins characters with nothing in between. Left padding.
    A character outside the alphabet makes the backend raise; use `encode_checked` for a clear error.
    `words` (default: the refusal "cannot") get one token each, after the characters, as a BPE
    vocabulary would give them: a tiny char model otherwise misspells a word it sees rarely
    ("cnnnot"), and GRPO can then hardly ever sample the exact refusal.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in char_alphabet(extra_chars):
        vocab[ch] = len(vocab)
    for w in words:
        vocab.setdefault(w, len(vocab))
    # The unk token is deliberately not in the vocabulary: an unknown char errors, never maps silently.
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk-not-in-vocab>"))
    pattern = "|".join([re.escape(w) for w in sorted(words, key=len, reverse=True)] + ["."])
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def encode_checked(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Token ids of `text` (no special tokens added); ValueError naming the first unknown character.

    Works for any tokenizer whose vocabulary holds single characters (the char tokenizer above).
    """
    vocab = tokenizer.get_vocab()
    for pos, ch in enumerate(text):
        if ch not in vocab:
            raise ValueError(
                f"encode_checked: character {ch!r} at position {pos} of {text!r} is not in the "
                f"tokenizer's alphabet; add it with build_char_tokenizer(extra_chars=...)"
            )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.decode(ids) != text or any(i in tokenizer.all_special_ids for i in ids):
        # e.g. a special-token string such as "<eos>" written in the text
        raise ValueError(f"encode_checked: {text!r} does not encode to plain character/word tokens")
    return ids


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_positions: int = 64,
    seed: int = 0,
    arch: str = "qwen2",
) -> PreTrainedModel:
    """A freshly initialised fp32 causal LM (Qwen2ForCausalLM or LlamaForCausalLM) for `tokenizer`.

    vocab = len(tokenizer); tied input/output embeddings; pad/eos/bos ids from the tokenizer;
    `intermediate_size` defaults to 3 * hidden_size (SwiGLU MLP). The weights depend only on `seed`
    (drawn under a forked torch RNG: the caller's global RNG state is left unchanged).
    With the defaults and the char tokenizer: about 0.86M parameters.
    """
    if arch not in _ARCHS:
        raise ValueError(f"build_tiny_model: arch must be one of {sorted(_ARCHS)}, got {arch!r}")
    if hidden_size % num_heads:
        raise ValueError(f"build_tiny_model: hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(tokenizer, name) is None:
            raise ValueError(f"build_tiny_model: the tokenizer has no {name}")
    config_cls, model_cls = _ARCHS[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size or 3 * hidden_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        use_cache=True,
    )
    with torch.random.fork_rng(devices=[]):
        model = _instantiate(model_cls, config, seed)
    model = model.to(torch.float32)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = (
        tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id,
    )
    return model


def _instantiate(model_cls, config, seed: int) -> PreTrainedModel:
    """Builds the model (seeded) with SDPA attention, or eager attention where SDPA is unavailable."""
    try:
        torch.manual_seed(seed)
        return model_cls._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    except (ValueError, ImportError):
        torch.manual_seed(seed)
        return model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)


def count_params(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    seen: dict[int, int] = {}
    for p in model.parameters():  # parameters() already deduplicates shared tensors
        if trainable_only and not p.requires_grad:
            continue
        seen[id(p)] = p.numel()
    return sum(seen.values())
