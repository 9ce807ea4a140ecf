"""grpolab.grpo.speed: every `auto` speed switch decided at setup, explicit values kept, one line said."""

import pytest
import torch

from grpolab import config as C
from grpolab.config.validation import get_field
from grpolab.models.tiny import build_char_tokenizer, build_tiny_model
from grpolab.grpo.speed import AUTO, compile_pays, decide, resolve_speed, speed_line

SWITCHES = ("model.padding_free", "model.shared_prompt", "model.compile", "rollout.compile", "rollout.bf16_weights",
            "rollout.packed_weights", "train.keep_freed_memory")


def _model(hidden: int = 64):
    return build_tiny_model(build_char_tokenizer(), hidden_size=hidden, num_layers=1, num_heads=2)


def _cfg(*overrides):
    base = ["rollout.prompts_per_step=4", "rollout.group_size=4", "train.minibatch_size=0", "train.microbatch_size=8",
            "train.steps=3"]
    return C.from_preset("grpo", [*base, *overrides])


def _decided(cfg, model=None, dtype=None, steps=None):
    return {d.field: d for d in decide(cfg, model or _model(), dtype, cfg.train.steps if steps is None else steps)}


def test_every_switch_defaults_to_auto_and_each_auto_is_decided():
    cfg = _cfg()
    assert all(get_field(cfg, name) == AUTO for name in SWITCHES)
    resolved, decisions = resolve_speed(cfg, _model(), None)
    assert sorted(d.field for d in decisions) == sorted(SWITCHES)
    assert all(isinstance(get_field(resolved, name), bool) for name in SWITCHES)
    assert all(get_field(resolved, d.field) is d.on for d in decisions)


def test_explicit_values_are_kept_and_not_decided():
    cfg = _cfg("model.shared_prompt=false", "model.padding_free=true", "train.keep_freed_memory=false")
    resolved, decisions = resolve_speed(cfg, _model(), None)
    fields = {d.field for d in decisions}
    assert {"model.shared_prompt", "model.padding_free", "train.keep_freed_memory"}.isdisjoint(fields)
    assert (resolved.model.shared_prompt, resolved.model.padding_free, resolved.train.keep_freed_memory) == (
        False, True, False)


def test_shared_prompt_only_where_each_optimizer_step_takes_whole_groups():
    assert _decided(_cfg())["model.shared_prompt"].on  # one minibatch per epoch, microbatches of 2 groups
    several = _decided(_cfg("train.minibatch_size=8"))["model.shared_prompt"]
    assert not several.on and "minibatches" in several.why  # draws of rows would become draws of groups
    odd = _decided(_cfg("train.microbatch_size=2"))["model.shared_prompt"]
    assert not odd.on and "whole groups" in odd.why
    ppo = _decided(_cfg("loss.advantage=gae", "loss.value_coef=0.1"))
    assert not ppo["model.shared_prompt"].on and not ppo["model.padding_free"].on
    gpu = _decided(_cfg("model.device=cuda"))
    assert not gpu["model.shared_prompt"].on and not gpu["train.keep_freed_memory"].on


def test_padding_free_and_packed_weights_follow_the_dtype_the_lengths_and_the_width():
    narrow, wide = _model(64), _model(512)
    fp32 = _decided(_cfg(), narrow)  # rows up to 256 + 16 tokens: per-row attention in float32
    assert not fp32["model.padding_free"].on and not fp32["rollout.packed_weights"].on
    assert _decided(_cfg("data.max_prompt_tokens=64", "rollout.max_new_tokens=64"), narrow)["model.padding_free"].on
    assert not _decided(_cfg("data.max_prompt_tokens=65", "rollout.max_new_tokens=64"), narrow)["model.padding_free"].on
    assert _decided(_cfg(), narrow, torch.bfloat16)["model.padding_free"].on
    fp32_wide = _decided(_cfg(), wide)
    assert fp32_wide["model.padding_free"].on and fp32_wide["rollout.packed_weights"].on
    assert not _decided(_cfg(), wide, torch.bfloat16)["rollout.packed_weights"].on  # packs float32 weights only


def test_compilation_only_where_the_planned_run_recovers_it():
    cfg, model = _cfg(), _model(256)
    short, _ = compile_pays(cfg, model, steps=3, on_cpu=True, bf16=True)
    long, why = compile_pays(cfg, model, steps=10**6, on_cpu=True, bf16=True)
    assert not short and long and "to compile" in why
    # the break-even is monotonic in the run's length
    verdicts = [compile_pays(cfg, model, n, True, True)[0] for n in (1, 10, 100, 1000, 10**4, 10**5, 10**6)]
    assert verdicts == sorted(verdicts)
    assert not compile_pays(cfg, model, 10**6, on_cpu=True, bf16=False)[0]  # float32: measured no gain
    decided = _decided(cfg, model, torch.bfloat16, steps=10**6)
    assert decided["model.compile"].on and decided["rollout.compile"].on and decided["rollout.bf16_weights"].on
    assert not decided["rollout.packed_weights"].on  # the eager decode's option
    assert not compile_pays(cfg.replace(**{"model.lora_rank": 4}), model, 10**6, on_cpu=True, bf16=True)[0]


