import dataclasses

import pytest

from grpolab import config as C


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_every_preset_validates_and_round_trips_yaml(name, tmp_path):
    cfg = C.from_preset(name)
    assert cfg.preset == name
    path = tmp_path / "c.yaml"
    C.dump(cfg, str(path))
    assert C.load(str(path)) == cfg


def test_preset_values():
    assert C.from_preset("grpo_no_kl").needs_reference is False
    assert C.from_preset("grpo").needs_reference is True
    dapo = C.from_preset("dapo")
    assert (dapo.loss.clip_eps_low, dapo.loss.clip_eps_high, dapo.loss.loss_agg) == (0.2, 0.28, "token-mean")
    assert C.from_preset("dr_grpo").loss.std == "none"
    assert C.from_preset("onpolicy_sft").loss.advantage == "relu"
    assert C.from_preset("gspo").loss.policy_loss == "gspo"


def test_seed_future_and_ppo_presets():
    """Seed 004's futures (GRPO minus one trick each) and PPO with a value head."""
    o1 = C.from_preset("sft_o1")
    assert (o1.loss.policy_loss, o1.loss.advantage, o1.needs_reference) == ("weighted_nll", "relu", False)
    assert o1.rollout.prompts_per_step == 8 and o1.train.steps == 100 and o1.optimizer_steps_per_step == 1
    no_is = C.from_preset("grpo_no_is")
    assert (no_is.loss.policy_loss, no_is.loss.advantage, no_is.loss.loss_agg) == (
        "weighted_nll", "group_norm", "seq-mean-token-mean")
    assert no_is.off_policy_steps == 1 and not no_is.needs_reference
    assert C.from_preset("grpo_no_kl").loss.policy_loss == "clipped" and not C.from_preset("grpo_no_kl").needs_reference
    ppo = C.from_preset("ppo")
    assert (ppo.loss.advantage, ppo.loss.policy_loss, ppo.loss.loss_agg) == ("gae", "clipped", "token-mean")
    assert ppo.loss.kl_in_reward and ppo.loss.kl_estimator == "k1" and ppo.loss.kl_coef == 0.05 and ppo.needs_old_logp_pass
    assert (ppo.loss.gae_gamma, ppo.loss.gae_lambda, ppo.loss.value_coef, ppo.loss.value_clip) == (1.0, 0.95, 0.1, 0.2)


def test_derived_sizes():
    cfg = C.from_preset("grpo", ["rollout.prompts_per_step=4", "rollout.group_size=8", "train.minibatch_size=16",
                                 "train.microbatch_size=4", "train.epochs=2"])
    assert cfg.sequences_per_step == 32
    assert cfg.minibatches_per_epoch == 2
    assert cfg.microbatches_per_minibatch == 4
    assert cfg.optimizer_steps_per_step == 4
    assert cfg.needs_old_logp_pass
    one = cfg.replace(**{"train.epochs": 1, "train.minibatch_size": 32})
    assert not one.needs_old_logp_pass
    assert cfg.train.epochs == 2  # the original is untouched


def test_frozen():
    cfg = C.Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.lr = 1.0  # type: ignore[misc]


def test_overrides_parse_types():
    cfg = C.from_preset("grpo", ["loss.clip_eps_high=0.28", "loss.dual_clip=3", "loss.mask_truncated=true",
                                 "rewards=[exact_match:2.0, refusal]"])
    assert cfg.loss.clip_eps_high == 0.28 and cfg.loss.dual_clip == 3.0 and cfg.loss.mask_truncated is True
    assert [(r.name, r.weight) for r in cfg.rewards] == [("exact_match", 2.0), ("refusal", 1.0)]
    assert C.from_preset("grpo", ["loss.dual_clip=null"]).loss.dual_clip is None


