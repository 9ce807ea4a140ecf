"""The vLLM engine (`rollout.engine=vllm`): Phase A on vLLM, in the training process or a Ray rollout worker.

CUDA only, an optional extra (`pip install "grpolab[vllm]"`; vLLM brings its own CUDA build of torch).
`VLLMEngine.from_config` saves the policy as it is now (e.g. the SFT'd π0) to a temporary HF folder and
builds a `vllm.LLM` on it, so any policy works, `builtin:tiny` included; LoRA policies are refused. vLLM
gets token ids (we tokenize, left-pad and decode: `skip_tokenizer_init`), stops only on the tokenizer's
EOS (`stop_token_ids`; the folder's generation_config is ignored) and returns the EOS in the completion,
so the Rollout is built by the HF engine's own `build_rollout`.

vLLM APIs used (vLLM ≥ 0.10.2, V1 engine; read in vLLM's docs and sources, and in how TRL's colocate
mode drives it): `LLM(..., logprobs_mode=, enable_sleep_mode=, skip_tokenizer_init=, generation_config=)`,
`LLM.generate([{"prompt_token_ids": ...}], [SamplingParams])`, `LLM.sleep(level=1)`,
`LLM.wake_up(tags=[...])`, `LLM.reset_prefix_cache()`, and the in-process model
`llm.llm_engine.model_executor.driver_worker.model_runner` (`get_model()` or `.model`), whose
`load_weights(iterable of (HF name, tensor))` is vLLM's own weight-loading path. That object exists only
when vLLM's engine core runs in this process, so `from_config` sets VLLM_ENABLE_V1_MULTIPROCESSING=0
(on torchrun ranks vLLM joins the trainer's process group: `distributed_executor_backend=external_launcher`).

Agent episodes (`rollout.multiturn.generate_episodes`, an environment or tools): `VLLMEngine.episode_turns`
gives the turn sampler `VLLMTurnSampler`. Each round of turns (the next policy turn of every live episode)
is one `LLM.generate` call with one request per live episode: its `prompt_token_ids` are the episode's ids
so far exactly as the driver holds them (prompt, the policy's turns as sampled, the environment's deltas:
token in, token out, nothing decoded or re-encoded), n = 1, a seed of its own drawn from the step's
generator, max_tokens = the turn budget the driver gives, stop on the driver's end-of-turn id. The whole
history is sent every round; vLLM's prefix caching (`enable_prefix_caching`, set by `llm_kwargs`) finds the
KV blocks of the part it has already seen, so a round computes only the new ids, much as the HF engine's
kept cache does. Episodes that have ended are simply not sent again.

Colocated mode (`rollout.vllm_sleep`): after each generate vLLM sleeps at level 1 (KV cache freed,
weights offloaded to CPU memory) while the trainer learns; `load_weights` wakes the weights alone, and
the next generate wakes the KV cache, weights first (vLLM's advice for weight updates: lower peak).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpolab.rollout.hf import build_rollout, decode_completions, pad_id
from grpolab.batch import Rollout

INSTALL_HINT = 'the vllm extra: pip install "grpolab[vllm]" (CUDA only; vLLM brings its own CUDA build of torch)'

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's `logprobs_mode`. `raw_logprobs` (vLLM's default) are the model's log-softmax before the
temperature; `processed_logprobs` come after the temperature (and after top-k / top-p, which then
renormalize over the kept tokens). grpolab's sampler log-prob (`rollout.sampling.sample_tokens`) and
the training loss use the temperature-scaled, unfiltered distribution, so `processed_logprobs` is the
match: exact with rollout.top_k=0 and rollout.top_p=1 (the defaults); with a filter, vLLM's value is
the log-prob of the filtered distribution the token was actually drawn from. Greedy requests get
temperature-1 log-probs, as `sampling.greedy_tokens`."""


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_vllm_usable(cfg) -> None:
    """ValueError naming `rollout.engine=vllm` and the fix when this config cannot run vLLM here:
    model.device not CUDA, no CUDA GPU, vLLM not installed, or a LoRA policy (model.lora_rank > 0)."""
    device = torch.device(cfg.model.device)
    if device.type != "cuda":
        raise ValueError(f"rollout.engine=vllm generates on a CUDA GPU, but model.device={cfg.model.device}: set "
                         f"model.device=cuda, or use rollout.engine=hf ({INSTALL_HINT})")
    if not torch.cuda.is_available():
        raise ValueError(f"rollout.engine=vllm: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                         f"use rollout.engine=hf ({INSTALL_HINT})")
    if not _vllm_installed():
        raise ValueError(f"rollout.engine=vllm: vLLM is not installed; install {INSTALL_HINT}")
    if cfg.model.lora_rank > 0:
        raise ValueError(f"rollout.engine=vllm does not take LoRA policies (model.lora_rank={cfg.model.lora_rank}): "
                         "vLLM samples from full weights; set model.lora_rank=0 or use rollout.engine=hf")


# --------------------------------------------------------------------------- vLLM outputs -> Rollout


def completions_of(request_outputs, n: int) -> tuple[list[list[int]], list[list[float]], list[bool]]:
    """Plain lists from vLLM's `RequestOutput`s: per completion (N = len(request_outputs) × n, grouped by
    request) its token ids, the sampled tokens' log-probs (0 where none were returned) and whether it
    stopped on a stop token (`finish_reason == "stop"`). Reads `.outputs[j].token_ids`, `.logprobs`
    (one {token id: Logprob} per token) and `.finish_reason`."""
    tokens, logps, stopped = [], [], []
    for req in request_outputs:
        if len(req.outputs) != n:
            raise ValueError(f"vLLM returned {len(req.outputs)} completions for a request of n={n}")
        for out in req.outputs:
            ids = [int(t) for t in out.token_ids]
            steps = out.logprobs
            tokens.append(ids)
            logps.append([0.0] * len(ids) if steps is None else [float(s[t].logprob) for s, t in zip(steps, ids)])
            stopped.append(out.finish_reason == "stop")
    return tokens, logps, stopped


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists left-padded to one width: ids [P, Lp] int64, attention mask [P, Lp] bool."""
    width = max(len(r) for r in rows)
    ids = [[pad_id] * (width - len(r)) + list(r) for r in rows]
    mask = [[False] * (width - len(r)) + [True] * len(r) for r in rows]
    return (torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.bool, device=device))


def assemble_rollout(prompt_ids: Sequence[Sequence[int]], tokens: Sequence[Sequence[int]],
                     logps: Sequence[Sequence[float]], stopped: Sequence[bool], group_size: int, eos_id: int,
                     pad_id: int, device=None) -> Rollout:
    """The Rollout of P prompts' completions (N = P × group_size rows, row g·G + j = completion j of
    prompt g), built as the HF engine builds it (`hf.build_rollout`): prompts left-padded, completions
    right-padded with `pad_id`, loss_mask through the first EOS, sampler_logp [N, Lc] float32 (0 past
    it), truncated = no EOS. A completion counts as finished when it stopped on EOS or ends with one
    (vLLM may report a completion whose last allowed token is EOS as length-capped); a row shorter
    than Lc without EOS (cut by the context length) counts only its own tokens."""
    n = len(tokens)
    if n != len(prompt_ids) * group_size or not (len(logps) == len(stopped) == n):
        raise ValueError(f"assemble_rollout: {len(prompt_ids)} prompts × G={group_size} but {n} completions, "
                         f"{len(logps)} log-prob rows, {len(stopped)} finish flags")
    ids, am = left_pad(prompt_ids, pad_id, device)
    width = max(1, max(len(t) for t in tokens))
    comp = torch.tensor([list(t) + [pad_id] * (width - len(t)) for t in tokens], dtype=torch.long, device=device)
    samp = torch.tensor([list(lp) + [0.0] * (width - len(lp)) for lp in logps], dtype=torch.float32, device=device)
    finished = torch.tensor([bool(s) or eos_id in t for s, t in zip(stopped, tokens)], device=device)
    ro = build_rollout(ids, am, comp, samp, finished, group_size, eos_id)
    lengths = torch.tensor([len(t) for t in tokens], device=device)
    own = ro.loss_mask & (torch.arange(width, device=device) < lengths[:, None])
    if not torch.equal(own, ro.loss_mask):
        ro = ro.replace(loss_mask=own, attention_mask=torch.cat([ro.attention_mask[:, : ro.prompt_len], own], 1),
                        sampler_logp=ro.sampler_logp.masked_fill(~own, 0.0))
    return ro


# --------------------------------------------------------------------------- building the LLM


def export_policy(policy, tokenizer) -> tempfile.TemporaryDirectory:
    """The policy's current weights (and tokenizer) saved as an HF folder vLLM can load; deleted with
    the returned object. A config written by transformers 5 (RoPE under `rope_parameters`) also gets
    the older `rope_theta` / `rope_scaling` keys, so a reader that looks only for those finds the same
    RoPE rather than its default."""
    folder = tempfile.TemporaryDirectory(prefix="grpolab-vllm-")
    policy.save_pretrained(folder.name)
    tokenizer.save_pretrained(folder.name)
    path = Path(folder.name) / "config.json"
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        path.write_text(json.dumps(config, indent=2) + "\n")
    return folder


def max_model_len(cfg, policy) -> int:
    """vLLM's context: room for a prompt (data.max_prompt_tokens) and the completion, and in an agent run
    for a whole episode (rollout.max_episode_tokens), within the model's."""
    want = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if cfg.episodes:
        want = max(want, cfg.rollout.max_episode_tokens)
    ctx = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    return min(want, int(ctx)) if ctx else want


