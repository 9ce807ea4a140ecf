"""The default generation engine (`rollout.engine=hf`): Hugging Face model, KV cache, our own sampling loop.

What it does beyond `model.generate`:
- prefills each prompt ONCE and expands its KV cache to the G samples of its group;
- drops finished sequences from the decode batch (the cache is compacted), so late steps only
  pay for the rows still generating;
- keeps the KV cache in buffers allocated once (rollout/cache.py) and, under bf16 autocast, casts
  the weights once per call instead of once per decode step (the eager loop: autocast's weight
  cache; the compiled loop re-casts at every step unless `bf16_weights` samples from a bf16 copy);
- with `packed_weights`, on a CPU in float32, multiplies by oneDNN-packed weights (rollout/packed.py);
- samples with an explicit torch.Generator, so a run is reproducible and resumable;
- returns the `Rollout` layout the trainer uses (prompt | completion, masks, truncated flags).
"""

from __future__ import annotations

import contextlib
import functools
import gc

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grpolab.forward.attention import autocast, use_fast_cpu_attention
from grpolab.models.loading import frozen_copy
from grpolab.rollout import static
from grpolab.rollout.cache import new_decode_cache
from grpolab.rollout.packed import packed_linears
from grpolab.rollout.sampling import greedy_tokens, sample_tokens
from grpolab.batch import Rollout, position_ids
from grpolab.memory import release_free_memory