@pytest.mark.parametrize(
    "override,needle",
    [
        ("loss.clip_eps_hgh=0.3", "Did you mean 'loss.clip_eps_high'"),
        ("lose.kl_coef=0", "Did you mean 'loss'"),
        ("train.lr=abc", "train.lr: expected a number"),
        ("train.steps=1.5", "train.steps: expected an integer"),
        ("loss.mask_truncated=3", "loss.mask_truncated: expected true or false"),
        ("train.minibatch_size=48", "set train.minibatch_size to one of"),
        ("train.microbatch_size=48", "set train.microbatch_size to one of"),
        ("loss.std=pop", "loss.std='pop' is not one of"),
        ("rollout.group_size=1", "group_size must be at least 2"),
        ("rollout.temperature=0", "rollout.temperature=0.0 must be > 0"),
        ("loss.dual_clip=0.5", "loss.dual_clip=0.5 must be > 1"),
        ("train.lr=-1", "train.lr=-1.0 must be > 0"),
        ("noequals", "expected key=value"),
        ("rollout.engine=sglang", "rollout.engine='sglang' is not one of hf, vllm"),
    ],
)
def test_bad_overrides_name_the_field(override, needle):
    with pytest.raises(C.ConfigError) as e:
        C.from_preset("grpo", [override])
    assert needle in str(e.value)


def test_yaml_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("preset: dapo\nrollout:\n  group_size: 8\n  temprature: 0.7\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(str(p))
    msg = str(e.value)
    assert f"{p}:4" in msg and "rollout.temprature" in msg and "temperature" in msg

    p.write_text("train:\n  lr: fast\n")
    with pytest.raises(C.ConfigError, match=r"bad.yaml:2: train.lr"):
        C.load(str(p))

    p.write_text("train: [1, 2\n")
    with pytest.raises(C.ConfigError, match="not valid YAML"):
        C.load(str(p))
    with pytest.raises(C.ConfigError, match="cannot be read"):
        C.load(str(tmp_path / "missing.yaml"))


def test_yaml_preset_then_file_values_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("preset: dapo\nloss:\n  clip_eps_high: 0.3\nrewards:\n  - {name: exact_match, weight: 0.5}\n")
    cfg = C.load(str(p), ["train.steps=7"])
    assert cfg.loss.loss_agg == "token-mean"  # from the preset
    assert cfg.loss.clip_eps_high == 0.3  # from the file
    assert cfg.train.steps == 7  # from the override
    assert [(r.name, r.weight) for r in cfg.rewards] == [("exact_match", 0.5)]


def test_unknown_preset():
    with pytest.raises(C.ConfigError, match="unknown preset 'a2c'"):
        C.from_preset("a2c")


def test_bf16_weights_needs_a_bf16_model_dtype():
    with pytest.raises(C.ConfigError, match="rollout.bf16_weights"):
        C.from_preset("grpo", ["rollout.bf16_weights=true", "model.dtype=float32"])


def test_packed_weights_is_for_the_eager_float32_loop():
    assert C.from_preset("grpo", ["rollout.packed_weights=true", "model.dtype=float32"]).rollout.packed_weights
    assert C.from_preset("grpo", ["rollout.packed_weights=true", "model.dtype=auto"]).rollout.packed_weights
    with pytest.raises(C.ConfigError, match="rollout.packed_weights.*rollout.compile=true"):
        C.from_preset("grpo", ["rollout.packed_weights=true", "rollout.compile=true"])
    with pytest.raises(C.ConfigError, match="rollout.packed_weights.*model.dtype=bfloat16"):
        C.from_preset("grpo", ["rollout.packed_weights=true", "model.dtype=bfloat16"])
    assert C.from_preset("grpo", ["rollout.bf16_weights=true", "model.dtype=bfloat16"]).rollout.bf16_weights


def test_compile_cpp_wrapper_needs_model_compile():
    with pytest.raises(C.ConfigError, match="model.compile_cpp_wrapper"):
        C.from_preset("grpo", ["model.compile=false", "model.compile_cpp_wrapper=true"])
    C.from_preset("grpo", ["model.compile_cpp_wrapper=true"])  # model.compile=auto: applies where it compiles
    assert C.from_preset("grpo", ["model.compile=true", "model.compile_cpp_wrapper=true"]).model.compile_cpp_wrapper


def test_the_world_size_comes_from_the_launcher_and_global_sizes_must_split(monkeypatch):
    base = ["rollout.prompts_per_step=6", "rollout.group_size=4", "train.minibatch_size=12", "train.microbatch_size=3"]
    assert C.from_preset("grpo", base).world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = C.from_preset("grpo", base)
    assert cfg.world_size == 2 and cfg.microbatches_per_minibatch == 2  # 12 / 2 ranks = 6 rows = 2 × 3
    with pytest.raises(C.ConfigError, match=r"rollout.prompts_per_step=5 does not split over the 2 ranks.*multiple of 2"):
        C.from_preset("grpo", base + ["rollout.prompts_per_step=5", "train.minibatch_size=20"])
    with pytest.raises(C.ConfigError, match=r"train.minibatch_size=3 does not split over the 2 ranks"):
        C.from_preset("grpo", base + ["train.minibatch_size=3", "train.microbatch_size=1"])
    with pytest.raises(C.ConfigError, match=r"train.microbatch_size=4 does not divide the 6 sequences of a minibatch "
                                            r"on each of 2 ranks.*one of \[1, 2, 3, 6\]"):
        C.from_preset("grpo", base + ["train.microbatch_size=4"])
    with pytest.raises(C.ConfigError, match=r"model.compile=true runs without a launcher only"):
        C.from_preset("grpo", base + ["model.compile=true"])
    with pytest.raises(C.ConfigError, match=r"train.parallel='zero3'"):
        C.from_preset("grpo", base + ["train.parallel=zero3"])
    with pytest.raises(C.ConfigError, match=r"gives 2 sequences per rank on 2 ranks, not whole groups of "
                                            r"rollout.group_size=4.*multiple of 8"):
        C.from_preset("grpo", ["rollout.prompts_per_step=2", "rollout.group_size=4", "train.minibatch_size=4",
                               "train.microbatch_size=4", "model.shared_prompt=true"])


def test_io_and_validation_do_not_import_the_config_classes():
    """The dependency runs one way, config/config.py -> io, validation (they are handed the classes)."""
    import ast
    import inspect

    from grpolab.config import io, validation

    for module in (io, validation):
        tree = ast.parse(inspect.getsource(module))
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m == "grpolab.config" or m.startswith("grpolab.config.") for m in mods), module.__name__
    assert C.ConfigError is __import__("grpolab.errors", fromlist=["ConfigError"]).ConfigError


