"""The vLLM engine: refusals, vLLM outputs -> Rollout (as the HF engine builds it), and its calls into vLLM.

On CPU the engine's logic runs against fakes of `vllm.LLM` / `vllm.SamplingParams`; the tests marked
gpu run the real vLLM on a CUDA GPU (skipped without one, or without the vllm extra).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpolab import config as C
from grpolab.rollout import vllm_engine as V
from grpolab.rollout.engine import ENGINES, Engine, build_engine
from grpolab.rollout.hf import build_rollout

EOS, PAD = 1, 0
PROMPTS = ["12+7=", "3-1="]
HAS_VLLM_GPU = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def _cfg(*overrides: str):
    return C.from_preset("grpo", ["rollout.engine=vllm", *overrides])


# --------------------------------------------------------------------------- refusals


def test_the_factory_refuses_a_cpu_model_naming_the_engine_and_the_extra():
    assert "vllm" in ENGINES
    with pytest.raises(ValueError) as e:
        build_engine(_cfg("model.device=cpu"), None, None, None)
    msg = str(e.value)
    assert "rollout.engine=vllm" in msg and "model.device=cpu" in msg and 'pip install "grpolab[vllm]"' in msg


def test_the_factory_refuses_without_a_gpu_without_vllm_and_with_lora(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"rollout.engine=vllm: no CUDA GPU.*grpolab\[vllm\]"):
        build_engine(_cfg("model.device=cuda"), None, None, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(V, "_vllm_installed", lambda: False)
    with pytest.raises(ValueError, match=r"rollout.engine=vllm: vLLM is not installed.*grpolab\[vllm\]"):
        build_engine(_cfg("model.device=cuda"), None, None, None)
    monkeypatch.setattr(V, "_vllm_installed", lambda: True)
    with pytest.raises(ValueError, match=r"rollout.engine=vllm does not take LoRA.*model.lora_rank=4"):
        build_engine(_cfg("model.device=cuda", "model.lora_rank=4"), None, None, None)


# --------------------------------------------------------------------------- vLLM outputs -> Rollout


def _hf_rollout(prompt_ids, comp, samp, finished, group_size):
    """What the HF engine's `build_rollout` builds from its own (left-padded) tensors."""
    ids, am = V.left_pad(prompt_ids, PAD)
    return build_rollout(ids, am, torch.tensor(comp), torch.tensor(samp), torch.tensor(finished), group_size, EOS)


def _assert_same(got, want):
    for name in ("input_ids", "attention_mask", "loss_mask", "truncated", "sampler_logp"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.prompt_len, got.group_size) == (want.prompt_len, want.group_size)


def test_assemble_rollout_gives_the_hf_engine_tensors_eos_in_the_middle_truncation_and_groups():
    prompts = [[5, 6, 7], [8]]
    tokens = [[9, EOS], [10, 11, 12], [EOS], [13, 14, EOS]]  # G = 2: rows 0-1 are prompt 0's
    logps = [[-0.5, -0.25], [-1.0, -2.0, -3.0], [-0.125], [-0.5, -0.5, -0.75]]
    stopped = [True, False, True, False]  # the last row's EOS is its last allowed token: reported as length
    got = V.assemble_rollout(prompts, tokens, logps, stopped, 2, EOS, PAD)
    want = _hf_rollout(prompts, [[9, EOS, PAD], [10, 11, 12], [EOS, PAD, PAD], [13, 14, EOS]],
                       [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0], [-0.125, 0.0, 0.0], [-0.5, -0.5, -0.75]],
                       [True, False, True, True], 2)
    _assert_same(got, want)
    assert got.truncated.tolist() == [False, True, False, False]
    assert got.input_ids[2, :3].tolist() == [PAD, PAD, 8] and got.input_ids[0, :3].tolist() == [5, 6, 7]
    assert got.loss_mask.tolist() == [[True, True, False], [True] * 3, [True, False, False], [True] * 3]
    assert got.sampler_logp.dtype == torch.float32 and got.sampler_logp[0, 2] == 0.0


