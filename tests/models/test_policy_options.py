"""The model section's LoRA options (PEFT's names: lora_targets, lora_alpha, lora_dropout) and
model.gradient_checkpointing: applied by load_policy / prepare_policy, validated with the field named;
checkpointing recomputes the decoder layers in backward and leaves the gradients unchanged, with and
without LoRA, in a plain forward and in a GRPO step through the trainer's own forward."""

import pytest
import torch
from safetensors.torch import load_file

import grpolab
from grpolab import config as C
from grpolab.errors import ConfigError
from grpolab.models.policy import load_policy

pytest.importorskip("peft", reason="peft is not installed (grpolab[lora])")

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2"]


def _cfg(*overrides: str) -> C.Config:
    return C.from_preset("grpo", [*TINY, *overrides])


def _adapted(model) -> set[str]:
    return {name.split(".")[-1] for name, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}


def test_lora_targets_alpha_and_dropout_reach_peft():
    default, _ = load_policy(_cfg("model.lora_rank=4"))
    assert _adapted(default) == {"q_proj", "v_proj"}  # PEFT's default for Qwen2
    model, _ = load_policy(_cfg("model.lora_rank=4", "model.lora_alpha=8", "model.lora_dropout=0.25",
                                "model.lora_targets=[q_proj, k_proj, v_proj, o_proj, down_proj]"))
    assert _adapted(model) == {"q_proj", "k_proj", "v_proj", "o_proj", "down_proj"}
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and len(m.lora_A))
    assert layer.scaling["default"] == 8 / 4
    assert layer.lora_dropout["default"].p == 0.25
    every, _ = load_policy(_cfg("model.lora_rank=4", "model.lora_targets=[all-linear]"))
    assert _adapted(every) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("overrides, field", [
    (["model.lora_rank=4", "model.lora_dropout=1.0"], "model.lora_dropout"),
    (["model.lora_rank=4", "model.lora_alpha=0"], "model.lora_alpha"),
    (["model.lora_rank=4", "model.lora_targets=['q proj']"], "model.lora_targets"),
    (["model.lora_targets=[q_proj]"], "model.lora_rank"),
    (["model.lora_rank=4", "model.lora_targets=[all-linear, q_proj]"], "all-linear"),
])
def test_bad_lora_options_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        _cfg(*overrides)


def test_a_target_no_module_has_is_an_error_naming_the_field():
    with pytest.raises(ValueError, match="model.lora_targets"):
        load_policy(_cfg("model.lora_rank=4", "model.lora_targets=[no_such_proj]"))


def _grads(lora: bool, checkpointing: bool) -> tuple[dict[str, torch.Tensor], int]:
    extra = ["model.lora_rank=4", "model.lora_targets=[all-linear]"] if lora else []
    model, _ = load_policy(_cfg(*extra, f"model.gradient_checkpointing={str(checkpointing).lower()}"))
    if lora:  # B = 0 at the start gives the A matrices no gradient: move B off zero
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
    calls = []  # its attention, inside what is checkpointed (transformers checkpoints the layer's forward)
    layer.self_attn.register_forward_hook(lambda *a: calls.append(1))
    model.train()
    ids = torch.randint(0, 20, (3, 12), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, len(calls)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_recomputes_and_leaves_the_gradients_equal(lora):
    plain, plain_calls = _grads(lora, False)
    checkpointed, ckpt_calls = _grads(lora, True)
    assert (plain_calls, ckpt_calls) == (1, 2)  # the layer ran again in backward: activations were not kept
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name in plain:
        assert plain[name].abs().sum() > 0, name
        torch.testing.assert_close(checkpointed[name], plain[name])


def test_a_grpo_step_with_checkpointing_equals_one_without(tmp_path):
    small = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "rollout.prompts_per_step": 2,
             "rollout.group_size": 4, "rollout.max_new_tokens": 4, "train.steps": 2, "train.minibatch_size": 4,
             "train.microbatch_size": 2, "train.lr": 1e-2, "loss.entropy_coef": 0.01, "run.progress": False,
             "run.tensorboard": False, "model.lora_rank": 4}
    final = {}
    for on in (False, True):
        out = tmp_path / str(on)
        res = grpolab.train("grpo", {**small, "model.gradient_checkpointing": on, "run.out_dir": str(out)})
        assert res.exit_code == 0
        final[on] = load_file(out / "checkpoints" / "step-2" / "model.safetensors")
    for k in final[False]:
        torch.testing.assert_close(final[True][k], final[False][k])


def test_lora_init_comes_from_train_seed_not_from_the_process_rng():
    first, _ = load_policy(_cfg("model.lora_rank=4"))
    torch.rand(1000)  # what an earlier run in the same process would have drawn
    again, _ = load_policy(_cfg("model.lora_rank=4"))
    other, _ = load_policy(_cfg("model.lora_rank=4", "train.seed=1"))
    a, b, c = (dict(m.named_parameters()) for m in (first, again, other))
    lora_a = [k for k in a if "lora_A" in k]
    assert lora_a and all(torch.equal(a[k], b[k]) for k in lora_a)
    assert not all(torch.equal(a[k], c[k]) for k in lora_a)