@pytest.mark.parametrize("text,expected", [
    ("exact_match", ("exact_match", 1.0)),
    ("exact_match:2", ("exact_match", 2.0)),
    (" refusal : 0.5", ("refusal", 0.5)),
    ("mypkg.rewards:length_penalty", ("mypkg.rewards:length_penalty", 1.0)),
    ("mypkg.rewards:length_penalty:0.5", ("mypkg.rewards:length_penalty", 0.5)),
])
def test_reward_shorthand(text, expected):
    spec = C.RewardSpec.from_shorthand(text)
    assert (spec.name, spec.weight) == expected


def _field_docs():
    from grpolab.app.config_reference import attribute_docs

    return {cls: attribute_docs(cls) for cls in (C.ModelConfig, C.DataConfig, C.RolloutConfig, C.LossConfig,
                                                   C.TrainConfig, C.SFTConfig, C.RewardSpec, C.RunConfig)}


def test_every_field_has_a_docstring():
    for cls, docs in _field_docs().items():
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, (cls.__name__, missing)


def test_registry_backed_docstrings_do_not_enumerate_the_choices():
    """The choices are printed from the registries (grpolab config); a hand list would go stale."""
    from grpolab.config import validation

    docs = _field_docs()
    sections = {"loss": C.LossConfig, "train": C.TrainConfig, "rollout": C.RolloutConfig}
    for field, choices in validation.registry_choices().items():
        section, name = field.split(".")
        doc = docs[sections[section]][name]
        listed = [k for k in choices if k != validation.SFT_POLICY_LOSS and k in doc.replace("(", " ").split()]
        assert not listed, (field, listed)