def test_assemble_rollout_counts_only_a_short_unfinished_rows_own_tokens():
    """A row cut by vLLM's context length (no EOS, shorter than the others) does not count its padding."""
    got = V.assemble_rollout([[5]], [[9, 10], [11, 12, 13, 14]], [[-1.0, -1.0], [-2.0] * 4], [False, False], 2, EOS,
                             PAD)
    assert got.loss_mask.tolist() == [[True, True, False, False], [True] * 4]
    assert got.attention_mask[0].tolist() == [True, True, True, False, False]
    assert got.sampler_logp[0].tolist() == [-1.0, -1.0, 0.0, 0.0] and got.truncated.tolist() == [True, True]
    assert got.completion_ids[0].tolist() == [9, 10, PAD, PAD]
    with pytest.raises(ValueError, match="1 prompts × G=2 but 3 completions"):
        V.assemble_rollout([[5]], [[9]] * 3, [[0.0]] * 3, [True] * 3, 2, EOS, PAD)


def _out(tokens, reason, logps=None):
    steps = None if logps is None else [{t: SimpleNamespace(logprob=lp), 999: SimpleNamespace(logprob=-9.0)}
                                        for t, lp in zip(tokens, logps)]
    return SimpleNamespace(token_ids=tuple(tokens), logprobs=steps, finish_reason=reason)


def test_completions_of_reads_token_ids_the_sampled_tokens_logprobs_and_the_finish_reason():
    outs = [SimpleNamespace(outputs=[_out([9, EOS], "stop", [-0.5, -0.25]), _out([3, 4], "length", [-1.0, -2.0])]),
            SimpleNamespace(outputs=[_out([EOS], "stop"), _out([7], "length")])]
    tokens, logps, stopped = V.completions_of(outs, 2)
    assert tokens == [[9, EOS], [3, 4], [EOS], [7]]
    assert logps == [[-0.5, -0.25], [-1.0, -2.0], [0.0], [0.0]] and stopped == [True, False, True, False]
    with pytest.raises(ValueError, match="2 completions for a request of n=3"):
        V.completions_of(outs, 3)


# --------------------------------------------------------------------------- the engine against fakes


class FakeSamplingParams:
    def __init__(self, n=1, seed=None, **kw):
        self.n, self.seed = n, seed
        self.__dict__.update(kw)