def llm_kwargs(cfg, folder: str, compute_dtype: torch.dtype | None, context: int) -> dict:
    """The `vllm.LLM` arguments of a config (one GPU, no tensor parallelism)."""
    r = cfg.rollout
    kw = dict(model=str(folder), dtype="bfloat16" if compute_dtype == torch.bfloat16 else "float32",
              seed=cfg.train.seed, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
              enable_sleep_mode=r.vllm_sleep, max_model_len=context, enable_prefix_caching=True,
              logprobs_mode=LOGPROBS_MODE, skip_tokenizer_init=True, generation_config="vllm",
              tensor_parallel_size=1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        kw["distributed_executor_backend"] = "external_launcher"  # one engine per torchrun rank, in its process
    return kw


def driver_model(llm) -> torch.nn.Module:
    """vLLM's model object in this process (the one whose `load_weights` takes HF-named tensors)."""
    executor = getattr(llm.llm_engine, "model_executor", None)
    if executor is None:
        raise RuntimeError("vLLM's engine core runs in another process, so its weights cannot be loaded from here; "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 must be set before the LLM is built")
    runner = executor.driver_worker.model_runner  # the worker wrapper forwards to its worker
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


# --------------------------------------------------------------------------- the engine


@dataclass
class VLLMEngine:
    llm: object  # the vllm.LLM (built by from_config)
    tokenizer: object
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    sleep: bool = False  # sleep (level 1) after each generate: rollout.vllm_sleep, the colocated mode
    device: str = "cuda"  # where the returned Rollouts live (the trainer's device)
    folder: tempfile.TemporaryDirectory | None = None  # the exported policy vLLM was built from
    weight_version: int = 0
    last_sync_seconds: float = 0.0
    last_sync_bytes: int = 0
    _sleeping: set = field(default_factory=set)

    @classmethod
    def from_config(cls, cfg, policy, tokenizer, compute_dtype: torch.dtype | None) -> "VLLMEngine":
        """A vLLM engine sampling from `policy`'s current weights (ValueError when this config cannot
        run vLLM here: `check_vllm_usable`)."""
        check_vllm_usable(cfg)
        folder = export_policy(policy, tokenizer)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: see driver_model
        import vllm

        llm = vllm.LLM(**llm_kwargs(cfg, folder.name, compute_dtype, max_model_len(cfg, policy)))
        r = cfg.rollout
        return cls(llm, tokenizer, r.max_new_tokens, r.temperature, r.top_p, r.top_k, sleep=r.vllm_sleep,
                   device=cfg.model.device, folder=folder)

    def generate(self, prompts: Sequence[str], group_size: int, *, generator: torch.Generator | None = None,
                 greedy: bool = False) -> Rollout:
        """`Engine.generate`: G completions per prompt (N = P × G rows, grouped by prompt). Each prompt's
        request gets its own seed (one base drawn from `generator`, else from torch's global generator,
        plus g·G; vLLM gives completion j seed + j), so a run is reproducible; greedy sends each prompt
        once and repeats its completion G times."""
        prompt_ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        self._wake(("weights", "kv_cache"))
        params = self._sampling_params(len(prompt_ids), group_size, generator, greedy)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=params,
                                    use_tqdm=False)
        if self.sleep:
            self._sleep()
        tokens, logps, stopped = completions_of(outputs, 1 if greedy else group_size)
        if greedy:
            tokens, logps, stopped = ([x for x in rows for _ in range(group_size)] for rows in (tokens, logps, stopped))
        ro = assemble_rollout(prompt_ids, tokens, logps, stopped, group_size, self._eos_id(), pad_id(self.tokenizer),
                              self.device)
        return ro.replace(weight_version=self.weight_version)

    def decode(self, rollout: Rollout) -> list[str]:
        """`Engine.decode`: completion texts, cut at the first EOS (EOS not included)."""
        return decode_completions(self.tokenizer, rollout)

    def load_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """`Engine.load_weights`: `state` (HF names) into vLLM's model through its own loader, one tensor at
        a time, each read once in `state`'s order (a lazy mapping, e.g. FSDP2's gathered weights, is
        read as it yields) and moved to vLLM's GPU; a tensor sharing storage with one already sent
        (tied embeddings) is not sent again. Then the prefix cache is reset (its KV came from the old
        weights). Keeps `last_sync_seconds` and `last_sync_bytes` (numel × element size sent)."""
        start = time.perf_counter()
        self._wake(("weights",))
        model = driver_model(self.llm)
        device = next(model.parameters()).device
        sent_bytes, seen = 0, set()

        def items():
            nonlocal sent_bytes
            for name in state:
                value = state[name].detach()
                key = (value.device, value.data_ptr(), tuple(value.shape), value.dtype)
                if value.numel() and key in seen:
                    continue
                seen.add(key)
                tensor = value.to(device)
                sent_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        with torch.no_grad():
            model.load_weights(items())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.llm.reset_prefix_cache()
        self.weight_version = version
        self.last_sync_seconds = time.perf_counter() - start
        self.last_sync_bytes = sent_bytes

    def close(self) -> None:
        """Drops the LLM (its GPU memory goes back once collected) and deletes the exported folder."""
        self.llm = None
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _sampling_params(self, n_prompts: int, group_size: int, generator, greedy: bool) -> list:
        """One `SamplingParams` per prompt: n = G samples (greedy: n = 1, temperature 0), the sampled
        token's own log-prob (logprobs=0), stop on EOS only, no detokenization, a seed of its own."""
        from vllm import SamplingParams

        common = dict(max_tokens=self.max_new_tokens, logprobs=0, stop_token_ids=[self._eos_id()], detokenize=False)
        if greedy:
            return [SamplingParams(n=1, temperature=0.0, **common) for _ in range(n_prompts)]
        base = draw_seeds(generator, 1)[0]
        return [SamplingParams(n=group_size, **self._sampled(), seed=base + g * group_size, **common)
                for g in range(n_prompts)]

    @contextlib.contextmanager
    def episode_turns(self, driver, rows: int, *, generator: torch.Generator | None = None, greedy: bool = False):
        """The turn sampler of `rollout.multiturn.generate_episodes` for one batch of `rows` episodes run by
        `driver` (an agents.driver.EpisodeDriver): a `VLLMTurnSampler` (module docstring). vLLM is woken
        before the batch and, in colocated mode, put to sleep after it."""
        self._wake(("weights", "kv_cache"))
        try:
            yield VLLMTurnSampler(self, int(driver.end_id), generator, greedy)
        finally:
            if self.sleep:
                self._sleep()

    def turn_params(self, budgets: Sequence[int], end_id: int, generator, greedy: bool) -> list:
        """One `SamplingParams` per episode turn: n = 1, max_tokens = its budget, stop on `end_id`, the
        sampled token's own log-prob (logprobs=0), no detokenization; sampled: the engine's temperature,
        top-p, top-k and a seed per request drawn from `generator` (in request order); greedy:
        temperature 0."""
        from vllm import SamplingParams

        common = dict(n=1, logprobs=0, stop_token_ids=[int(end_id)], detokenize=False)
        if greedy:
            return [SamplingParams(temperature=0.0, max_tokens=int(b), **common) for b in budgets]
        seeds = draw_seeds(generator, len(budgets))
        return [SamplingParams(**self._sampled(), seed=seed, max_tokens=int(b), **common)
                for b, seed in zip(budgets, seeds)]

    def _sampled(self) -> dict:
        """The engine's sampling settings as SamplingParams keywords (top_k 0 = off: vLLM's -1)."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k if self.top_k > 0 else -1)

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Wakes the sleeping ones of `tags`, in that order (`LLM.wake_up(tags=[tag])`)."""
        for tag in tags:
            if tag in self._sleeping:
                torch.cuda.empty_cache()  # hand the trainer's cached blocks back before vLLM maps its memory
                self.llm.wake_up(tags=[tag])
                self._sleeping.discard(tag)

    def _sleep(self) -> None:
        """Level-1 sleep: KV cache discarded (the prefix cache reset with it), weights offloaded to CPU."""
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=1)
        self._sleeping = {"weights", "kv_cache"}

    def _eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)