def test_docstrings_cite_no_benchmark_history():
    import re

    for cls, docs in _field_docs().items():
        for name, doc in docs.items():
            assert not re.search(r"bench|session|measured|SmolLM2|\d\s*(s|MB|ms) per|\d\.\d+x\b|->\s*\d", doc), (cls.__name__, name)


@pytest.mark.parametrize("preset", ["onpolicy_sft", "reinforce", "reinforce_norm"])
def test_presets_without_an_importance_ratio_take_one_optimizer_step_per_rollout(preset):
    for sizes in ([], ["rollout.prompts_per_step=3", "rollout.group_size=4", "train.microbatch_size=4"]):
        cfg = C.from_preset(preset, sizes)
        assert cfg.minibatch_sequences == cfg.sequences_per_step
        assert cfg.optimizer_steps_per_step == 1 and cfg.off_policy_steps == 0
    more = C.from_preset(preset, ["train.epochs=2", "train.minibatch_size=64"])
    assert more.optimizer_steps_per_step == 2 * more.sequences_per_step // 64
    assert more.off_policy_steps == more.optimizer_steps_per_step - 1
    from grpolab.app.config_reference import config_reference

    text = config_reference(more)
    assert f"off-policy without correction: {more.off_policy_steps} of the {more.optimizer_steps_per_step}" in text
    assert "off-policy" not in config_reference(C.from_preset(preset))


def test_ratio_losses_are_never_counted_off_policy():
    cfg = C.from_preset("grpo", ["train.epochs=2"])
    assert cfg.optimizer_steps_per_step > 1 and cfg.off_policy_steps == 0
    with pytest.raises(C.ConfigError, match=r"train.minibatch_size=-1 must be ≥ 1, or 0"):
        C.from_preset("grpo", ["train.minibatch_size=-1"])


def test_dynamic_sampling_settings_are_checked_and_the_dapo_preset_uses_them():
    dapo = C.from_preset("dapo")
    assert dapo.rollout.dynamic_sampling and dapo.rollout.max_generation_batches == 10
    assert dapo.loss.filter_zero_std_groups  # groups filling a capped batch get no loss
    assert not C.from_preset("grpo").rollout.dynamic_sampling
    with pytest.raises(C.ConfigError, match=r"rollout.dynamic_sampling=true .* rollout.group_size=1 is; set rollout.group_size ≥ 2"):
        C.from_preset("dapo", ["rollout.group_size=1", "loss.advantage=reinforce", "train.minibatch_size=16",
                               "train.microbatch_size=16"])
    with pytest.raises(C.ConfigError, match=r"rollout.max_generation_batches=-1 must be ≥ 0"):
        C.from_preset("dapo", ["rollout.max_generation_batches=-1"])
    with pytest.raises(C.ConfigError, match=r"rollout.dynamic_sampling_reward='acc' is not one of"):
        C.from_preset("dapo", ["rollout.dynamic_sampling_reward=acc"])
    assert C.from_preset("dapo", ["rollout.dynamic_sampling_reward=exact_match"]).rollout.dynamic_sampling_reward


def test_an_override_inside_a_free_form_mapping_sets_it_and_the_next_overrides_still_apply():
    cfg = C.from_preset("grpo_no_kl", ["environment.name=grpolab.agents.builtin:GuessNumber",
                                       "environment.kwargs.n=12", "environment.kwargs.opts.hint=true", "train.steps=7"])
    assert dict(cfg.environment.kwargs) == {"n": 12, "opts": {"hint": True}} and cfg.train.steps == 7


@pytest.mark.parametrize("override, named", [("environment.kwarg.n=1", "environment.kwargs"),
                                             ("train.stepz=3", "train.steps"), ("trian.steps=3", "trian")])
def test_an_unknown_override_key_is_named(override, named):
    with pytest.raises(C.ConfigError, match=named):
        C.from_preset("grpo", [override])