class FakeModel(torch.nn.Module):
    """vLLM's model object: `load_weights` takes (name, tensor) pairs."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.loaded = []

    def load_weights(self, weights):
        self.loaded += [(name, t.clone()) for name, t in weights]


class FakeLLM:
    """Records calls; completion j of a request seeded s is [2 + (s + j) % 5] then EOS when s + j is even."""

    def __init__(self):
        self.calls, self.model = [], FakeModel()
        worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: self.model))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker))

    def generate(self, requests, sampling_params, use_tqdm):
        self.calls.append(("generate", [r["prompt_token_ids"] for r in requests], sampling_params))
        outs = []
        for p in sampling_params:
            comps = []
            for j in range(p.n):
                s = (p.seed or 0) + j
                toks = [2 + s % 5] + ([EOS] if s % 2 == 0 else [])
                comps.append(_out(toks, "stop" if s % 2 == 0 else "length", [-0.5] * len(toks)))
            outs.append(SimpleNamespace(outputs=comps))
        return outs

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture()
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.SamplingParams = FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)


def _engine(tiny, sleep=False, **kw):
    return V.VLLMEngine(FakeLLM(), tiny[1], max_new_tokens=4, temperature=0.7, sleep=sleep, device="cpu", **kw)


def test_generate_sends_token_ids_with_a_seed_per_prompt_and_groups_rows_by_prompt(tiny, fake_vllm):
    eng = _engine(tiny, weight_version=3)
    assert isinstance(eng, Engine)
    ro = eng.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0))
    _, sent, params = eng.llm.calls[0]
    assert sent == tiny[1](PROMPTS, add_special_tokens=False)["input_ids"]
    assert [p.n for p in params] == [3, 3] and params[1].seed - params[0].seed == 3  # seeds base + g·G
    p = params[0]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.logprobs) == (0.7, 1.0, -1, 4, 0)
    assert (p.stop_token_ids, p.detokenize) == ([EOS], False)
    assert ro.num_sequences == 6 and ro.weight_version == 3 and ro.group_size == 3
    for g, ids in enumerate(sent):  # row g·G + j holds prompt g
        assert ro.input_ids[g * 3 : g * 3 + 3, ro.prompt_len - len(ids) : ro.prompt_len].tolist() == [ids] * 3
    seeds = [params[g].seed + j for g in range(2) for j in range(3)]
    assert ro.completion_ids[:, 0].tolist() == [2 + s % 5 for s in seeds]
    assert ro.truncated.tolist() == [s % 2 == 1 for s in seeds]
    assert len(eng.decode(ro)) == 6
    again = _engine(tiny)  # the same generator state: the same seeds
    again.generate(PROMPTS, 3, generator=torch.Generator().manual_seed(0))
    assert [p.seed for p in again.llm.calls[0][2]] == [p.seed for p in params]


def test_greedy_sends_each_prompt_once_and_repeats_its_completion(tiny, fake_vllm):
    eng = _engine(tiny)
    ro = eng.generate(PROMPTS, 2, greedy=True)
    params = eng.llm.calls[0][2]
    assert [(p.n, p.temperature) for p in params] == [(1, 0.0), (1, 0.0)]
    assert torch.equal(ro.input_ids[0], ro.input_ids[1]) and torch.equal(ro.input_ids[2], ro.input_ids[3])


def test_colocated_mode_sleeps_after_generate_and_wakes_weights_then_kv_cache(tiny, fake_vllm):
    eng = _engine(tiny, sleep=True)
    eng.generate(PROMPTS, 2)
    eng.generate(PROMPTS, 2)
    kinds = [c[0] if c[0] != "wake_up" else ("wake_up", *c[1]) for c in eng.llm.calls]
    assert kinds == ["generate", "reset_prefix_cache", "sleep", ("wake_up", "weights"), ("wake_up", "kv_cache"),
                     "generate", "reset_prefix_cache", "sleep"]
    assert eng.llm.calls[2] == ("sleep", 1)


class LazyState(Mapping):
    """A state dict whose items are made when read (as FSDP2's gathered weights are); records the reads."""

    def __init__(self, tensors):
        self.tensors, self.reads = tensors, []

    def __getitem__(self, key):
        self.reads.append(key)
        return self.tensors[key]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def test_load_weights_sends_each_tensor_once_in_order_and_resets_the_prefix_cache(tiny, fake_vllm):
    eng = _engine(tiny, sleep=True)
    eng.generate(PROMPTS, 2)  # now asleep
    emb = torch.arange(6.0).view(2, 3)
    state = LazyState({"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(3, dtype=torch.bfloat16),
                       "lm_head.weight": emb})  # tied: the same storage as the embedding
    eng.load_weights(5, state)
    assert state.reads == list(state.tensors)  # every item read once, in order
    assert [n for n, _ in eng.llm.model.loaded] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert torch.equal(eng.llm.model.loaded[0][1], emb)
    assert eng.weight_version == 5 and eng.last_sync_bytes == 6 * 4 + 3 * 2 and eng.last_sync_seconds >= 0
    assert eng.llm.calls[3:] == [("wake_up", ["weights"]), ("reset_prefix_cache",)]  # the KV cache sleeps on
    eng.generate(PROMPTS, 2)
    assert eng.llm.calls[5] == ("wake_up", ["kv_cache"]) and eng.generate(PROMPTS, 2).weight_version == 5


def test_a_grpo_step_trains_on_the_engines_rollouts_and_syncs_the_new_weights(fake_vllm):
    """The loop (grpo.train) with the engine in place of the HF one: Phase A and B run on its Rollouts and
    the step ends with every policy tensor but the tied LM head sent to vLLM's model as version 1."""
    from grpolab.grpo import loop as grpo
    from grpolab.grpo.setup import build_setup

    cfg = C.from_preset("grpo", ["loss.kl_coef=0", "rollout.prompts_per_step=2", "rollout.group_size=3",
                                 "rollout.max_new_tokens=4", "train.steps=1", "train.minibatch_size=6",
                                 "train.microbatch_size=6", "run.tensorboard=false", "run.progress=false"])
    setup = build_setup(cfg)
    setup.data.engine = eng = V.VLLMEngine(FakeLLM(), setup.models.tokenizer, max_new_tokens=4, sleep=True, device="cpu")
    rows = grpo.train(setup)
    assert eng.weight_version == 1 and rows[0]["len/mean"] > 0 and rows[0]["sync/bytes"] == eng.last_sync_bytes
    state = setup.models.policy.state_dict()
    loaded = dict(eng.llm.model.loaded)
    assert set(loaded) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)