def draw_seeds(generator: torch.Generator | None, count: int) -> list[int]:
    """`count` vLLM request seeds in [0, 2³¹ − 1) drawn from `generator` (None: torch's global generator)."""
    if generator is None:
        return torch.randint(0, 2**31 - 1, (count,)).tolist()
    return torch.randint(0, 2**31 - 1, (count,), generator=generator, device=generator.device).tolist()


class VLLMTurnSampler:
    """Samples a round of agent-episode turns with one `LLM.generate` call on token ids (module docstring).

    `sample(requests)`: requests maps each live episode (its index in the batch) to (its ids so far, the
    turn's token budget); returns episode -> (the turn's sampled ids, ending with the end-of-turn id
    unless cut by the budget; their sampler log-probs), the replies of the HF engine's turn sampler.
    `stats`: "rounds" (generate calls), "requests" (turns sampled), "sent_tokens" (prompt ids sent, the
    history that prefix caching serves included), "sampled_tokens".
    """

    def __init__(self, engine: VLLMEngine, end_id: int, generator: torch.Generator | None, greedy: bool):
        self.engine, self.end_id, self.generator, self.greedy = engine, end_id, generator, greedy
        self.stats = {"rounds": 0, "requests": 0, "sent_tokens": 0, "sampled_tokens": 0}

    def sample(self, requests: Mapping[int, tuple[Sequence[int], int]]) -> dict[int, tuple[list[int], list[float]]]:
        """One turn for each request, in one generate call (the class docstring)."""
        slots = sorted(requests)
        prompts = [{"prompt_token_ids": [int(t) for t in requests[i][0]]} for i in slots]
        params = self.engine.turn_params([requests[i][1] for i in slots], self.end_id, self.generator, self.greedy)
        outputs = self.engine.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        tokens, logps, _ = completions_of(outputs, 1)
        if len(tokens) != len(slots):
            raise ValueError(f"vLLM returned {len(tokens)} outputs for {len(slots)} episode turns")
        self.stats["rounds"] += 1
        self.stats["requests"] += len(slots)
        self.stats["sent_tokens"] += sum(len(p["prompt_token_ids"]) for p in prompts)
        self.stats["sampled_tokens"] += sum(len(t) for t in tokens)
        return {i: (t, lp) for i, t, lp in zip(slots, tokens, logps)}