@dataclass
class HFEngine:
    tokenizer: object
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    compute_dtype: torch.dtype | None = None
    preallocate_cache: bool = True
    """KV cache allocated once per batch and written in place (rollout/cache.py); False = the
    model's own DynamicCache (same samples, slower)."""
    compile: bool = False
    """Decode with a static KV cache and a torch.compile'd step (rollout/static.py): pays on small,
    overhead-bound models over a run of same-size rollouts; falls back to the eager loop for a
    model without a StaticCache."""
    bf16_weights: bool = False
    """With compute_dtype bfloat16: sample from `frozen_copy(model, bfloat16)`, made per call."""
    packed_weights: bool = False
    """The eager loop, float32 on a CPU: linear layers multiply by oneDNN-packed copies of their
    weights, made per call (rollout/packed.py). Ignored elsewhere (the compiled loop traces the model)."""
    model: torch.nn.Module | None = None
    """The policy that `generate` samples from (shared with the trainer: no copy of its weights)."""
    weight_version: int = 0
    """Optimizer phases behind the sampled weights (`load_weights`)."""
    _released: list = field(default_factory=list, repr=False)
    """(parameter, bytes) of the weights `release_weights` freed, until `load_weights` fills them again."""

    def generate(self, prompts: Sequence[str], group_size: int, *, generator: torch.Generator | None = None,
                 greedy: bool = False) -> Rollout:
        """`Engine.generate`: G completions per prompt from `model`, N = len(prompts) × G rows."""
        if self.model is None:
            raise ValueError("HFEngine.generate: no model to sample from; build the engine with model=... "
                             "or call generate_with(model, ...)")
        if self._released:
            raise RuntimeError("HFEngine.generate: the weights were released; load_weights must come first")
        return self.generate_with(self.model, prompts, group_size, generator=generator, greedy=greedy)

    def decode(self, rollout: Rollout) -> list[str]:
        """`Engine.decode`: completion texts, cut at the first EOS (EOS not included)."""
        return decode_completions(self.tokenizer, rollout)

    def load_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """`Engine.load_weights`. The engine samples from the trainer's policy itself, whose state
        `state` normally is (then only the version is recorded); other tensors are copied in, one
        item at a time as `state` yields them (an FSDP2 policy's full weights are gathered lazily)."""
        if self.model is None:
            raise ValueError("HFEngine.load_weights: no model to load the weights into")
        self._restore_storage()
        own = self.model.state_dict()
        unknown = [k for k in state if k not in own]
        if unknown or len(state) != len(own):
            raise ValueError(f"HFEngine.load_weights: the weights do not fit the engine's model (unknown: "
                             f"{unknown[:5]}, {len(state)} tensors for {len(own)})")
        with torch.no_grad():
            for key in state:
                value = state[key]
                if value.data_ptr() != own[key].data_ptr():
                    own[key].copy_(value)
        self.weight_version = version

    @property
    def released(self) -> bool:
        """Whether `release_weights` freed the weights and no `load_weights` has filled them yet."""
        return bool(self._released)

    def release_weights(self) -> None:
        """Frees the memory of the engine's own weight copy until the next `load_weights` fills it again
        (FSDP2: the full sampling copy is idle while the sharded policy learns). Only for an engine
        that samples from a copy of its own: never call it on one that shares the trainer's policy."""
        if self.model is None or self._released:
            return
        seen = set()
        for p in self.model.parameters():
            storage = p.untyped_storage()
            if storage.data_ptr() not in seen:  # tied weights: one storage, freed once
                seen.add(storage.data_ptr())
                self._released.append((storage, storage.nbytes()))
        for storage, _ in self._released:
            storage.resize_(0)
        release_free_memory()

    def _restore_storage(self) -> None:
        for storage, nbytes in self._released:
            storage.resize_(nbytes)
        self._released = []

    def encode_prompts(self, prompts: Sequence[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids [P, Lp] and attention mask [P, Lp] bool (left whatever the tokenizer's
        own padding side: the next token of every row is read from the last column)."""
        enc = self.tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left",
                             add_special_tokens=False)
        return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()

    @torch.no_grad()
    def generate_with(
        self,
        model: torch.nn.Module,
        prompts: Sequence[str],
        group_size: int,
        generator: torch.Generator | None = None,
        greedy: bool = False,
    ) -> Rollout:
        """G completions for each prompt, sampled from `model` (any model with this engine's
        tokenizer). Returns a Rollout with N = len(prompts) × G rows."""
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        sampler, compiles = model, False
        use_fast_cpu_attention(model, self.compute_dtype, device)  # bf16 CPU: the compiled loop's decode_attention
        try:
            if self.bf16_weights and self.compute_dtype == torch.bfloat16:
                sampler = frozen_copy(model, torch.bfloat16)  # freed when this call returns
            ids, am = self.encode_prompts(prompts, device)
            cache_width = static.prompt_width(ids.shape[1]) + self.max_new_tokens
            compiles = self.compile and static.compiles_now(
                (ids.shape[0] * group_size, cache_width, self.compute_dtype, self.bf16_weights))
            # one autocast region around the whole loop: autocast caches its bf16 copy of the
            # weights until the outermost region exits, so they are cast once, not at every step
            with autocast(self.compute_dtype, str(device)):
                out = self._decode_static(sampler, ids, am, group_size, generator, greedy) if self.compile else None
                if out is None:
                    with self._packing(sampler, ids.shape[0] * group_size):
                        out = self._decode(sampler, ids, am, group_size, generator, greedy)
                comp, samp_lp, finished = out
        finally:
            model.train(was_training)
            sampler = None  # a bf16 copy is freed before the trim below
        if compiles:
            gc.collect()  # the compilation's reference cycles held the static cache (static.compiles_now)
        if device.type == "cpu":
            release_free_memory()  # the KV cache is gone: hand its pages back before learning
        return build_rollout(ids, am, comp, samp_lp, finished, group_size, self._eos_id()).replace(
            weight_version=self.weight_version)

    def _packing(self, model, rows: int):
        """`packed_linears` for the eager loop when `packed_weights` applies, else a no-op context."""
        if self.packed_weights and self.compute_dtype in (None, torch.float32):
            return packed_linears(model, rows)
        return contextlib.nullcontext()

    def _eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def _pad_id(self) -> int:
        return pad_id(self.tokenizer)

    def _forward(self, model, cache=None, **kw):
        if cache is not None:  # transformers 5.x renamed past_key_values to cache
            kw[cache_kwarg(type(model))] = cache
        with autocast(self.compute_dtype, str(kw["input_ids"].device)):
            out = model(use_cache=True, logits_to_keep=1, **kw)
        return getattr(out, "cache", None) or out.past_key_values, out.logits[:, -1].float()

    def _prefill(self, model, cache, ids, am, group_size):
        """Forwards each prompt once and shares its cache among the G samples of its group.
        Returns (cache, next-token logits [N, V], attention mask [N, Lp], next positions [N])."""
        cache, logits = self._forward(model, cache, input_ids=ids, attention_mask=am.long(),
                                      position_ids=position_ids(am))
        next_pos = position_ids(am)[:, -1] + 1
        if group_size > 1:
            cache.batch_repeat_interleave(group_size)
            logits, am, next_pos = (x.repeat_interleave(group_size, 0) for x in (logits, am, next_pos))
        return cache, logits, am, next_pos

    def _next_tokens(self, logits, generator, greedy):
        """(tokens [B], log-probs [B]) of the next position."""
        if greedy:
            return greedy_tokens(logits)
        return sample_tokens(logits, self.temperature, self.top_k, self.top_p, generator)

    def _outputs(self, n: int, pad: int, device):
        """Empty results of a decode loop: tokens [N, T] (pad), sampler log-probs [N, T] (0), finished [N]."""
        return (torch.full((n, self.max_new_tokens), pad, dtype=torch.long, device=device),
                torch.zeros(n, self.max_new_tokens, dtype=torch.float32, device=device),
                torch.zeros(n, dtype=torch.bool, device=device))

    def _decode(self, model, ids, am, group_size, generator, greedy):
        """The sampling loop. Returns completion ids [N, Lc], sampler log-probs [N, Lc], finished [N]."""
        eos, pad = self._eos_id(), self._pad_id()
        cache = new_decode_cache(model, self.max_new_tokens) if self.preallocate_cache else None
        cache, logits, am, next_pos = self._prefill(model, cache, ids, am, group_size)
        n = am.shape[0]
        tokens, samp_lp, finished = self._outputs(n, pad, ids.device)
        active = torch.arange(n, device=ids.device)  # rows still decoding, in cache order
        attn = am.long()
        steps = 0
        for t in range(self.max_new_tokens):
            tok, lp = self._next_tokens(logits, generator, greedy)
            tokens[active, t], samp_lp[active, t] = tok, lp
            steps = t + 1
            done = tok == eos
            finished[active[done]] = True
            if t == self.max_new_tokens - 1 or bool(done.all()):
                break
            if bool(done.any()):  # compact: finished rows leave the decode batch and the cache
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                active, tok, attn, next_pos = active[keep], tok[keep], attn[keep], next_pos[keep]
            attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
            cache, logits = self._forward(model, cache, input_ids=tok[:, None], attention_mask=attn,
                                          position_ids=next_pos[:, None])
            next_pos = next_pos + 1
        return tokens[:, :steps], samp_lp[:, :steps], finished

    def _decode_static(self, model, ids, am, group_size, generator, greedy):
        """The sampling loop of `compile` (rollout/static.py): every row decodes until all have
        finished; a finished row's later tokens are pad with log-prob 0, as `_decode` leaves them.
        Same returns as `_decode`, or None when the model has no StaticCache."""
        eos, pad = self._eos_id(), self._pad_id()
        width = static.prompt_width(ids.shape[1])
        ids = F.pad(ids, (width - ids.shape[1], 0), value=pad)  # more left padding: masked out
        am = F.pad(am, (width - am.shape[1], 0), value=False)
        cache = static.new_static_cache(model, width + self.max_new_tokens)
        if cache is None:
            return None
        cache, logits, am, next_pos = self._prefill(model, cache, ids, am, group_size)
        n, next_pos = am.shape[0], next_pos[:, None]
        mask = F.pad(am.long(), (0, self.max_new_tokens))  # [N, width + T]: the whole static cache
        tokens, samp_lp, finished = self._outputs(n, pad, ids.device)
        step, kwarg, steps = static.compiled_step(), cache_kwarg(type(model)), 0
        for t in range(self.max_new_tokens):
            tok, lp = self._next_tokens(logits, generator, greedy)
            tokens[:, t] = tok.masked_fill(finished, pad)
            samp_lp[:, t] = lp.masked_fill(finished, 0.0)
            finished |= tok == eos
            steps = t + 1
            if t == self.max_new_tokens - 1 or bool(finished.all()):
                break
            mask[:, width + t] = 1
            logits = step(model, kwarg, cache, tokens[:, t : t + 1], mask, next_pos)
            next_pos = next_pos + 1
        return tokens[:, :steps], samp_lp[:, :steps], finished


@functools.lru_cache(maxsize=None)
def cache_kwarg(model_cls) -> str:
    """transformers 5.x renamed the forward's past_key_values to cache; looked up once per class."""
    import inspect

    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def build_rollout(ids, am, comp, samp_lp, finished, group_size, eos_id) -> Rollout:
    """Builds the Rollout: loss_mask covers each completion through its first EOS (inclusive)."""
    ids = ids.repeat_interleave(group_size, 0)
    am = am.repeat_interleave(group_size, 0)
    is_eos = comp == eos_id
    # tokens after the first EOS do not count; cumsum of EOS flags before position t
    eos_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    loss_mask = ~eos_before
    return Rollout(
        input_ids=torch.cat([ids, comp], dim=1),
        attention_mask=torch.cat([am, loss_mask], dim=1),
        prompt_len=ids.shape[1],
        loss_mask=loss_mask,
        truncated=~finished,
        group_size=group_size,
        sampler_logp=samp_lp.masked_fill(~loss_mask, 0.0),
    )


def pad_id(tokenizer) -> int:
    """The id the engines pad with: the tokenizer's pad token, else its EOS."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad if pad is not None else tokenizer.eos_token_id)


def decode_completions(tokenizer, rollout: Rollout) -> list[str]:
    """Completion texts, cut at the first EOS (EOS not included)."""
    eos = tokenizer.eos_token_id
    texts = []
    for row, mask in zip(rollout.completion_ids.tolist(), rollout.loss_mask.tolist()):
        kept = [t for t, m in zip(row, mask) if m and t != eos]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts


@torch.no_grad()
def generate_texts(model, engine: HFEngine, prompts: Sequence[str], batch_size: int = 256,
                   greedy: bool = True, generator=None) -> tuple[list[str], list[bool]]:
    """One completion per prompt: (texts, truncated flags)."""
    texts, trunc = [], []
    for s in range(0, len(prompts), batch_size):
        ro = engine.generate_with(model, prompts[s : s + batch_size], 1, generator=generator, greedy=greedy)
        texts += decode_completions(engine.tokenizer, ro)
        trunc += ro.truncated.tolist()
    return texts, trunc