# --------------------------------------------------------------------------- building the LLM


def test_export_policy_writes_an_hf_folder_with_the_policys_weights_and_rope(tiny):
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    folder = V.export_policy(model, tok)
    path = Path(folder.name)
    config = json.loads((path / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    assert config.get("rope_theta") == rope.get("rope_theta", config.get("rope_theta"))
    assert (path / "tokenizer.json").is_file() and any(path.glob("*.safetensors"))
    back = AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    assert getattr(back.config, "rope_parameters", None) == getattr(model.config, "rope_parameters", None)
    folder.cleanup()
    assert not path.exists()


def test_llm_kwargs_ask_for_temperature_scaled_logprobs_in_the_compute_dtype(tiny):
    cfg = _cfg("model.device=cuda", "rollout.max_new_tokens=32", "data.max_prompt_tokens=100",
               "rollout.vllm_gpu_memory_utilization=0.3", "rollout.vllm_sleep=false", "train.seed=7")
    context = V.max_model_len(cfg, tiny[0])
    assert context == min(132, tiny[0].config.max_position_embeddings)
    kw = V.llm_kwargs(cfg, "/tmp/x", torch.bfloat16, context)
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["dtype"] == "bfloat16" and kw["seed"] == 7
    assert (kw["gpu_memory_utilization"], kw["enable_sleep_mode"], kw["max_model_len"]) == (0.3, False, context)
    assert kw["skip_tokenizer_init"] and kw["generation_config"] == "vllm" and kw["enable_prefix_caching"]
    assert "distributed_executor_backend" not in kw
    assert V.llm_kwargs(cfg, "/tmp/x", None, context)["dtype"] == "float32"


# --------------------------------------------------------------------------- the real vLLM (CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs a CUDA GPU and vLLM (pip install 'grpolab[vllm]')")
def test_vllm_samples_the_trainers_distribution_and_takes_new_weights():
    """bf16 vLLM (sleeping between calls) on a tiny policy: its sampler log-probs are the trainer's at
    temperature 0.7; after `load_weights` of perturbed weights its greedy log-probs follow the new weights."""
    from grpolab.forward import batched_logprobs
    from grpolab.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden_size=128, num_layers=2, num_heads=2, seed=0).cuda().eval()  # head dim 64
    cfg = _cfg("model.device=cuda", "model.dtype=bfloat16", "rollout.temperature=0.7", "rollout.max_new_tokens=12",
               "rollout.vllm_gpu_memory_utilization=0.3", "data.max_prompt_tokens=32")
    bf16 = torch.bfloat16
    eng = build_engine(cfg, model, tok, bf16)
    try:
        ro = eng.generate(PROMPTS, 4, generator=torch.Generator(device="cuda").manual_seed(0))
        assert ro.num_sequences == 8 and ro.input_ids.device.type == "cuda" and ro.loss_mask.any()
        err = (ro.sampler_logp - batched_logprobs(model, ro, 0.7, 8, bf16)).abs()[ro.loss_mask]
        assert err.mean() < 0.02 and err.max() < 0.25
        old = copy.deepcopy(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        eng.load_weights(1, model.state_dict())
        assert eng.weight_version == 1 and eng.last_sync_bytes > 0
        greedy = eng.generate(PROMPTS, 1, greedy=True)
        new_err = (greedy.sampler_logp - batched_logprobs(model, greedy, 1.0, 8, bf16)).abs()[greedy.loss_mask].mean()
        old_err = (greedy.sampler_logp - batched_logprobs(old, greedy, 1.0, 8, bf16)).abs()[greedy.loss_mask].mean()
        assert new_err < 0.02 and new_err < 0.5 * old_err
    finally:
        eng.close()