def test_setup_runs_with_what_it_chose_and_the_run_says_it_once(capsys, tmp_path):
    from grpolab.grpo.run import train_in_run_dir
    from grpolab.grpo.setup import build_setup

    s = build_setup(_cfg("train.steps=1"))
    assert capsys.readouterr().err == ""  # nothing before the run starts (an input error stays one message)
    assert s.cfg.model.shared_prompt is True and s.optim.forward.layout.whole_groups
    assert s.cfg.model.compile is False and s.models.train_model is s.models.policy
    train_in_run_dir(s, tmp_path)
    err = capsys.readouterr().err
    assert err.count("speed (auto)") == 1 and speed_line(s.services.speed) in err and "model.shared_prompt (" in err


@pytest.mark.parametrize("field", ["model.shared_prompt", "model.compile", "rollout.packed_weights"])
def test_auto_true_false_are_the_choices(field):
    for value in ("auto", "true", "false"):
        C.from_preset("grpo", [f"{field}={value}"])
    with pytest.raises(C.ConfigError, match=field):
        C.from_preset("grpo", [f"{field}=sometimes"])


def test_compiled_runs_keep_their_graphs_in_grpolabs_cache_unless_the_user_chose_a_folder(monkeypatch, tmp_path):
    from grpolab.grpo.compile_cache import use_persistent_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path))
    assert use_persistent_cache() == str(tmp_path / "inductor") and (tmp_path / "inductor").is_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_persistent_cache() == str(tmp_path / "mine")


# Per CPU kind (grpolab.hardware: GRPOLAB_CPU_KIND makes `auto` decide as that kind would, on any host).
# kind -> (compute dtype, padding_free, packed_weights) for the narrow model and rows of 256 + 16 tokens.
KINDS = {"avx2": (None, False, False), "avx512_bf16": (torch.bfloat16, True, False),
         "amx": (torch.bfloat16, True, False), "other": (None, False, False)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_cpu_kind_decides_the_dtype_and_the_switches_that_follow_it(kind, monkeypatch):
    from grpolab.models.loading import resolve_compute_dtype

    monkeypatch.setenv("GRPOLAB_CPU_KIND", kind)
    dtype, padding_free, packed = KINDS[kind]
    cfg = _cfg()
    assert cfg.model.dtype == "auto" and resolve_compute_dtype(cfg.model.dtype, cfg.model.device) == dtype
    long_run = _decided(cfg, _model(256), dtype, steps=10**6)
    assert long_run["model.padding_free"].on is padding_free
    assert long_run["model.compile"].on is (dtype is not None)  # float32: compiling measured no faster
    assert long_run["rollout.bf16_weights"].on is (dtype is not None)
    assert _decided(cfg, _model(64), dtype)["rollout.packed_weights"].on is packed
    assert _decided(cfg, _model(512), dtype)["rollout.packed_weights"].on is (dtype is None)
    assert resolve_compute_dtype("float32", "cpu") is None  # an explicit dtype is kept on every kind


@pytest.mark.parametrize("parallel,ranks,kept", [("ddp", 1, True), ("ddp", 2, True), ("fsdp2", 2, False),
                                                  ("fsdp2", 1, True)])
def test_keep_freed_memory_follows_the_parallel_strategy(parallel, ranks, kept, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    decided = _decided(_cfg(f"train.parallel={parallel}"))["train.keep_freed_memory"]
    assert decided.on is kept, decided.why
    assert kept or "FSDP2" in decided.why


@pytest.mark.parametrize("kind", ["avx2", "avx512_bf16", "amx"])
def test_a_tiny_run_trains_under_each_cpu_kind(kind, monkeypatch):
    from grpolab.grpo import loop as grpo
    from grpolab.grpo.setup import build_setup

    monkeypatch.setenv("GRPOLAB_CPU_KIND", kind)
    setup = build_setup(_cfg("train.steps=2", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
                             "rollout.max_new_tokens=4", "loss.entropy_coef=0.01", "train.lr=1e-2"))
    assert setup.optim.forward.compute_dtype == KINDS[kind][0]
    before = [p.detach().clone() for p in setup.models.policy.parameters()]
    rows = []
    setup.services.hooks.append(lambda step, row, record: rows.append(row))
    grpo.train(setup)
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, setup.models.policy.parameters()))
